"""``trainfit plan --write-for TOOL FILE``: each file loads with the tool's own parser and trains with it.

The reference is the plan's own chosen row (``plan --json``, entry 0) and the tool's own objects: the
Trainer's ``args``, Accelerate's ``ClusterConfig`` and ``Accelerator``, Lightning's ``Trainer`` -- and what
the tool actually did in a 2-step CPU run (forward calls per step, samples per forward, which layers
checkpoint). Distributed rows (zero1/zero3 on 2 devices) cannot run in one CPU process: their files are
parsed and the tool's objects built, not trained.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from tests.reliability.cli_harness import check_promise, cli, error_lines, snapshot
from trainfit.integrations import export_plan as ep

# gpt-tiny on a 66 MiB CPU "device": the planner picks micro-batch 4 x accumulation 2 for a global batch of 8.
SINGLE = ["plan", "--global-batch", "8", "--device-memory", "66MiB", "--device", "cpu", "--precisions", "bf16-mixed",
          "--checkpointings", "every:2", "--strategies", "single", "--top", "1", "--json", "--basis", "analytic"]
ZERO3 = ["plan", "--global-batch", "32", "--device-memory", "80GiB", "--devices", "2", "--checkpointings", "full",
         "--strategies", "zero3", "--top", "1", "--json", "--basis", "analytic"]


def _plan(tmp_path, base, tool, name):
    path = tmp_path / name
    r = cli([*base, "--write-for", tool, str(path)])
    assert r.rc == 0, r.err
    row = json.loads(r.out)["plans"][0]
    return row, path, r.err


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                      eos_token_id=0))


def _count_forwards(model: nn.Module) -> list[int]:
    sizes: list[int] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    return sizes


def test_hf_trainer_file_trains_with_the_plans_row(tmp_path):
    from transformers import Trainer, TrainingArguments

    row, path, err = _plan(tmp_path, SINGLE, "hf-trainer", "args.json")
    assert (row["micro_batch"], row["accumulation"]) == (4, 2)  # the planner's choice this test is about
    kwargs = json.loads(path.read_text())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **{**kwargs, "max_steps": 2}, report_to=[],
                             save_strategy="no", logging_strategy="no", disable_tqdm=True)
    assert args.per_device_train_batch_size == row["micro_batch"]
    assert args.gradient_accumulation_steps == row["accumulation"]
    assert args.bf16 and not args.fp16 and args.activation_checkpointing
    model = _tiny_gpt2()
    sizes = _count_forwards(model)
    rows = [{"input_ids": torch.randint(0, 64, (12,)), "labels": torch.randint(0, 64, (12,))} for _ in range(32)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
    assert trainer.state.global_step == 2
    assert sizes == [row["micro_batch"]] * (2 * row["accumulation"])
    # every:2 -> layers 0 and 2 recompute in backward, 1 and 3 keep their activations (trainfit's every:K)
    assert [blk.gradient_checkpointing for blk in model.transformer.h] == [True, False, True, False]
    assert trainer.accelerator.mixed_precision == "bf16"


def test_hf_trainer_zero3_is_fsdp2_full_shard(tmp_path):
    from transformers import TrainingArguments

    row, path, err = _plan(tmp_path, ZERO3, "hf-trainer", "args.json")
    kwargs = json.loads(path.read_text())
    assert kwargs["ddp_backend"] == "nccl"
    # The file is for 2 GPU processes under torchrun; this is one CPU process: no bf16 GPU (use_cpu) and no
    # process group to join (ddp_backend unset), the rest parsed by TrainingArguments as written.
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **{**kwargs, "ddp_backend": None}, report_to=[],
                             use_cpu=True)
    assert args.fsdp and args.fsdp_config["version"] == 2
    assert args.fsdp_plugin_args["fsdp_version"] == 2 and args.fsdp_plugin_args["reshard_after_forward"] is True
    assert args.fsdp_plugin_args["activation_checkpointing"] is True  # full, through FSDP's own
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps * 2 == 32
    assert "torchrun --nproc_per_node=2" in err


def test_accelerate_config_loads_and_the_script_settings_train(tmp_path):
    from accelerate import Accelerator
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    row, path, err = _plan(tmp_path, SINGLE, "accelerate", "acc.yaml")
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type == DistributedType.NO and cfg.num_processes == 1
    assert cfg.mixed_precision == "bf16" and cfg.use_cpu
    k = row["accumulation"]
    assert f"DataLoader(batch_size={row['micro_batch']}); Accelerator(gradient_accumulation_steps={k})" in \
        path.read_text()
    assert "micro_batch and accumulation" in err and "checkpointing" in err  # said, not dropped
    acc = Accelerator(mixed_precision=cfg.mixed_precision, cpu=cfg.use_cpu, gradient_accumulation_steps=k)
    assert acc.gradient_accumulation_steps == k and acc.mixed_precision == "bf16"
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.randn(4 * k * row["micro_batch"], 8), batch_size=row["micro_batch"])
    model, opt, loader = acc.prepare(model, opt, loader)
    steps = 0
    for i, x in enumerate(loader):
        with acc.accumulate(model):
            acc.backward(model(x).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
            steps += acc.sync_gradients
        if i + 1 == 2 * k:
            break
    assert steps == 2  # 2k micro-batches of the plan's size -> 2 optimizer steps


def test_accelerate_zero3_is_fsdp2(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    row, path, err = _plan(tmp_path, ZERO3, "accelerate", "acc.yaml")
    cfg = load_config_from_file(str(path))
    assert cfg.distributed_type == DistributedType.FSDP and cfg.num_processes == 2
    assert cfg.fsdp_config["fsdp_version"] == 2 and cfg.fsdp_config["fsdp_reshard_after_forward"] is True
    assert cfg.fsdp_config["fsdp_activation_checkpointing"] is True
    assert row["precision"] == "bf16-mixed" and cfg.mixed_precision == "bf16"  # bf16-true is not searched for it


def test_lightning_trainer_trains_with_the_plans_row(tmp_path):
    import lightning.pytorch as pl

    row, path, err = _plan(tmp_path, SINGLE, "lightning", "pl.json")
    cfg = json.loads(path.read_text())
    k, mb = row["accumulation"], row["micro_batch"]
    calls: list[int] = []

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch, i):
            calls.append(batch.shape[0])
            return self.layer(batch).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(**{**cfg["trainer"], "max_steps": 2}, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    assert trainer.accumulate_grad_batches == k and trainer.precision == "bf16-mixed"
    loader = torch.utils.data.DataLoader(torch.randn(8 * k * mb, 8), batch_size=cfg["batch_size"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), loader)
    assert trainer.global_step == 2 and calls == [mb] * (2 * k)
    assert "checkpointing: trainfit checkpoints every:2" in err  # Trainer has no argument for it: said


def test_lightning_zero3_builds_fsdp_and_fabric(tmp_path):
    import inspect

    import lightning as L
    import lightning.pytorch as pl
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning.pytorch.cli import instantiate_class

    row, path, err = _plan(tmp_path, ZERO3, "lightning", "pl.json")
    cfg = json.loads(path.read_text())
    assert cfg["trainer"]["accelerator"] == "gpu" and cfg["trainer"]["devices"] == 2
    assert cfg["trainer"]["accumulate_grad_batches"] == row["accumulation"]
    # Lightning refuses FSDP without a GPU: on this CPU the strategy objects are built by Lightning's own
    # instantiate_class from the file and the arguments bound to the tool's own signatures, not run.
    for section, cls in (("trainer", FSDPStrategy), ("fabric", FabricFSDP)):
        strategy = instantiate_class((), cfg[section]["strategy"])
        assert type(strategy) is cls and strategy.sharding_strategy.name == "FULL_SHARD"  # zero3: params sharded too
    inspect.signature(pl.Trainer).bind(**cfg["trainer"])
    inspect.signature(L.Fabric).bind(**cfg["fabric"])
    assert "Lightning's FSDPStrategy is FSDP1" in err


@pytest.mark.parametrize("tool", ep.TOOLS)
def test_zero1_and_a_master_copy_precision_are_refused_the_rest_listed_not_dropped(tool):
    from trainfit.config import make_config
    from trainfit.errors import ConfigError

    job = {"precision": "fp16-true", "devices": 2, "micro_batch": 2, "accumulation": 3, "checkpointing": "class:Block"}
    with pytest.raises(ConfigError, match="no ZeRO-1"):  # no tool has it outside DeepSpeed: it would run DDP
        ep.export_plan(tool, make_config({**job, "strategy": "zero1"}))
    # fp16-true (fp16 weights + an fp32 master copy) is no tool's precision outside DeepSpeed: never written as
    # another one (issue 35 row 5: it was written as fp16 autocast over fp32 weights)
    with pytest.raises(ConfigError, match="DeepSpeed.*--precisions fp16-mixed"):
        ep.export_plan(tool, make_config({**job, "strategy": "ddp"}))
    out = ep.export_plan(tool, make_config({**job, "precision": "fp16-mixed", "strategy": "ddp"}))
    assert {"checkpointing", "accumulation"} <= {g.lever for g in out.gaps}
    written = {"hf-trainer": lambda v: (v["fp16"], v["bf16"]) == (True, False),
               "accelerate": lambda v: v["mixed_precision"] == "fp16",
               "lightning": lambda v: v["trainer"]["precision"] == "16-mixed"}[tool]
    assert written(out.values)
    import yaml  # accelerate's own dependency; its loader is yaml.safe_load

    # the text holds exactly the values (YAML: "no" / "NO" stay strings, not YAML 1.1 booleans)
    assert (yaml.safe_load(out.text) if tool == "accelerate" else json.loads(out.text)) == out.values


def test_bad_input_refused_in_one_line(tmp_path, monkeypatch):
    existing = tmp_path / "args.json"
    existing.write_text("{}")
    base = ["plan", "--global-batch", "8", "--device-memory", "80GiB"]
    for args, expect in ((["--write-for", "hf-trainer", str(existing)], "--force"),
                         (["--write-for", "deepspeed", str(tmp_path / "d.json")], "hf-trainer, accelerate, lightning"),
                         (["--write-for", "accelerate", str(tmp_path / "a.json")], ".yaml")):
        before = snapshot(tmp_path)
        r = cli([*base, *args], cwd=tmp_path)
        assert r.rc == 2 and len(error_lines(r.err)) == 1 and expect in r.err, r.err
        check_promise(r, tmp_path, before)
    monkeypatch.setitem(ep.MODULES, "lightning", "lightning_not_installed_here")
    before = snapshot(tmp_path)
    r = cli([*base, "--write-for", "lightning", str(tmp_path / "pl.json")], cwd=tmp_path)
    assert r.rc == 2 and "pip install 'trainfit[lightning]'" in r.err and len(error_lines(r.err)) == 1, r.err
    check_promise(r, tmp_path, before)


def test_a_compiled_plan_row_is_written_as_each_tools_compile_or_listed(tmp_path):
    """--compile-speedup puts compile in the plan; each tool's file holds its own compile switch, parsed by the
    tool (TrainingArguments.torch_compile, accelerate's dynamo_config), or lists it as a gap (Lightning)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from transformers import TrainingArguments

    compiled = [*SINGLE, "--compile-speedup", "2"]
    row, path, err = _plan(tmp_path, compiled, "hf-trainer", "args.json")
    assert row["compile"] is True and "compile: trainfit compiles each repeated block" in err
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **json.loads(path.read_text()), report_to=[])
    assert args.torch_compile is True
    row, path, err = _plan(tmp_path, compiled, "accelerate", "acc.yaml")
    assert load_config_from_file(str(path)).dynamo_config["dynamo_backend"] == "INDUCTOR"
    row, path, err = _plan(tmp_path, compiled, "lightning", "trainer.json")
    assert "compile: trainfit compiles each repeated block" in err and "torch.compile" in err


def test_an_offloaded_plan_row_is_written_as_each_tools_fsdp_offload(tmp_path):
    """A 70B Llama on 8 devices of 80 GiB fits only with zero3's optimizer and parameters in host memory: each
    tool's file switches on its FSDP CPU offload, parsed or built by the tool itself."""
    from accelerate.commands.config.config_args import load_config_from_file
    from lightning.pytorch.cli import instantiate_class
    from transformers import TrainingArguments

    big = ["plan", "--model", "llama-70b", "--global-batch", "64", "--seq", "2048", "--device-memory", "80GiB",
           "--devices", "8", "--strategies", "zero3", "--checkpointings", "full", "--precisions", "bf16-mixed",
           "--top", "1", "--json", "--basis", "analytic"]
    row, path, err = _plan(tmp_path, big, "hf-trainer", "args.json")
    assert row["offload"] == "optimizer,params" and row["offload_s"] > 0
    kwargs = json.loads(path.read_text())
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **{**kwargs, "ddp_backend": None}, report_to=[],
                             use_cpu=True)
    assert args.fsdp_plugin_args["cpu_offload"] is True
    row, path, err = _plan(tmp_path, big, "accelerate", "acc.yaml")
    assert load_config_from_file(str(path)).fsdp_config["fsdp_offload_params"] is True
    row, path, err = _plan(tmp_path, big, "lightning", "pl.json")
    strategy = instantiate_class((), json.loads(path.read_text())["trainer"]["strategy"])
    assert strategy.cpu_offload.offload_params is True and strategy.sharding_strategy.name == "FULL_SHARD"


@pytest.mark.parametrize("offload, says", [("optimizer", "DeepSpeed ZeRO-Offload"), ("activations", "save_on_cpu"),
                                           ("activations,optimizer", "save_on_cpu")])
def test_offload_a_tool_cannot_express_is_refused_not_written(offload, says):
    """Issue 35 row 5: an optimizer offload outside FSDP (and an activation offload) has no setting in any of the
    three files: refused in one line, never written as a plain configuration that would not fit."""
    from trainfit.config import make_config
    from trainfit.errors import ConfigError

    cfg = make_config({"offload": offload, "micro_batch": 2})
    for tool in ep.TOOLS:
        with pytest.raises(ConfigError, match=says) as caught:
            ep.export_plan(tool, cfg, cpu=True)
        assert "\n" not in str(caught.value) and f"offload={offload}" in str(caught.value)
