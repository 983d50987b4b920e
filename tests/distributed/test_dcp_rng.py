"""Sharded checkpoints carry each rank's RNG: a dropout run resumed on the same world size is bitwise
the uninterrupted run; without the RNG files it is not (the control that shows the test can fail)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from .harness import BASE, TINY, errors, read_dcp_model, spawn

pytestmark = pytest.mark.distributed

DROPOUT = {**BASE, "model_config": TINY + ",dropout=0.2", "strategy": "zero2"}


def _cfg(root: Path, name: str, steps: int):
    from trainfit.config import make_config

    return make_config({**DROPOUT, "steps": steps, "run_dir": str(root / name)})


def dropout_runs(rank: int, root: Path) -> None:
    import torch.distributed as dist

    from trainfit.train import train

    torch.manual_seed(1234)  # the same global stream for every run below
    train(_cfg(root, "straight", 4), progress=False)
    torch.manual_seed(1234)
    train(_cfg(root, "split", 2), progress=False)
    torch.manual_seed(999)  # a fresh process would start elsewhere: the checkpoint must restore it
    train(_cfg(root, "split", 4), resume=True, progress=False)
    # control: the same split with the RNG files removed before resuming
    torch.manual_seed(1234)
    train(_cfg(root, "no-rng", 2), progress=False)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / "no-rng" / "checkpoints" / "step-00000002.dcp" / "rng")
    dist.barrier()
    torch.manual_seed(999)
    train(_cfg(root, "no-rng", 4), resume=True, progress=False)


def test_dropout_resume_on_two_ranks_is_bitwise_with_rng_in_the_checkpoint(tmp_path):
    codes = spawn(dropout_runs, tmp_path)
    assert codes == [0, 0], errors(tmp_path)
    ck = "checkpoints/step-00000004.dcp"
    straight = read_dcp_model(tmp_path / "straight" / ck)
    split = read_dcp_model(tmp_path / "split" / ck)
    assert all(torch.equal(straight[k], split[k]) for k in straight)
    assert sorted(p.name for p in (tmp_path / "split" / ck / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
    no_rng = read_dcp_model(tmp_path / "no-rng" / ck)
    assert not all(torch.equal(straight[k], no_rng[k]) for k in straight)
