"""The CLI under torch's launcher: one torchrun smoke run, a two-"node" run on one machine,
and a rank death that ``--max-restarts 1`` recovers from. All rendezvous on 127.0.0.1, free ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .harness import BASE, TINY, free_port, max_rel_err, read_dcp_model

pytestmark = pytest.mark.distributed

STEPS = 6
FLAGS = ["--model-config", TINY, "--seq", str(BASE["seq_len"]), "--micro-batch", "2", "--global-batch", "8",
         "--strategy", "zero3", "--optimizer", "sgd", "--lr", "0.5", "--steps", str(STEPS),
         "--checkpoint-every", "2"]
# dataset_size has no flag: the default 4096 samples; the data order depends only on seed and step.


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONWARNINGS": "ignore", **extra}


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final(run_dir: Path):
    return read_dcp_model(run_dir / "checkpoints" / f"step-{STEPS:08d}.dcp")


@pytest.fixture(scope="module")
def single_node(tmp_path_factory) -> Path:
    """The one ``torchrun --nproc_per_node=2 -m trainfit train`` smoke run (the baseline for the others)."""
    run_dir = tmp_path_factory.mktemp("single-node")
    p = subprocess.run(_torchrun("--standalone", "--nproc_per_node=2", "-m", "trainfit", "train", *FLAGS,
                                 "--run-dir", str(run_dir), "--json"),
                       capture_output=True, text=True, timeout=180, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])  # rank 0 only prints it
    assert summary["steps"] == STEPS and summary["effective_batch"] == 8
    assert len(_losses(run_dir)) == STEPS and all(0 < x < 10 for x in _losses(run_dir))
    return run_dir


def test_torchrun_smoke(single_node):
    assert sorted(p.name for p in (single_node / "checkpoints").iterdir()) == [
        "step-00000002.dcp", "step-00000004.dcp", "step-00000006.dcp"]


def test_two_nodes_on_one_machine_match_single_node(single_node, tmp_path):
    port = free_port()
    run_dir = tmp_path / "two-node"
    procs = [subprocess.Popen(_torchrun("--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                                        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-node",
                                        "--local-addr=127.0.0.1", "-m", "trainfit", "train", *FLAGS,
                                        "--run-dir", str(run_dir)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
             for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[1][-2000:] for o in outs)
    assert _losses(run_dir) == pytest.approx(_losses(single_node), rel=1e-6)
    assert max_rel_err(_final(run_dir), _final(single_node)) <= 1e-6


def test_dead_rank_then_max_restarts_resumes_and_finishes(single_node, tmp_path):
    """``trainfit train --nproc 2 --max-restarts 1``; rank 1 dies in step 3 of the first attempt."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            import trainfit.tasks.builtin as builtin
            real, calls = builtin.gpt_loss, [0]
            def dying(model, batch):
                calls[0] += 1
                if calls[0] == 5:  # first micro-batch of step 3 (2 per step)
                    os._exit(17)
                return real(model, batch)
            builtin.gpt_loss = dying
    """))
    run_dir = tmp_path / "restarted"
    env = _env(PYTHONPATH=os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "trainfit", "train", "--nproc", "2", "--max-restarts", "1", *FLAGS,
                        "--run-dir", str(run_dir), "--json"], capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "exitcode: 17" in p.stderr  # torchrun saw rank 1 die, then restarted both workers
    assert "rank 0 of 2 stopped" in p.stderr and "step-00000002.dcp" in p.stderr  # rank 0 said why it stopped
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Steps 1-2 from the first attempt; step 3 died unlogged; the restart resumed at the step-2 checkpoint
    # (a restart from scratch would log 1, 2 again).
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == pytest.approx(_losses(single_node), rel=1e-6)
    assert max_rel_err(_final(run_dir), _final(single_node)) <= 1e-6
