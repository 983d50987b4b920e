"""``trainfit train --devices N --nodes M``: N local workers as one node of an M-node job (issue 28 item 6).

Two ``trainfit train --devices 1 --nodes 2`` processes on this machine (node ranks 0 and 1, gloo, rendezvous on
127.0.0.1) against one ``trainfit train --devices 2`` of the same job: the same loss at every step, bit for bit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.cli, pytest.mark.slow]

JOB = ["train", "--model-config", "n_layer=2,d_model=32,n_head=2", "--seq", "16", "--micro-batch", "2",
       "--accumulation", "2", "--strategy", "ddp", "--optimizer", "sgd", "--lr", "0.5", "--steps", "3", "--json"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_of_one_device_equal_one_node_of_two(tmp_path):
    one = subprocess.run([sys.executable, "-m", "trainfit", *JOB, "--devices", "2", "--run-dir", str(tmp_path / "one")],
                         capture_output=True, text=True, timeout=300, env=_env())
    assert one.returncode == 0, one.stderr[-3000:]
    port, two = _free_port(), tmp_path / "two"
    procs = [subprocess.Popen([sys.executable, "-m", "trainfit", *JOB, "--devices", "1", "--nodes", "2",
                               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "--run-dir", str(two)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env()) for rank in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(err[-2000:] for _, err in outs)
    summary = json.loads(outs[0][0])  # node 0 holds global rank 0: its launcher prints the summary, node 1 nothing
    assert outs[1][0] == "" and summary["effective_batch"] == json.loads(one.stdout)["effective_batch"] == 8
    assert _losses(two) == _losses(tmp_path / "one") and len(_losses(two)) == 3
    assert summary["final_loss"] == _losses(tmp_path / "one")[-1]


def test_nodes_is_checked_before_any_worker(tmp_path, capsys):
    """Refused in-process, before the launcher starts a worker (the refusal, not a process, is what is tested)."""
    from trainfit.cli import main

    for flags, field in ((["--nodes", "0"], "nodes"), (["--nodes", "2", "--node-rank", "2"], "node_rank")):
        rc = main([*JOB, "--devices", "1", *flags, "--run-dir", str(tmp_path / "r")])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and field in err, err
        assert not (tmp_path / "r").exists()
