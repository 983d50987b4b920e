"""Compiled (inductor, per block) vs eager optimizer-step time on the built-in GPT on this CPU.

One interleaved run per model (eager step, compiled step, eager, ...: machine load hits both alike), through
``trainfit.probes.compile.measure_compile_speedup`` -- the function ``plan --calibrate`` calls; compile time
(first compiled step less a steady one) apart. Also the saved-for-backward bytes, eager vs compiled, with the
partitioner's estimate (``compiled_saved_bytes``). The load average at start and end is recorded: other
processes share this CPU.

    .venv/bin/python benchmarks/compile_speed.py          # a few minutes on 2 cores (C++ builds included)

Writes benchmarks/results/compile_speed.{json,md}.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

from trainfit.config import RunConfig  # noqa: E402
from trainfit.probes.compile import compiled_saved_bytes, measure_compile_speedup  # noqa: E402

CASES = {
    "gpt-tiny": dict(model="gpt-tiny", seq_len=64, micro_batch=8, accumulation=1),
    "gpt-small": dict(model="gpt-small", seq_len=128, micro_batch=4, accumulation=1),
}
REPS = int(os.environ.get("REPS", "7"))


def main() -> None:
    load_start = os.getloadavg()
    rows = {}
    for name, kw in CASES.items():
        cfg = RunConfig(**kw, dataset_size=256)
        eager_s, compiled_s, compile_s = measure_compile_speedup(cfg, reps=REPS)
        saved = compiled_saved_bytes(cfg)
        rows[name] = {"config": kw, "eager_step_s": eager_s, "compiled_step_s": compiled_s,
                      "speedup": eager_s / compiled_s, "compile_s": compile_s, "reps": REPS,
                      "saved": saved.to_dict()}
        print(name, rows[name], flush=True)
    load_end = os.getloadavg()
    table = ["| model | eager step (ms) | compiled step (ms) | speed-up | compile (s) | saved eager / compiled (KiB) "
             "| partitioner estimate vs measured |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        s = r["saved"]
        table.append(f"| {name} | {r['eager_step_s'] * 1e3:.1f} | {r['compiled_step_s'] * 1e3:.1f} | "
                     f"{r['speedup']:.2f}x | {r['compile_s']:.1f} | {s['eager_bytes'] / 1024:.0f} / "
                     f"{s['compiled_bytes'] / 1024:.0f} | {s['gap_frac']:+.1%} |")
    table.append("")
    table.append(f"Interleaved medians of {REPS} steps each (fp32, AdamW, compile_scope=blocks, inductor, "
                 f"dynamic shapes). Load average (1/5/15 min) at start {load_start[0]:.2f}/{load_start[1]:.2f}/"
                 f"{load_start[2]:.2f}, at end {load_end[0]:.2f}/{load_end[1]:.2f}/{load_end[2]:.2f}: other "
                 "processes shared the 2 cores, so absolute times are noisy; the ratio is from one interleaved run.")
    write_results("compile_speed", {"results": rows, "load_avg_start": load_start, "load_avg_end": load_end},
                  "\n".join(table))


if __name__ == "__main__":
    main()
