"""The learning-rate schedule: values against a hand calculation, the lr each step of a built run uses,
skipped and failed steps, and resume -- bitwise, with and without the schedule in the checkpoint."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from reliability.cli_harness import cli
from trainfit.checkpoint import list_checkpoints, read_checkpoint, save_checkpoint
from trainfit.config import RunConfig
from trainfit.errors import CheckpointError
from trainfit.levers.schedule import lr_factor
from trainfit.run import build_run
from trainfit.tasks.base import to_device
from trainfit.train import train

TINY = dict(model_config="n_layer=1,d_model=32,n_head=2", seq_len=16, micro_batch=2, accumulation=2, lr=1e-2,
            dataset_size=64)
COSINE = dict(schedule="cosine", warmup_steps=2, min_lr=1e-3, steps=6)
# By hand: warm-up (s+1)/2 -> 0.5, 1; then progress (s+1-2)/(6-2) = 1/4 .. 4/4 on the cosine from 1 to 0.1.
COSINE_FACTORS = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)]


def _f(step, schedule, warmup, total, lr=1.0, min_lr=0.0):
    return lr_factor(step, schedule=schedule, warmup_steps=warmup, total_steps=total, lr=lr, min_lr=min_lr)


def test_constant_with_warmup_by_hand():
    assert [_f(s, "constant", 4, 10) for s in range(10)] == [0.25, 0.5, 0.75, 1.0] + [1.0] * 6


def test_no_warmup_constant_is_exactly_one():
    assert all(_f(s, "constant", 0, 7) == 1.0 for s in range(7))


def test_linear_by_hand():
    # W=2, T=6, min_lr/lr = 0.2: warm-up 0.5, 1; then 1 - 0.8 * (1/4, 2/4, 3/4, 4/4).
    got = [_f(s, "linear", 2, 6, lr=1e-3, min_lr=2e-4) for s in range(6)]
    assert got == pytest.approx([0.5, 1.0, 0.8, 0.6, 0.4, 0.2], rel=1e-12)


def test_cosine_by_hand():
    # No warm-up, T=4, floor 0.1: progress 1/4, 1/2, 3/4, 1; cos(pi/4) = sqrt(2)/2.
    got = [_f(s, "cosine", 0, 4, lr=0.1, min_lr=0.01) for s in range(4)]
    half_root2 = math.sqrt(2) / 2
    assert got == pytest.approx([0.1 + 0.45 * (1 + half_root2), 0.55, 0.1 + 0.45 * (1 - half_root2), 0.1], rel=1e-12)
    assert got[-1] == pytest.approx(0.1, rel=1e-15)  # min_lr exactly at the last step


def test_warmup_as_long_as_the_run_and_steps_past_the_end():
    assert [_f(s, "cosine", 5, 3) for s in range(3)] == [1 / 5, 2 / 5, 3 / 5]
    assert _f(10, "linear", 0, 4, lr=1.0, min_lr=0.5) == 0.5  # past the end: the last step's value
    assert _f(0, "cosine", 0, 1, lr=0.0, min_lr=0.0) == 0.0  # lr 0: no division by zero
    with pytest.raises(ValueError):
        _f(-1, "constant", 0, 4)


def _micro_batches(run, n):
    ds = run.task.dataset()
    return [to_device(run.task.collate([ds[2 * i], ds[2 * i + 1]]), run.strategy.device) for i in range(n)]


def test_a_built_run_steps_with_the_hand_lr_and_skipped_steps_advance_it():
    """LambdaLR drives the optimizer: step s uses lr * factor(s); a skipped step moves it on (no warning,
    even when the very first step is skipped); a step that raised does not."""
    cfg = RunConfig(**{**TINY, **COSINE, "accumulation": 1})
    run = build_run(cfg)
    mbs = _micro_batches(run, 1)
    nan_loss = lambda model, mb: (run.task.loss(model, mb)[0] * float("nan"), None)  # noqa: E731
    seen, stepped = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PyTorch's "scheduler.step() before optimizer.step()" would fail here
        for s in range(6):
            seen.append(run.current_lr())
            res = run.step(mbs, loss_fn=nan_loss if s == 0 else None)
            stepped.append(res.stepped)
            assert run.optimizer.param_groups[0]["lr"] == run.current_lr()
    assert stepped == [False] + [True] * 5
    assert seen == pytest.approx([1e-2 * f for f in COSINE_FACTORS], rel=1e-12)

    def oom(model, mb):
        raise torch.OutOfMemoryError("stand-in")

    before = run.current_lr()
    with pytest.raises(torch.OutOfMemoryError):
        run.step(mbs, loss_fn=oom)
    assert run.current_lr() == before and run.scheduler.last_epoch == 6


def test_constant_schedule_leaves_the_lr_untouched():
    run = build_run(RunConfig(**TINY, steps=3))
    run.step(_micro_batches(run, 2))
    assert run.current_lr() == 1e-2 and type(run.current_lr()) is float


def _kill_after(run_dir, step):
    """What a run killed after ``step`` leaves: its later checkpoints gone."""
    for p in list_checkpoints(run_dir):
        if int(p.stem.split("-")[1]) > step:
            p.with_suffix(".json").unlink()
            p.unlink()


def _logged_lr(run_dir):
    return [json.loads(line)["lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("drop_schedule", [False, True], ids=["with-schedule", "checkpoint-before-schedules"])
def test_resume_mid_schedule_is_bitwise(tmp_path, drop_schedule):
    """Warm-up + cosine + decay groups, killed after step 3 and resumed == uninterrupted (torch.equal on every
    weight and optimizer tensor). A checkpoint without "schedule" (an older trainfit) resumes the same way."""
    cfg = RunConfig(**TINY, **COSINE, weight_decay=0.1, checkpoint_every=3, keep_checkpoints=5,
                    run_dir=str(tmp_path / "run"))
    train(cfg, progress=False)
    straight = read_checkpoint(list_checkpoints(cfg.run_dir)[-1])
    _kill_after(cfg.run_dir, 3)
    if drop_schedule:
        path = list_checkpoints(cfg.run_dir)[-1]
        payload = {k: v for k, v in read_checkpoint(path).items() if k not in ("schedule", "format")}
        save_checkpoint(cfg.run_dir, 3, payload, keep=5)
        assert "schedule" not in read_checkpoint(path)
    train(cfg, resume=True, progress=False)
    resumed = read_checkpoint(list_checkpoints(cfg.run_dir)[-1])
    assert resumed["step"] == straight["step"] == 6
    for key in ("model", "optimizer"):
        a, b = straight[key], resumed[key]
        tensors = a if key == "model" else {(i, k): v for i, s in a["state"].items() for k, v in s.items()}
        other = b if key == "model" else {(i, k): v for i, s in b["state"].items() for k, v in s.items()}
        assert tensors.keys() == other.keys()
        assert all(torch.equal(tensors[k], other[k]) for k in tensors), key
    assert resumed["schedule"]["last_epoch"] == 6
    assert _logged_lr(tmp_path / "run") == pytest.approx([1e-2 * f for f in COSINE_FACTORS], rel=1e-12)


def test_resume_refuses_another_schedule(tmp_path):
    cfg = RunConfig(**TINY, **COSINE, checkpoint_every=2, run_dir=str(tmp_path / "run"))
    base = ["train", "--run-dir", cfg.run_dir, "--model-config", TINY["model_config"], "--seq-len", "16",
            "--micro-batch", "2", "--accumulation", "2", "--lr", "0.01",
            "--schedule", "cosine", "--min-lr", "0.001"]
    assert cli([*base, "--warmup-steps", "2", "--steps", "2"]).rc == 0
    for change, word in ((["--warmup-steps", "3", "--steps", "2"], "warmup_steps"),
                         (["--warmup-steps", "2", "--steps", "4"], "steps=2"),
                         (["--warmup-steps", "2", "--steps", "2", "--lr", "0.02"], "lr=")):
        res = cli([*base, *change, "--resume"])
        assert res.rc == 2 and word in res.err and "Traceback" not in res.err, res.err
    with pytest.raises(CheckpointError, match="steps=2"):  # the library refuses it too, before any step
        train(RunConfig(**{**TINY, **COSINE, "dataset_size": 4096, "steps": 4, "run_dir": cfg.run_dir}), resume=True,
              progress=False)


# -- sharded checkpoints on 2 gloo ranks: zero1 (the optimizer's groups partitioned), warm-up + cosine ------------
def _zero1_cfg(root, name: str):
    from distributed.harness import ADAMW, BASE

    from trainfit.config import make_config

    return make_config({**BASE, **ADAMW, "strategy": "zero1", "weight_decay": 0.1, "schedule": "cosine",
                        "warmup_steps": 2, "min_lr": 3e-4, "steps": 4, "checkpoint_every": 2,
                        "keep_checkpoints": 5, "run_dir": str(root / name)})


def zero1_killed_and_resumed(rank: int, root) -> None:
    import shutil

    import torch.distributed as dist

    cfg = _zero1_cfg(root, "run")
    groups = build_run(cfg).optimizer.optim.param_groups  # this rank's partition, group by group
    assert sorted({g["weight_decay"] for g in groups}) == [0.0, 0.1], groups
    train(cfg, progress=False)
    dist.barrier()
    if rank == 0:  # keep the uninterrupted result, then leave what a kill after step 2 leaves
        ck = root / "run" / "checkpoints"
        shutil.copytree(ck / "step-00000004.dcp", root / "straight.dcp")
        shutil.rmtree(ck / "step-00000004.dcp")
    dist.barrier()
    train(cfg, resume=True, progress=False)


@pytest.mark.distributed
def test_zero1_resume_mid_schedule_on_two_ranks_is_bitwise(tmp_path):
    from distributed.harness import errors, read_dcp_model, spawn

    assert spawn(zero1_killed_and_resumed, tmp_path) == [0, 0], errors(tmp_path)
    straight = read_dcp_model(tmp_path / "straight.dcp")
    resumed = read_dcp_model(tmp_path / "run" / "checkpoints" / "step-00000004.dcp")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step-00000004.dcp" / "trainfit.json").read_text())
    assert meta["schedule"]["last_epoch"] == 4
    # by hand: warm-up 1/2, 1; then cosine from 1 to 0.1 over progress 1/2, 1
    hand = [0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)), 0.1]
    assert _logged_lr(tmp_path / "run") == pytest.approx([3e-3 * f for f in hand], rel=1e-12)
