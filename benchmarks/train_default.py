"""Time the default job: `trainfit train` with no arguments (issue 2: under 3 minutes on 2 cores).

Run: .venv/bin/python benchmarks/train_default.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

from _common import write_results


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "trainfit", "train", "--run-dir", d, "--json"],
                           capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        summary = json.loads(r.stdout)
        lines = [json.loads(x) for x in open(f"{d}/metrics.jsonl")]
    first10 = sum(x["loss"] for x in lines[:10]) / 10
    last10 = sum(x["loss"] for x in lines[-10:]) / 10
    data = {"wall_s_including_startup": wall, "summary": summary, "loss_first10_mean": first10,
            "loss_last10_mean": last10}
    table = ("| wall time (incl. start-up) | steps | tokens/s | loss, mean of first 10 steps | loss, mean of last 10 |\n"
             "|---|---|---|---|---|\n"
             f"| {wall:.1f} s | {summary['steps']} | {summary['tokens_per_s']:,.0f} | {first10:.3f} | {last10:.3f} |\n")
    write_results("train_default", data, table)
    print(table)


if __name__ == "__main__":
    main()
