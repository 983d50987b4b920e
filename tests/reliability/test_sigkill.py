"""A handful of SIGKILL trials in CI (the full stress run is benchmarks/stress_sigkill.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = str(Path(__file__).resolve().parents[2] / "benchmarks")


def _stress():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)  # importable by name: the fork server imports the child's entry point
    import stress_sigkill

    return stress_sigkill


@pytest.mark.timeout(300)
def test_sigkill_at_random_moments_then_resume_is_bitwise(tmp_path):
    stress = _stress()
    # dropout > 0: the resumed run must also continue the RNG stream exactly.
    extra = ["--model-config", "n_layer=1,d_model=32,n_head=2,dropout=0.1"]
    summary, trials = stress.run(trials=3, steps=16, seed=1, workdir=tmp_path, extra=extra, phases=("training",),
                                 kill_counts=(1,), launcher="forkserver")
    assert summary["faults_injected"] >= 2, trials  # a kill drawn after the run's end finds it finished
    assert summary["newest_checkpoint_verified"] == summary["newest_checkpoint_checked"], trials
    assert summary["final_state_bitwise_equal"] == 3, trials
    assert summary["bytes_lost"] == 0 and summary["tmp_files_left"] == 0, trials
    assert summary["metrics_log_exact"] == 3, trials  # metrics.jsonl: steps 1..N once each after resumes
    assert summary["max_steps_redone"] <= 1, trials  # --checkpoint-every 1: at most the step in flight


def test_diff_bytes_counts_differences():
    """The stress script's own measure of lost bytes must see a one-bit change."""
    import torch

    stress = _stress()
    a = {"w": torch.zeros(4), "n": 3}
    b = {"w": torch.tensor([0.0, 0.0, float.fromhex("0x1p-149"), 0.0]), "n": 3}
    assert stress._diff_bytes(a, a) == 0
    assert stress._diff_bytes(a, b) == 1
    assert stress._diff_bytes(a, {"w": torch.zeros(4), "n": 4}) > 0
