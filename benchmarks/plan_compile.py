"""The planner's predicted compile speed-up against the measured one, on the built-in GPT on this CPU.

    .venv/bin/python benchmarks/plan_compile.py [--model gpt-small] [--seq 128] [--global-batch 16]

What ``trainfit plan --device cpu --calibrate --compile-speedup measure`` does, step by step: the eager step
times are fitted to measured steps (``calibrated_links``), the compile speed-up is measured once per
(precision, checkpointing) at the basis micro-batch (4; ``compile_speedup_links``), and the search ranks eager
and compiled candidates. Then the chosen row is run for real, eager and compiled steps interleaved at the
row's own micro-batch and accumulation (``measure_compile_speedup``, median of 7): predicted compiled step and
speed-up vs measured. fp32, one process, single strategy, checkpointing none (the compiled rows of the other
policies are priced the same way). Writes benchmarks/results/plan_compile.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

from trainfit.config import make_config  # noqa: E402
from trainfit.meters.devices import device_row  # noqa: E402
from trainfit.plan.rules import Context  # noqa: E402
from trainfit.plan.search import SearchSpace, search  # noqa: E402
from trainfit.probes.calibrate import calibrated_links, compile_speedup_links, links_provider  # noqa: E402
from trainfit.probes.compile import measure_compile_speedup  # noqa: E402
from trainfit.probes.fastbasis import basis_provider  # noqa: E402

REPS = 7


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=16)
    args = ap.parse_args()
    base = make_config({"model": args.model, "seq_len": args.seq})
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    basis, used = basis_provider(base, source="auto", target="cpu")
    plain = links_provider(device_row("cpu"), nodes=1, devices=1, intra=None, inter=None)
    links = compile_speedup_links(base, calibrated_links(base, plain, basis), reps=REPS)
    space = SearchSpace(global_batch=args.global_batch, devices=1, memory_bytes=64 << 30, precisions=("fp32",),
                        checkpointings=("none",), strategies=("single",), compiles=(False, True))
    result = search(space, ctx=Context(devices=1, dtypes=("fp32",)), basis=basis, links=links)
    plan_s = time.perf_counter() - t0
    best = next(e for e in result.entries if e.compile)  # the fastest compiled row, and its eager twin
    eager = next(e for e in result.entries if not e.compile and (e.micro_batch, e.accumulation) ==
                 (best.micro_batch, best.accumulation))
    cfg = make_config({"precision": "fp32", "checkpointing": "none", "micro_batch": best.micro_batch,
                       "accumulation": best.accumulation}, base=base)
    eager_s, compiled_s, compile_s = measure_compile_speedup(cfg, REPS)
    load1 = os.getloadavg()
    row = {"model": args.model, "seq": args.seq, "basis": used, "micro_batch": best.micro_batch,
           "accumulation": best.accumulation, "plan_s": round(plan_s, 1),
           "speedup_calibrated": links("fp32", "none").compile_speedup,
           "pred_eager_s": eager.step_s, "pred_compiled_s": best.step_s,
           "meas_eager_s": eager_s, "meas_compiled_s": compiled_s, "compile_s": compile_s,
           "ranked_first": "compiled" if result.best.compile else "eager", "load_start": load0, "load_end": load1}
    pred_ratio, meas_ratio = eager.step_s / best.step_s, eager_s / compiled_s
    table = ("| model | seq | mb x acc | predicted eager / compiled step (ms) | predicted speed-up | measured eager / "
             "compiled step (ms) | measured speed-up | compile (s) | plan ranked first |\n"
             "|---|---|---|---|---|---|---|---|---|\n"
             f"| {args.model} | {args.seq} | {best.micro_batch} x {best.accumulation} | {eager.step_s * 1e3:.1f} / "
             f"{best.step_s * 1e3:.1f} | {pred_ratio:.2f}x | {eager_s * 1e3:.1f} / {compiled_s * 1e3:.1f} | "
             f"{meas_ratio:.2f}x | {compile_s:.1f} | {row['ranked_first']} |\n\n"
             f"The predicted speed-up is the ratio measured by the calibration (interleaved steps at micro-batch 4, "
             f"accumulation 1); the measured one is a second interleaved run at the plan's own row. Predicted "
             f"compiled step / measured: {best.step_s / compiled_s:.2f}. Calibration and search took {plan_s:.0f} s "
             f"(compiles included). Load average (1/5/15 min) at start {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
             f"at end {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}: other processes share the 2 cores.")
    print(table)
    write_results("plan_compile", {"rows": [row]}, table)


if __name__ == "__main__":
    main()
