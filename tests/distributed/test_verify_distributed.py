"""trainfit verify on 2 gloo processes: every strategy of the distribution issue passes against the
one-process fp32 big-batch reference, and a planted mean-of-means still fails with its cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .harness import errors, spawn

pytestmark = pytest.mark.distributed

CASES = [("ddp", "fp32", "deferred"), ("zero1", "fp32", "deferred"), ("zero2", "fp32", "per-micro-batch"),
         ("zero3", "fp32", "deferred"), ("zero3", "bf16-mixed", "deferred"), ("ddp", "fp16-mixed", "deferred")]
BASE = {"model_config": "n_layer=2,d_model=32,n_head=2", "seq_len": 16, "micro_batch": 2, "accumulation": 2,
        "dataset_size": 64}


def verify_worker(rank: int, root: Path) -> None:
    import trainfit.engine as engine
    from trainfit.config import make_config
    from trainfit.probes.verify import verify

    out = {}
    for strategy, precision, sync in CASES:
        r = verify(make_config({**BASE, "strategy": strategy, "precision": precision, "grad_sync": sync}))
        out[f"{strategy}-{precision}"] = r.to_dict()
    from tests.test_verify import MeanOfMeansWindow

    engine.AccumulationWindow = MeanOfMeansWindow  # planted in this process only
    out["ddp-mean-of-means"] = verify(make_config({**BASE, "strategy": "ddp"})).to_dict()
    (root / f"verify-rank{rank}.json").write_text(json.dumps(out))


def test_verify_every_strategy_on_two_ranks(tmp_path):
    codes = spawn(verify_worker, tmp_path)
    assert codes == [0, 0], errors(tmp_path)
    reports = [json.loads((tmp_path / f"verify-rank{r}.json").read_text()) for r in range(2)]
    for strategy, precision, _ in CASES:
        rep = reports[0][f"{strategy}-{precision}"]
        assert rep["passed"], (strategy, precision, rep)
        assert rep["world_size"] == 2 and rep["global_batch"] == 8
        assert rep["grad_cosine"] == reports[1][f"{strategy}-{precision}"]["grad_cosine"]  # ranks agree
    bad = reports[0]["ddp-mean-of-means"]
    assert not bad["passed"] and "mis-normalised accumulation" in bad["causes"][0]
