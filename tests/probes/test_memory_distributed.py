"""Per-rank accounting under zero3 on 2 gloo ranks: the tracker counts each rank's DTensor shards."""

import json
import math

import pytest
from distributed.harness import errors, spawn  # the 2-process gloo launcher of the distribution tests

pytestmark = pytest.mark.distributed
CFG = dict(model="gpt-tiny", model_config="n_layer=2,d_model=32,n_head=2", seq_len=16, micro_batch=2,
           accumulation=1, optimizer="adamw")


def _measure(rank, root):
    from trainfit.config import make_config
    from trainfit.probes.memory import measure_memory

    r = measure_memory(make_config({**CFG, "strategy": "zero3"}))
    (root / f"rank{rank}.json").write_text(json.dumps(r.to_dict()))


def test_zero3_per_rank_parts_are_the_local_shards(tmp_path):
    from trainfit.tasks.make import make_task

    model = make_task("gpt-tiny", model_config=CFG["model_config"], seq_len=16).build_model()
    shapes = [p.shape for p in model.parameters()]
    assert all(s[0] % 2 == 0 for s in shapes)  # even first dims: FSDP2 shards without padding
    full = sum(math.prod(s) * 4 for s in shapes)  # fp32 bytes of the unsharded model (plain PyTorch)
    assert spawn(_measure, tmp_path) == [0, 0], errors(tmp_path)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["params_bytes"] == full // 2
        assert r["grads_bytes"] == full // 2
        assert r["optimizer_bytes"] == full + 4 * len(shapes)  # two half-size moments + step counters
