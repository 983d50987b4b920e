"""Issue 35, row 15 (second half): an option that writes a file the user names, pointed at a named pipe, hung
(``plan --write fifo.toml --force`` blocked in open() until a reader came). Every such option -- plan --write and
--write-for, memory and profile --plot, report --out -- is checked with ``gate.check_write_target`` before any work:
exit 2, one stderr line naming the option, in bounded time, with or without --force."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.reliability.cli_harness import cli
from trainfit.outputs import MARKER

PLAN = ["plan", "--device-memory", "1GiB", "--global-batch", "8", "--device", "cpu", "--basis", "analytic"]
WRITERS = {
    "plan --write": (PLAN, "--write", "p.toml", "write"),
    "plan --write-for accelerate": (PLAN, "--write-for accelerate", "a.yaml", "write-for"),
    "plan --write-for hf-trainer": (PLAN, "--write-for hf-trainer", "t.json", "write-for"),
    "plan --write-for lightning": (PLAN, "--write-for lightning", "l.json", "write-for"),
    "memory --plot": (["memory", "--estimate", "--model-config", "n_layer=1,d_model=16,n_head=2", "--seq", "8"],
                      "--plot", "m.png", "--plot"),
    "profile --plot": (["profile", "--model-config", "n_layer=1,d_model=16,n_head=2", "--seq", "8", "--steps", "1"],
                       "--plot", "p.png", "--plot"),
    "report --out": (["report", "rr"], "--out", "r.html", "--out"),
}


def _run_with_deadline(argv: list[str], cwd, fifo, seconds: float = 30.0):
    """``cli(argv)`` in a thread; if it is still running after ``seconds`` (blocked on the pipe), a reader is
    opened so that the writer returns, and the test fails."""
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=cli(argv, cwd=cwd)), daemon=True)
    t0 = time.perf_counter()
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # unblock the writer, then drain it
        worker.join(10)
        os.close(fd)
        pytest.fail(f"{' '.join(argv)} blocked on a named pipe for {seconds:.0f} s")
    return result["r"], time.perf_counter() - t0


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("case", sorted(WRITERS))
def test_a_named_pipe_as_a_written_file_is_refused_in_one_line(tmp_path, case, force):
    base, option, name, field = WRITERS[case]
    (tmp_path / "rr").mkdir()
    (tmp_path / "rr" / MARKER).write_text("")
    (tmp_path / "rr" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "loss_scale": 1.0}\n')
    fifo = tmp_path / name
    os.mkfifo(fifo)
    argv = [*base, *option.split(), str(fifo), *(["--force"] if force else [])]
    r, seconds = _run_with_deadline(argv, tmp_path, fifo)
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and r.out == "", (r.rc, r.err)
    assert f"{field}=" in lines[0] and "named pipe" in lines[0], lines[0]
    assert seconds < 10
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["rr", name])  # nothing else written
