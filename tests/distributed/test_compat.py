"""Pure checks of the strategy layer: no process group, no processes spawned."""

from __future__ import annotations

import pytest
import torch

from trainfit.config import make_config
from trainfit.errors import ConfigError
from trainfit.strategies import fit_to_world, make_strategy
from trainfit.strategies.compat import resolve_accumulation


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_sharding_strategy_without_process_group_is_refused(strategy):
    with pytest.raises(ConfigError, match=rf"strategy='{strategy}'.*needs a process group.*torchrun"):
        make_strategy(make_config({"strategy": strategy}))


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
@pytest.mark.parametrize("precision", ["fp16-true", "bf16-true"])
def test_true_half_with_fsdp_is_refused_at_config_time(strategy, precision):
    mixed = precision.replace("-true", "-mixed")
    with pytest.raises(ConfigError, match=rf"precision='{precision}'.*use {mixed}"):
        make_config({"strategy": strategy, "precision": precision})


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_true_half_with_replicated_masters_is_accepted(strategy):
    make_config({"strategy": strategy, "precision": "fp16-true"})


@pytest.mark.parametrize("global_batch,micro,world,acc", [(8, 2, 2, 2), (8, 2, 1, 4), (8, 4, 2, 1), (12, 2, 3, 2)])
def test_accumulation_from_global_batch(global_batch, micro, world, acc):
    assert resolve_accumulation(global_batch=global_batch, micro_batch=micro, accumulation=99, world_size=world) == acc
    assert acc * micro * world == global_batch


def test_global_batch_zero_keeps_accumulation():
    assert resolve_accumulation(global_batch=0, micro_batch=2, accumulation=3, world_size=4) == 3


@pytest.mark.parametrize("global_batch,micro,world,msg", [(5, 1, 2, "multiple of the world size 2"),
                                                          (6, 2, 2, r"world_size x micro_batch = 2 x 2 = 4"),
                                                          (2, 2, 2, r"world_size x micro_batch")])
def test_world_size_not_dividing_global_batch_is_refused(global_batch, micro, world, msg):
    cfg = make_config({"global_batch": global_batch, "micro_batch": micro})
    with pytest.raises(ConfigError, match=msg):
        fit_to_world(cfg, world)


def test_fsdp_mixed_precision_policy_follows_the_precision():
    from trainfit.levers.precision import make_precision
    from trainfit.strategies.zero import mixed_precision_policy

    got = {p: mixed_precision_policy(make_precision(p)) for p in ("fp32", "bf16-mixed", "fp16-mixed")}
    assert (got["fp32"].param_dtype, got["fp32"].reduce_dtype) == (None, None)
    assert (got["bf16-mixed"].param_dtype, got["bf16-mixed"].reduce_dtype) == (torch.bfloat16, torch.float32)
    assert (got["fp16-mixed"].param_dtype, got["fp16-mixed"].reduce_dtype) == (torch.float16, torch.float32)


def test_torchrun_environment_is_read_only_by_the_launcher(monkeypatch):
    from trainfit.strategies import launch

    for k in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert launch.torchrun_env() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    env = launch.torchrun_env()
    assert (env.rank, env.world_size, env.local_rank, env.restart_count) == (3, 4, 1, 2)
    assert launch._is_loopback("127.0.0.1") and launch._is_loopback("localhost") and not launch._is_loopback("10.0.0.2")


def test_cli_sharding_without_launcher_fails_before_any_step(tmp_path, capsys):
    from trainfit.cli import main

    rc = main(["train", "--strategy", "zero3", "--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "8",
               "--steps", "1", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "strategy='zero3'" in err and "torchrun --nproc_per_node=N" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_nproc_with_single_is_refused_before_launching(tmp_path, capsys):
    from trainfit.cli import main

    rc = main(["train", "--nproc", "2", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "strategy='single'" in err and "--devices 2 launches 2 processes" in err


def test_memory_estimate_per_rank_for_any_world_without_processes(capsys):
    """``trainfit memory --strategy zero3 --world 4 --estimate``: per-rank parts = a quarter of the hand count."""
    import json

    from trainfit.cli import main
    from trainfit.tasks.make import make_task

    flags = ["memory", "--estimate", "--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "8", "--batch", "2",
             "--optimizer", "adamw", "--json"]
    assert main([*flags, "--strategy", "zero3", "--world", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    n = sum(p.numel() for p in make_task("gpt-tiny", model_config="n_layer=1,d_model=32,n_head=2", seq_len=8)
            .build_model().parameters())
    assert out["params_bytes"] == pytest.approx(4 * n / 4, rel=0.01)
    assert out["grads_bytes"] == pytest.approx(4 * n / 4, rel=0.01)
    assert out["optimizer_bytes"] == pytest.approx(8 * n / 4, rel=0.01)  # Adam's two fp32 moments


def test_memory_measure_with_world_needs_torchrun(capsys):
    from trainfit.cli import main

    assert main(["memory", "--strategy", "zero2", "--world", "2"]) == 2
    assert "torchrun --nproc_per_node=N -m trainfit memory" in capsys.readouterr().err
