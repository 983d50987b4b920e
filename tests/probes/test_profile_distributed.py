"""2 gloo processes: exposed communication is measured, and the 2-device prediction made from
1-device steps (same per-process resources, alternated with the ddp steps) and the link's
measured bandwidth/latency is within 25% of the measured ddp step time."""

from __future__ import annotations

import json

import pytest
from distributed.harness import errors, spawn

from .dist_profile import single_then_ddp

pytestmark = pytest.mark.distributed


def test_ddp_exposed_comm_and_two_device_prediction(tmp_path):
    codes = spawn(single_then_ddp, tmp_path, 20, timeout_s=300)
    assert codes == [0, 0], errors(tmp_path)
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["world_size"] == 2
        assert r["ddp"]["comm_exposed_s"] > 0  # blocked in collectives (median over steps)
        predicted, measured = r["predicted_2"]["step_s"], r["ddp"]["step_s"]
        assert abs(predicted / measured - 1) < 0.25, (rank, predicted, measured, r["scaling"]["bandwidth_source"])
