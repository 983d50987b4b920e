"""The front door of ``trainfit verify``: ``trainfit.front.verify.verify`` / ``verify_framework`` called in-process
return the report the CLI prints with ``--json`` for the same job, refuse what the CLI refuses with the same line,
and say what they run on the ``trainfit.verify`` logger."""

from __future__ import annotations

import json
import logging

import pytest

from tests.reliability.cli_harness import cli
from trainfit.config import RunConfig
from trainfit.errors import ConfigError
from trainfit.front.verify import verify, verify_framework


def _same(front: dict, printed: dict) -> None:
    assert front.keys() == printed.keys()
    for key, value in printed.items():
        if isinstance(value, float):
            assert front[key] == pytest.approx(value, rel=1e-9, abs=1e-15), key
        elif isinstance(value, dict):
            _same(front[key], value)
        else:
            assert front[key] == value, key


def test_verify_in_process_equals_the_cli_json(tmp_path):
    r = cli(["verify", "--micro-batch", "2", "--accumulation", "2", "--seq-len", "32", "--json"], cwd=tmp_path)
    assert r.rc == 0, r.err
    report = verify(micro_batch=2, accumulation=2, seq_len=32)
    assert report.passed
    _same(report.to_dict(), json.loads(r.out))
    # a RunConfig works as well as its fields
    again = verify(RunConfig(micro_batch=2, accumulation=2, seq_len=32))
    assert again.grad_rel_error == pytest.approx(report.grad_rel_error, rel=1e-9, abs=1e-15)


def test_verify_framework_in_process_equals_the_cli_json_and_logs_its_runs(tmp_path, caplog):
    args = ["--framework", "accelerate", "--micro-batch", "2", "--accumulation", "3", "--seq-len", "32"]
    r = cli(["verify", *args, "--json"], cwd=tmp_path)
    assert r.rc == 1, r.err  # the micro-batch mean: a mean of means, an accumulation error
    assert "verify --framework accelerate: one step at 3 micro-batch(es)" in r.err  # progress on stderr
    with caplog.at_level(logging.INFO, logger="trainfit.verify"):
        report = verify_framework(framework="accelerate", micro_batch=2, accumulation=3, seq_len=32)
    assert not report.passed and report.accumulation_error.found
    _same(report.to_dict(), json.loads(r.out))
    said = [rec.getMessage() for rec in caplog.records if rec.name == "trainfit.verify"]
    assert said == ["verify --framework accelerate: one step at 3 micro-batch(es)",
                    "verify --framework accelerate: one step at 1 micro-batch(es)"]
    assert all(rec.levelno == logging.INFO for rec in caplog.records if rec.name == "trainfit.verify")


def test_the_front_door_refuses_what_the_cli_refuses(tmp_path):
    with pytest.raises(ConfigError) as e:
        verify_framework(framework="accelerate", micro_batch=2, accumulation=1)
    r = cli(["verify", "--framework", "accelerate", "--micro-batch", "2", "--accumulation", "1"], cwd=tmp_path)
    assert r.rc == 2 and r.err.strip() == f"trainfit: error: {e.value}"
    with pytest.raises(ConfigError) as e:
        verify_framework(framework="lightning", micro_batch=2, accumulation=2,
                         collator="transformers:DataCollatorWithPadding")
    r = cli(["verify", "--framework", "lightning", "--micro-batch", "2", "--accumulation", "2", "--collator",
             "transformers:DataCollatorWithPadding"], cwd=tmp_path)
    assert r.rc == 2 and r.err.strip() == f"trainfit: error: {e.value}" and "collator" in r.err
