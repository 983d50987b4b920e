"""Shared helpers for the reliability tests: the tiny GPT, bitwise comparison of saved states (the CLI in this
process: the ``trainfit_cli`` fixture of tests/conftest.py, or cli_harness.cli)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

TINY_FLAGS = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16", "--micro-batch", "2",
              "--accumulation", "2"]
"""The tiny GPT every reliability test trains (about 30k parameters)."""

TINY_VALUES = {"model_config": "n_layer=1,d_model=32,n_head=2", "seq_len": 16, "micro_batch": 2, "accumulation": 2}


def tiny_config(**overrides):
    from trainfit.config import make_config

    return make_config({**TINY_VALUES, **overrides})


def error_lines(stderr: str) -> list[str]:
    """Lines on stderr other than the progress bar's (tqdm redraws with carriage returns)."""
    return [ln for ln in stderr.replace("\r", "\n").splitlines() if ln.strip() and "step/s" not in ln
            and "?step" not in ln and not ln.lstrip().startswith(("0%", "100%")) and "%|" not in ln]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)  # bitwise: NaN == NaN, -0.0 != 0.0


def tensors_equal(a, b, path: str = "") -> list[str]:
    """Paths where two nested containers of tensors differ (bitwise); [] when identical."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [path]
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}.keys"]
        return [d for k in a for d in tensors_equal(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}.len"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in tensors_equal(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def training_state(ckpt: dict) -> dict:
    """The parts of a checkpoint that must match bitwise between runs (not the run_dir in the config)."""
    return {k: ckpt[k] for k in ("step", "model", "optimizer", "precision", "rng", "data")}


@pytest.fixture(autouse=True)
def _one_thread():
    """The tiny model gains nothing from intra-op threads; on a loaded 2-core machine they spin."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def latest(run_dir: Path):
    from trainfit.checkpoint import load_latest

    found = load_latest(run_dir)
    assert found is not None, f"no checkpoint in {run_dir}"
    return found
