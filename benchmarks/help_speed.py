"""Issue 38, point 4, measured: how long ``trainfit --help`` and each command's ``--help`` take, whole process.

Each help is ``python -m trainfit [COMMAND] --help`` started fresh (interpreter start-up and every import
included), timed from outside with a monotonic clock; with ``--old SRC`` the same command runs against the code
in ``SRC/src`` (a worktree of the commit before), in turn with the current code (new, old, new, old, ...) so that
a drift of the machine's speed moves both alike. Also records the heavy libraries each help imported (torch,
numpy, transformers, matplotlib), read from ``python -X importtime``.

    .venv/bin/python benchmarks/help_speed.py [--old /tmp/old-G] [--runs 5]    # ~2 min on 2 CPUs with --old
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("", "train", "memory", "verify", "plan", "report", "profile", "prepare")
"""``trainfit --help`` (the empty name), then each command's."""
HEAVY = ("torch", "numpy", "transformers", "matplotlib")


def _env(src: Path | None) -> dict:
    env = {**os.environ, "COLUMNS": "120"}
    if src is not None:  # the old code first on the path (the installed package is the current one)
        env["PYTHONPATH"] = str(src)
    return env


def _argv(command: str, *extra: str) -> list[str]:
    return [sys.executable, *extra, "-m", "trainfit", *([command] if command else []), "--help"]


def time_once(command: str, src: Path | None) -> float:
    """Wall seconds of one fresh ``trainfit [command] --help``."""
    start = time.perf_counter()
    r = subprocess.run(_argv(command), env=_env(src), cwd=ROOT, capture_output=True, check=False)
    took = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"trainfit {command} --help exited {r.returncode}: {r.stderr.decode()[-500:]}")
    return took


def heavy_imports(command: str, src: Path | None) -> list[str]:
    """The heavy top-level packages the help imported (``-X importtime`` lists every module as it is imported)."""
    r = subprocess.run(_argv(command, "-X", "importtime"), env=_env(src), cwd=ROOT, capture_output=True,
                       text=True, check=False)
    names = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    return [h for h in HEAVY if h in names]


def measure(runs: int, old: Path | None) -> dict:
    """Per command: each run's seconds (new, and old when given, interleaved) and what each imported."""
    out = {}
    for command in COMMANDS:
        time_once(command, None)  # a warm-up: the files in the page cache for both
        if old is not None:
            time_once(command, old)
        new_s, old_s = [], []
        for _ in range(runs):
            new_s.append(time_once(command, None))
            if old is not None:
                old_s.append(time_once(command, old))
        out[command or "trainfit"] = {
            "new_s": new_s, "new_heavy": heavy_imports(command, None),
            **({"old_s": old_s, "old_heavy": heavy_imports(command, old)} if old is not None else {})}
        print(f"{command or 'trainfit':<8} new {statistics.median(new_s):.3f} s"
              + (f"  old {statistics.median(old_s):.3f} s" if old is not None else ""), file=sys.stderr)
    return out


def table(results: dict, runs: int) -> str:
    has_old = any("old_s" in r for r in results.values())
    head = ("| help | before: median s (min-max) | imported | after: median s (min-max) | imported | after/before |\n"
            "|---|---|---|---|---|---|\n") if has_old else "| help | median s (min-max) | imported |\n|---|---|---|\n"
    rows = []
    for name, r in results.items():
        label = f"`trainfit {name + ' ' if name != 'trainfit' else ''}--help`"
        new = f"{statistics.median(r['new_s']):.3f} ({min(r['new_s']):.3f}-{max(r['new_s']):.3f})"
        new_heavy = ", ".join(r["new_heavy"]) or "none of " + "/".join(HEAVY)
        if not has_old:
            rows.append(f"| {label} | {new} | {new_heavy} |")
            continue
        old = f"{statistics.median(r['old_s']):.3f} ({min(r['old_s']):.3f}-{max(r['old_s']):.3f})"
        ratio = statistics.median(n / o for n, o in zip(r["new_s"], r["old_s"]))
        rows.append(f"| {label} | {old} | {', '.join(r['old_heavy'])} | {new} | {new_heavy} | {ratio:.3f} |")
    note = (f"\n\n{runs} runs per help after one warm-up, each a fresh `python -m trainfit ... --help` timed from "
            "outside (wall, start-up included); before and after run in turn. after/before: median of the "
            "pair-by-pair ratios. 'imported': the heavy libraries `-X importtime` saw.")
    return head + "\n".join(rows) + note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, help="a worktree of the code before: its src/ is timed in turn")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    old = args.old / "src" if args.old is not None else None
    results = measure(args.runs, old)
    write_results("help_speed", {"runs": args.runs, "old": str(args.old) if args.old else None,
                                 "results": results}, table(results, args.runs))
    print(table(results, args.runs))


if __name__ == "__main__":
    main()
