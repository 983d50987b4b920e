"""Issue 35 row 11, measured: what ``trainfit train`` does with process counts above what this machine runs, an
address that does not resolve, a node whose peers never come, and launch settings that mean nothing.

Each case runs ``python -m trainfit train ...`` in a fresh directory (its own session, so a hang is killed whole
after ``--kill-after`` seconds) and records the exit status, wall seconds, stderr lines (and the last one, cut),
the files left behind and the peak RSS of the command (``os.wait4``). ``--old SRC`` also runs the cases that are
safe on the code before (none that would start more processes than the machine runs) against ``SRC/src``.

    .venv/bin/python benchmarks/launch_refusals.py [--old /tmp/old-E2]    # ~2 min on 2 CPUs (+ ~2 min with --old)
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

JOB = ["train", "--model-config", "n_layer=1,d_model=16,n_head=2", "--seq", "8", "--micro-batch", "2",
       "--accumulation", "1", "--steps", "1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cases() -> list[tuple[str, list[str], bool]]:
    """(name, flags, safe on the old code: starts no process beyond the machine's means)."""
    from trainfit.gate import max_processes

    cap = max_processes()
    ddp = ["--strategy", "ddp"]
    return [
        ("--devices 99999", [*ddp, "--devices", "99999"], False),
        (f"--devices {cap + 1} (cap + 1)", [*ddp, "--devices", str(cap + 1)], False),
        ("--devices 2 --loader-workers 4", [*ddp, "--devices", "2", "--loader-workers", "4"], False),
        ("--nodes 2**20", [*ddp, "--devices", "1", "--nodes", str(2**20)], False),
        ("--nodes 2 --master-addr node0.example.invalid", [*ddp, "--devices", "1", "--nodes", "2",
                                                           "--master-addr", "node0.example.invalid"], True),
        ("lone --node-rank 1 (nothing at node 0)", [*ddp, "--devices", "1", "--nodes", "2", "--node-rank", "1",
                                                    "--master-port", str(_free_port()), "JOIN"], True),
        ("lone --node-rank 0 (node 1 never comes)", [*ddp, "--devices", "1", "--nodes", "2", "--node-rank", "0",
                                                     "--master-port", str(_free_port()), "JOIN"], True),
        ("--master-addr 10.0.0.1 on one node", [*ddp, "--devices", "2", "--master-addr", "10.0.0.1"], False),
        ("--max-restarts 2, one process", ["--max-restarts", "2"], False),
    ]


def run_case(flags: list[str], src: Path, kill_after: float, join_s: int, old: bool) -> dict:
    flags = [f for f in flags if f != "JOIN"] + ([] if old or "JOIN" not in flags else
                                                ["--join-timeout", str(join_s)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(src)}
    with tempfile.TemporaryDirectory(prefix="tf-launch-bench-") as d:
        t0 = time.perf_counter()
        with open(Path(d, ".stderr"), "w") as stderr:
            p = subprocess.Popen([sys.executable, "-m", "trainfit", *JOB, *flags, "--run-dir", "run"], cwd=d,
                                 env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        killed = False
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t0 > kill_after:
                os.killpg(p.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(p.pid, 0)
                killed = True
                break
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        err = Path(d, ".stderr").read_text(errors="replace")
        lines = [ln for ln in err.splitlines() if ln.strip()]
        left = sorted(str(q.relative_to(d)) for q in Path(d).rglob("*") if q.name != ".stderr")
    return {"rc": None if killed else os.waitstatus_to_exitcode(status),
            "killed_after_s": kill_after if killed else None,
            "seconds": round(seconds, 2), "stderr_lines": len(lines), "last_line": (lines[-1][:160] if lines else ""),
            "files_left": left, "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, help="a checkout of the code before (its src/ is put on PYTHONPATH)")
    ap.add_argument("--kill-after", type=float, default=30.0, help="seconds before a hung command is killed")
    ap.add_argument("--join-timeout", type=int, default=5, help="--join-timeout of the lone-node cases")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent / "src"
    rows = []
    for name, flags, safe_old in cases():
        row = {"case": name, "after": run_case(flags, here, args.kill_after, args.join_timeout, old=False)}
        if args.old and safe_old:
            row["before"] = run_case(flags, args.old / "src", args.kill_after, args.join_timeout, old=True)
        rows.append(row)
        print(name, row, flush=True)
    md = ["| case | | exit | seconds | stderr lines | files left | peak RSS MB | last stderr line |",
          "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        for when in ("before", "after"):
            if when in row:
                r = row[when]
                rc = r["rc"] if r["rc"] is not None else f"killed at {r['killed_after_s']:g} s"
                md.append(f"| {row['case']} | {when} | {rc} | {r['seconds']} | {r['stderr_lines']} | "
                          f"{', '.join(r['files_left']) or '-'} | {r['peak_rss_mb']} | "
                          f"{r['last_line'].replace('|', '/')} |")
    write_results("launch_refusals", {"kill_after_s": args.kill_after, "join_timeout_s": args.join_timeout,
                                      "rows": rows}, "\n".join(md))


if __name__ == "__main__":
    main()
