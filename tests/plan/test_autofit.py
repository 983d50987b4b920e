"""Auto-fit: out-of-memory under the CPU memory cap shrinks the split, redoes the step, same result."""

from __future__ import annotations

import json

import pytest
import torch

from trainfit.checkpoint import load_latest
from trainfit.config import make_config
from trainfit.errors import ConfigError, TrainfitError
from trainfit.levers.autofit import resolve_auto, shrink
from trainfit.train import train

TINY = "n_layer=2,d_model=32,n_head=2"
# Measured with `trainfit.probes.memory.measure_memory` on this config: peak 2.44 MB at micro-batch 8
# (a step with Adam state; the very first step passes 1.97 MB in backward), 1.66 MB at 4 x accumulation 2.
# This cap makes the starting micro-batch fail in the first step's backward and lets 4 x 2 through.
CAP = 1_800_000


def test_shrink_keeps_the_share():
    assert shrink(8, 1) == (4, 2)
    assert shrink(4, 3) == (2, 6)
    assert shrink(3, 4) == (2, 6)  # odd: largest smaller divisor of the share 12
    assert shrink(5, 1) == (1, 5)
    with pytest.raises(TrainfitError, match="micro-batch 1"):
        shrink(1, 8)


def test_auto_needs_global_batch():
    with pytest.raises(ConfigError, match="global_batch"):
        resolve_auto(make_config({"micro_batch": "auto"}), 1)
    cfg = resolve_auto(make_config({"micro_batch": "auto", "global_batch": 12}), 2)
    assert (cfg.micro_batch, cfg.accumulation) == (6, 1)


def _params(run_dir):
    return load_latest(run_dir)[1]["model"]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_autofit_equals_run_started_small(tmp_path):
    base = {"model_config": TINY, "seq_len": 32, "steps": 3, "grad_clip": 1.0}
    with pytest.raises(TrainfitError, match="out of memory at micro_batch=8"):  # the cap does bite at 8
        train(make_config({**base, "micro_batch": 8, "accumulation": 1, "memory_cap": CAP,
                           "run_dir": str(tmp_path / "fixed")}), progress=False)
    auto = train(make_config({**base, "micro_batch": "auto", "global_batch": 8, "memory_cap": CAP,
                              "run_dir": str(tmp_path / "auto")}), progress=False)
    # The reference runs under the same cap (which it fits): the tracker's dispatch mode can route ops such
    # as attention through other kernels, and Adam's first steps magnify last-bit differences.
    ref = train(make_config({**base, "micro_batch": 4, "accumulation": 2, "memory_cap": CAP,
                             "run_dir": str(tmp_path / "ref")}), progress=False)
    assert auto.effective_batch == ref.effective_batch == 8
    ma, mr = _metrics(tmp_path / "auto"), _metrics(tmp_path / "ref")
    assert [m["count"] for m in ma] == [m["count"] for m in mr]  # no sample skipped or counted twice
    assert [m["loss"] for m in ma] == pytest.approx([m["loss"] for m in mr], rel=1e-5)
    pa, pr = _params(tmp_path / "auto"), _params(tmp_path / "ref")
    for k in pr:
        torch.testing.assert_close(pa[k], pr[k], rtol=1e-5, atol=1e-6)
