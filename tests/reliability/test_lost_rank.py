"""Naming the lost rank: survivors look up each peer's host:pid in the job's store.

The end-to-end cases (a rank killed mid-step under spawn and under ``torchrun --max-restarts``)
live in tests/distributed; here the lookup itself, against real processes."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from trainfit.strategies.process_group import exited_ranks, register_process


def test_exited_peer_is_named_and_live_or_remote_ones_are_not():
    store = dist.HashStore()
    register_process(store, 0)  # this process
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: no /proc entry left
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, not yet waited for: a zombie
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        host = socket.gethostname()
        store.set("trainfit/process/1", f"{host}:{dead.pid}")
        store.set("trainfit/process/2", f"{host}:{alive.pid}")
        store.set("trainfit/process/3", f"another-host.invalid:{dead.pid}")  # not judged from here
        store.set("trainfit/process/4", f"{host}:{zombie.pid}")
        # rank 5 never registered (died before it could): not named either
        import time

        time.sleep(0.5)  # let the zombie exit
        assert exited_ranks(store, 0, 6) == [1, 4]
        assert exited_ranks(None, 0, 6) == []
    finally:
        alive.kill()
        alive.wait()
        zombie.wait()


INJECT = """
import os, signal
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import trainfit.tasks.builtin as builtin
    real, calls = builtin.gpt_loss, [0]
    def dying(model, batch):
        calls[0] += 1
        if calls[0] == 5:  # step 3, first micro-batch: SIGKILL, no Python cleanup at all
            os.kill(os.getpid(), signal.SIGKILL)
        return real(model, batch)
    builtin.gpt_loss = dying
"""


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_rank_sigkilled_mid_step_is_named_and_torchrun_restart_finishes(tmp_path):
    import json
    import os
    import time

    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(INJECT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "inject"), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "trainfit", "train", "--nproc", "2", "--max-restarts", "1",
                        "--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16", "--micro-batch", "2",
                        "--global-batch", "8", "--strategy", "ddp", "--steps", "6", "--checkpoint-every", "2",
                        "--run-dir", str(run_dir), "--json"],
                       capture_output=True, text=True, timeout=280, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    stopped = [ln for ln in p.stderr.splitlines() if "rank 0 of 2 stopped" in ln]
    assert stopped and "lost: rank 1" in stopped[0], p.stderr[-3000:]
    assert "step-00000002.dcp" in stopped[0]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed at the step-2 checkpoint, not from scratch
    assert time.monotonic() - t0 < 240
