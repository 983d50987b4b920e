"""Diagnosis order and advice content (pure)."""

import pytest

from trainfit.errors import ConfigError
from trainfit.probes.advice import Findings, Thresholds, advise

BASE = dict(comm_exposed_frac=0.0, h2d_frac=0.01, loader_workers=0, device_type="cpu", world_size=1,
            strategy="single", micro_batch=4, scaling_note="scale out with ddp: 2: 1.9x")


def test_input_first_with_its_measured_share():
    b, adv = advise(Findings(data_wait_frac=0.42, batch_gain=0.5, rates=(1.0, 1.5), **BASE))
    assert b == "input"
    kinds = [a["kind"] for a in adv]
    assert kinds[:5] == ["input"] * 5 and kinds[5] == "batch" and kinds[-1] == "scale-out"
    assert "loader_workers from 0 to 2" in adv[0]["text"] and "42%" in adv[0]["text"]
    assert all("42%" in a["text"] for a in adv[:5])
    assert adv[-1]["text"].startswith("after the fixes above")


def test_batch_before_scale_out():
    b, adv = advise(Findings(data_wait_frac=0.01, batch_gain=0.4, rates=(100.0, 140.0),
                             suggested_micro_batch=32, fit_note="fits", **BASE))
    assert b == "batch"
    assert adv[0]["kind"] == "batch" and adv[0]["micro_batch"] == 32 and "+40%" in adv[0]["text"]


def test_communication_then_compute():
    kw = {**BASE, "world_size": 2, "comm_exposed_frac": 0.3}
    assert advise(Findings(data_wait_frac=0.0, batch_gain=0.05, **kw))[0] == "communication"
    kw["comm_exposed_frac"] = 0.05
    b, adv = advise(Findings(data_wait_frac=0.0, batch_gain=0.05, **kw))
    assert b == "compute" and [a["kind"] for a in adv] == ["scale-out"]
    assert not adv[0]["text"].startswith("after")


def test_thresholds_are_validated():
    with pytest.raises(ConfigError, match="input_frac"):
        Thresholds(input_frac=-0.1)
