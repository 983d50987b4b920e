"""Naming the lost rank: survivors look up each peer's host:pid in the job's store.

Here: the lookup against real processes, and a 2-process gloo job in which rank 1 is SIGKILLed
mid-step. The torchrun ``--max-restarts`` resume and its result are tested in tests/distributed
(under torchrun the agent may stop the survivor before it prints, so the naming is checked here,
without an agent)."""

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



def _dying_peer(rank: int, root, run_dir: str) -> None:
    """Rank 1 SIGKILLs itself in step 3's first micro-batch; rank 0 records how it stopped."""
    import json
    import os
    import signal
    import time

    import trainfit.tasks.builtin as builtin
    from trainfit.config import make_config
    from trainfit.strategies import process_group as pg
    from trainfit.train import train

    if rank == 1:
        real, calls = builtin.gpt_loss, [0]

        def dying(model, batch):
            calls[0] += 1
            if calls[0] == 5:  # 2 micro-batches per step
                os.kill(os.getpid(), signal.SIGKILL)  # no Python cleanup, no goodbye on the sockets
            return real(model, batch)

        builtin.gpt_loss = dying
    cfg = make_config({"model_config": "n_layer=1,d_model=32,n_head=2", "seq_len": 16, "micro_batch": 2,
                       "accumulation": 2, "strategy": "ddp", "steps": 20, "checkpoint_every": 2,
                       "collective_timeout_s": 30.0, "run_dir": run_dir})
    t0 = time.monotonic()
    try:
        with pg.stop_on_peer_failure(lambda: "the step-2 checkpoint"):
            train(cfg, progress=False)
        out = {"error": None}
    except pg.RankStopped as e:
        out = {"error": str(e), "seconds": time.monotonic() - t0}
    (root / f"rank{rank}.json").write_text(json.dumps(out))


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_rank_sigkilled_mid_step_is_named_by_the_survivor_within_bounded_time(tmp_path):
    import json

    from distributed.harness import spawn  # the distribution tests' 2-process gloo launcher

    codes = spawn(_dying_peer, tmp_path, str(tmp_path / "run"), timeout_s=180)
    assert codes[1] == -9, codes  # rank 1 died by SIGKILL
    out = json.loads((tmp_path / "rank0.json").read_text())
    assert out["error"] and "rank 0 of 2 stopped" in out["error"] and "lost: rank 1" in out["error"], out
    assert out["seconds"] < 60  # the collective timeout is 30 s; gloo usually notices the closed socket at once
