"""A written plan runs exactly as planned, or is not written (issue 35, rows 5 and 6).

Each ``plan --write-for`` file for a row with an offload, a sharding stage (zero2, zero3) and a precision is loaded
by the tool's own objects -- the HF Trainer's ``TrainingArguments`` and the ``FullyShardedDataParallelPlugin`` the
Trainer builds from it; accelerate's launcher (its config loading and the environment ``accelerate launch`` hands
the script) and the plugin built from that environment; Lightning's ``instantiate_class`` and its ``FSDPStrategy``
and ``FSDPPrecision`` -- and the offload device, precision and sharding those objects report are compared with
the plan's row. These rows are FSDP on GPUs: on this CPU they are loaded, not launched (the ddp rows are launched
in test_write_for_launch.py). What no file holds as planned (a master-copy precision, an optimizer offload outside
FSDP) is refused in one line, nothing written.
"""

from __future__ import annotations

import json
import os
import warnings
from unittest import mock

import pytest

from tests.reliability.cli_harness import check_one_line, check_promise, cli, error_lines, snapshot

LLAMA = ["plan", "--model", "llama-7b", "--global-batch", "8", "--basis", "analytic", "--top", "1", "--json"]
# llama-7b on two 40 GiB devices: fits only with the optimizer state (and under zero3 the parameters) on the host
OFFLOADED = [*LLAMA, "--device-memory", "40GiB", "--devices", "2", "--precisions", "bf16-mixed",
             "--checkpointings", "full"]
# ... and on two 80 GiB devices without offload
ROOMY_ANY = [*LLAMA, "--device-memory", "80GiB", "--devices", "2", "--checkpointings", "full", "--offloads", "none"]
ROOMY = [*ROOMY_ANY, "--precisions", "fp32,bf16-mixed"]
ROWS = {  # name: (plan flags, the strategy, the offload, the precision the row must have)
    "zero2-offload": ([*OFFLOADED, "--strategies", "zero2"], "zero2", "optimizer", "bf16-mixed"),
    "zero3-offload": ([*OFFLOADED, "--strategies", "zero3"], "zero3", "optimizer,params", "bf16-mixed"),
    "zero2": ([*ROOMY, "--strategies", "zero2"], "zero2", "", None),
    "zero3": ([*ROOMY, "--strategies", "zero3"], "zero3", "", None),
}
FILES = {"hf-trainer": "args.json", "accelerate": "acc.yaml", "lightning": "pl.json"}


def _written(tmp_path, name, tool):
    flags, strategy, offload, precision = ROWS[name]
    path = tmp_path / FILES[tool]
    r = cli([*flags, "--write-for", tool, str(path)])
    assert r.rc == 0, r.err
    row = json.loads(r.out)["plans"][0]
    row["offload"] = row.get("offload", "")  # the JSON row leaves out an offload of none
    assert (row["strategy"], row["offload"]) == (strategy, offload), row  # the row this test is about
    assert precision is None or row["precision"] == precision
    return row, path


def _reshards(strategy: str) -> bool:
    """ZeRO-3 frees the gathered parameters after forward; ZeRO-2 keeps them until backward (torch FSDP docs)."""
    return strategy == "zero3"


def _hf_plugin(path, tmp_path):
    """The FullyShardedDataParallelPlugin the Trainer builds (Trainer.create_accelerator_and_postprocess) from
    TrainingArguments(**file): one CPU process here, so no process group (ddp_backend) and use_cpu."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    kwargs = json.loads(path.read_text())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **{**kwargs, "ddp_backend": None}, report_to=[],
                             use_cpu=True)
    return args, FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)


def _accelerate_plugin(path):
    """What ``accelerate launch --config_file FILE`` hands the script: its own parser and validation, the
    environment it builds for the processes, and the FSDP plugin Accelerator() builds from that environment."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    with mock.patch.dict(os.environ, env):
        return args, env, FullyShardedDataParallelPlugin()


@pytest.mark.parametrize("name", ROWS)
def test_hf_trainer_file_holds_the_rows_sharding_offload_and_precision(tmp_path, name):
    from torch.distributed.fsdp import CPUOffloadPolicy

    row, path = _written(tmp_path, name, "hf-trainer")
    args, plugin = _hf_plugin(path, tmp_path)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is _reshards(row["strategy"])
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == bool(row["offload"])
    assert (args.bf16, args.fp16) == (row["precision"] == "bf16-mixed", False)


@pytest.mark.parametrize("name", ROWS)
def test_accelerate_file_holds_the_rows_sharding_offload_and_precision(tmp_path, name):
    from torch.distributed.fsdp import CPUOffloadPolicy

    row, path = _written(tmp_path, name, "accelerate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args, env, plugin = _accelerate_plugin(path)
    assert args.num_processes == 2 and env["ACCELERATE_USE_FSDP"] == "true"
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is _reshards(row["strategy"])
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == bool(row["offload"])
    assert env["ACCELERATE_MIXED_PRECISION"] == {"bf16-mixed": "bf16", "fp32": "no"}[row["precision"]]


@pytest.mark.parametrize("name", ROWS)
def test_lightning_file_holds_the_rows_sharding_offload_and_precision(tmp_path, name):
    """Row 6: a zero2 file said strategy "fsdp", which Lightning runs as FULL_SHARD (zero3)."""
    import lightning.pytorch as pl
    import torch
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
    from lightning.pytorch.cli import instantiate_class
    from lightning.pytorch.plugins.precision import FSDPPrecision
    from lightning.pytorch.strategies import FSDPStrategy

    row, path = _written(tmp_path, name, "lightning")
    cfg = json.loads(path.read_text())
    stage = "FULL_SHARD" if _reshards(row["strategy"]) else "SHARD_GRAD_OP"
    for section, cls in (("trainer", FSDPStrategy), ("fabric", FabricFSDP)):
        strategy = instantiate_class((), cfg[section]["strategy"])
        assert type(strategy) is cls and strategy.sharding_strategy.name == stage
        assert (strategy.cpu_offload is not None and strategy.cpu_offload.offload_params) == bool(row["offload"])
    mp = FSDPPrecision(cfg["trainer"]["precision"]).mixed_precision_config  # what Lightning's FSDP computes in
    assert mp.param_dtype == {"bf16-mixed": torch.bfloat16, "fp32": torch.float32}[row["precision"]]
    with pytest.raises(ValueError, match="invalid strategy"):  # the file as plain kwargs fails loudly, never FULL_SHARD
        pl.Trainer(**{**cfg["trainer"], "accelerator": "cpu"})


@pytest.mark.parametrize("tool", FILES)
def test_a_single_device_row_that_needs_optimizer_offload_is_not_written_as_a_plain_config(tmp_path, tool):
    """Row 5: llama-7b on one 80 GiB device, global batch 8, fits only with the optimizer state on the host;
    before, the file was a plain config (about 134 GiB needed). No file holds that offload outside DeepSpeed: the
    search keeps to what the file holds, nothing fits, nothing is written, exit 2."""
    path = tmp_path / FILES[tool]
    before = snapshot(tmp_path)
    r = cli([*LLAMA, "--device-memory", "80GiB", "--device", "h100", "--write-for", tool, str(path)], cwd=tmp_path)
    check_promise(r, tmp_path, before, json_mode=True)
    assert r.rc == 2 and not path.exists()
    assert any(ln.startswith(f"--write-for {tool}: searched only rows its file holds") for ln in error_lines(r.err))
    plain = cli([*LLAMA, "--device-memory", "80GiB", "--device", "h100"])  # the same plan for trainfit itself
    assert plain.rc == 0 and json.loads(plain.out)["plans"][0]["offload"] == "optimizer"


@pytest.mark.parametrize("tool", FILES)
def test_a_master_copy_precision_is_refused_in_one_line_or_left_out_of_the_search(tmp_path, tool):
    """Row 5: a bf16-true row (bf16 weights + an fp32 master copy) was written as Accelerate's mixed_precision
    bf16 (autocast over fp32 weights), the Trainer's bf16=True, or Lightning's bf16-mixed."""
    path = tmp_path / FILES[tool]
    before = snapshot(tmp_path)
    r = cli([*ROOMY_ANY, "--strategies", "ddp", "--precisions", "bf16-true", "--write-for", tool, str(path)],
            cwd=tmp_path)
    check_promise(r, tmp_path, before)
    check_one_line(r)
    assert r.rc == 2 and "precisions='bf16-true'" in r.err and "DeepSpeed" in r.err and "bf16-mixed" in r.err
    # without --precisions, the search for the tool leaves master copies out: gpt-tiny on one H100, whose best
    # row for trainfit itself is bf16-true (what the file said as bf16 autocast before)
    tiny = ["plan", "--global-batch", "8", "--device-memory", "80GiB", "--basis", "analytic", "--top", "1", "--json"]
    trainfit_own = cli(tiny)
    assert json.loads(trainfit_own.out)["plans"][0]["precision"] == "bf16-true"
    r = cli([*tiny, "--write-for", tool, str(path)])
    assert r.rc == 0, r.err
    assert json.loads(r.out)["plans"][0]["precision"] in ("bf16-mixed", "fp16-mixed", "fp32")


def test_a_ddp_row_with_optimizer_offload_among_sharded_ones_is_refused_when_written():
    """Where the search holds both FSDP and DDP strategies with an optimizer offload, a ddp+offload row can still
    be chosen: export refuses it in one line naming the fix, nothing written (front.plan.export_for)."""
    from trainfit.config import make_config
    from trainfit.errors import ConfigError
    from trainfit.integrations.export_plan import TOOLS, export_plan

    cfg = make_config({"strategy": "ddp", "devices": 2, "offload": "optimizer", "micro_batch": 2})
    for tool in TOOLS:
        with pytest.raises(ConfigError, match="--strategies zero2,zero3 or --offloads none") as caught:
            export_plan(tool, cfg)
        assert "\n" not in str(caught.value)
