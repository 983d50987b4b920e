"""``trainfit train --resume`` / ``--resume auto`` from the command line, and the default job killed
mid-way resuming from its periodic checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from trainfit.checkpoint import list_checkpoints, read_checkpoint

from .helpers import bitwise, metrics

from reliability.cli_harness import check_promise, cli, error_lines, snapshot  # noqa: E402  (tests/ on sys.path)

EVERY = 5
"""The killed job's checkpoint interval: the default job's (50) lowered, so that it is killed after 8 steps rather
than 53 (suite time); the default itself is checked on the CLI's own config.toml."""
KILL_AFTER = EVERY + 3
"""The job is killed once its log holds this step: 3 steps past its first periodic checkpoint."""
FLAGS = ["--model-config", "n_layer=1,d_model=32,n_head=2,dropout=0.1", "--seq", "32", "--micro-batch", "2",
         "--accumulation", "2"]


def _data(tmp_path: Path) -> list[str]:
    """Text from the Python stdlib's own source (nothing downloaded), a tenth held out for validation."""
    src = Path(json.__file__).parent
    return ["--data", str(src / "*.py"), "--val-fraction", "0.3", "--eval-every", "2", "--eval-batches", "2"]


def _state(run_dir: Path):
    s = read_checkpoint(list_checkpoints(run_dir)[-1])
    return s["model"], s["optimizer"]["state"], s["rng"]




def test_resume_auto_starts_fresh_then_resumes_bitwise_on_file_data_with_eval(tmp_path):
    data = _data(tmp_path)
    r = cli(["train", *FLAGS, *data, "--steps", "3", "--run-dir", str(tmp_path / "split"), "--resume", "auto"])
    assert r.rc == 0, r.err
    assert f"trainfit: no checkpoint in {tmp_path / 'split'}; starting fresh (--resume auto)" in r.err
    r = cli(["train", *FLAGS, *data, "--steps", "6", "--run-dir", str(tmp_path / "split"), "--resume", "auto",
             "--json"])
    assert r.rc == 0, r.err
    assert "starting fresh" not in r.err
    out = json.loads(r.out)
    assert out["val_loss"] == metrics(tmp_path / "split")[-1]["val_loss"]
    r = cli(["train", *FLAGS, *data, "--steps", "6", "--run-dir", str(tmp_path / "full")])
    assert r.rc == 0, r.err
    assert bitwise(_state(tmp_path / "full"), _state(tmp_path / "split"))
    a, b = metrics(tmp_path / "full"), metrics(tmp_path / "split")
    assert [x["step"] for x in b] == [1, 2, 3, 4, 5, 6]
    assert [x["loss"] for x in a] == [x["loss"] for x in b]
    assert [(x["step"], x["val_loss"]) for x in a if "val_loss" in x] == \
        [(x["step"], x["val_loss"]) for x in b if "val_loss" in x and x["step"] != 3]  # 3: the split run's end


def test_plain_resume_without_a_checkpoint_fails_naming_resume_auto(tmp_path):
    before = snapshot(tmp_path)
    r = cli(["train", *FLAGS, "--steps", "2", "--run-dir", str(tmp_path / "new"), "--resume"])
    check_promise(r, tmp_path, before)
    assert r.rc == 2
    (line,) = [ln for ln in error_lines(r.err) if ln.startswith("trainfit: error:")]
    assert "--resume" in line and "pass --resume auto to start fresh when there is none" in line
    assert not (tmp_path / "new").exists()


def test_resume_with_another_value_is_refused_naming_the_choices(tmp_path):
    (tmp_path / "c.toml").write_text('steps = 2\n')
    before = snapshot(tmp_path)
    r = cli(["train", str(tmp_path / "c.toml"), "--resume", "sometimes"])
    check_promise(r, tmp_path, before)
    assert r.rc == 2 and "resume='sometimes'" in r.err and "auto" in r.err


@pytest.mark.slow  # the default job's first 8 steps in a subprocess (53 before: ~35 s on 2 idle cores)
@pytest.mark.timeout(400)
def test_default_job_killed_after_step_50_resumes_from_its_periodic_checkpoint(tmp_path):
    """The default job (250 steps, checkpoint_every=50, checkpoint_minutes=30), only --run-dir given (and, for
    suite time, --checkpoint-every 5: the same periodic save, ten times as often), SIGKILLed a few steps past
    its first periodic checkpoint. The killed run's own log is the uninterrupted reference for the steps after
    it: the resumed run must start at the next step and log the very same losses (bitwise) for them."""
    # The default interval, as the command line resolves it with only --run-dir given (one step, in-process).
    r = cli(["train", "--run-dir", str(tmp_path / "one"), "--steps", "1"])
    assert r.rc == 0, r.err
    written = tomllib.loads((tmp_path / "one" / "config.toml").read_text())
    resolved = written.get("run", written)  # (the [run] section of the nested config; flat before it)
    assert (resolved["checkpoint_every"], resolved["checkpoint_minutes"]) == (50, 30.0)
    run_dir = tmp_path / "default"
    # the same torch threads as this process, which resumes it: the same kernels, the same rounding
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    p = subprocess.Popen([sys.executable, "-m", "trainfit", "train", "--run-dir", str(run_dir),
                          "--checkpoint-every", str(EVERY)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    log = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and p.poll() is None:
            if log.is_file() and len(log.read_text().splitlines()) >= KILL_AFTER:
                break
            time.sleep(0.1)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    killed = {r["step"]: r["loss"] for r in metrics(run_dir)}
    assert KILL_AFTER <= max(killed) < 2 * EVERY, "the job was not killed between its first two checkpoints"
    assert [c.name for c in list_checkpoints(run_dir)] == [f"step-{EVERY:08d}.pt"]
    upto = KILL_AFTER
    r = cli(["train", "--run-dir", str(run_dir), "--checkpoint-every", str(EVERY), "--resume", "auto", "--steps",
             str(upto), "--json"])
    assert r.rc == 0, r.err
    after = metrics(run_dir)
    assert [x["step"] for x in after] == list(range(1, upto + 1))  # 1..5 kept, 6.. redone once each
    assert [(x["step"], x["loss"]) for x in after[EVERY:]] == [(s, killed[s]) for s in range(EVERY + 1, upto + 1)]
    assert list_checkpoints(run_dir)[-1].name == f"step-{upto:08d}.pt"
