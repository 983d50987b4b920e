"""Claim: timing the step's phases changes the step time by at most 2%.

Two measurements of the same optimizer steps (tiny GPT on CPU, one thread):

1. A/B, interleaved: plain ``optimizer_step`` (the engine's no-op timer) and the profiled
   step (PhaseTimer + collectives wrapped + collect) alternate step by step, so a change in
   machine load hits both alike; overhead = median(timed) / median(plain) - 1. On a shared
   machine this is noisy in both directions; the spread is reported.
2. The timer's own cost: the same sequence of phase enters/exits and one ``collect()`` that a
   step performs, run 10,000 times alone, divided by the median plain step time. This is the
   deterministic bound the A/B figure is noisy around.

Usage::

    python benchmarks/profile_overhead.py [--steps 200] [--model-config n_layer=1,d_model=32,n_head=2]
    # writes benchmarks/results/profile_overhead.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from trainfit.config import make_config
from trainfit.engine import optimizer_step
from trainfit.meters.timers import PhaseTimer
from trainfit.probes.profile import TimedStrategy, step_batches
from trainfit.run import build_run
from trainfit.tasks.base import to_device

RESULTS = Path(__file__).resolve().parent / "results"


def one_step(run, batches, timer: PhaseTimer | None) -> float:
    st = run.strategy
    t0 = time.perf_counter()
    host = [next(batches) for _ in range(run.cfg.accumulation)]
    if timer is None:
        mbs = [to_device(mb, st.device) for mb in host]
        optimizer_step(model=run.model, optimizer=run.optimizer, precision=run.precision, micro_batches=mbs,
                       loss_fn=run.task.loss, count_fn=run.task.count, strategy=st, grad_clip=run.cfg.grad_clip)
    else:
        with timer.phase("h2d"):
            mbs = [to_device(mb, st.device) for mb in host]
        optimizer_step(model=run.model, optimizer=run.optimizer, precision=run.precision, micro_batches=mbs,
                       loss_fn=run.task.loss, count_fn=run.task.count, strategy=TimedStrategy(st, timer),
                       grad_clip=run.cfg.grad_clip, timer=timer)
        timer.collect()
    return time.perf_counter() - t0


def timer_cost_per_step(accumulation: int, reps: int = 10_000) -> float:
    """Seconds of timer bookkeeping per step: h2d, K x (forward, backward), 3 comm, optimizer, collect."""
    timer = PhaseTimer("cpu")
    t0 = time.perf_counter()
    for _ in range(reps):
        with timer.phase("h2d"):
            pass
        for k in range(accumulation):
            with timer.phase("forward"):
                pass
            with timer.phase("backward_sync" if k == accumulation - 1 else "backward"):
                pass
        with timer.phase("comm"):
            pass
        with timer.phase("optimizer"):
            with timer.phase("comm"):
                pass
        timer.collect()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model-config", default="n_layer=1,d_model=32,n_head=2")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--accumulation", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = make_config({"model_config": args.model_config, "seq_len": args.seq, "micro_batch": args.micro_batch,
                       "accumulation": args.accumulation})
    run = build_run(cfg)
    batches = step_batches(run, cfg.micro_batch)
    timer = PhaseTimer(run.strategy.device)
    for _ in range(10):  # warm-up both paths
        one_step(run, batches, None)
        one_step(run, batches, timer)
    plain, timed = [], []
    for i in range(args.steps):
        first, second = (None, timer) if i % 2 == 0 else (timer, None)  # alternate the order too
        a, b = one_step(run, batches, first), one_step(run, batches, second)
        (plain if first is None else timed).append(a)
        (timed if first is None else plain).append(b)
    med_plain, med_timed = statistics.median(plain), statistics.median(timed)
    cost = timer_cost_per_step(cfg.accumulation)
    result = {
        "claim": "phase timing changes step time by <= 2%",
        "config": {"model_config": args.model_config, "seq_len": args.seq, "micro_batch": args.micro_batch,
                   "accumulation": args.accumulation, "threads": 1, "steps_each": args.steps},
        "median_plain_step_s": med_plain, "median_timed_step_s": med_timed,
        "ab_overhead": med_timed / med_plain - 1,
        "plain_p25_p75_s": statistics.quantiles(plain, n=4)[::2],
        "timed_p25_p75_s": statistics.quantiles(timed, n=4)[::2],
        "timer_cost_per_step_s": cost, "timer_cost_frac": cost / med_plain,
    }
    result["pass"] = result["timer_cost_frac"] <= 0.02 and result["ab_overhead"] <= 0.02
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "profile_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (f"# Profile timing overhead\n\n`python benchmarks/profile_overhead.py --steps {args.steps}` "
          f"(model_config {args.model_config}, seq {args.seq}, micro_batch {args.micro_batch}, accumulation "
          f"{args.accumulation}, 1 thread, CPU)\n\n"
          f"| measure | value |\n|---|---|\n"
          f"| median plain step | {med_plain * 1e3:.3f} ms |\n| median timed step | {med_timed * 1e3:.3f} ms |\n"
          f"| A/B overhead (interleaved medians) | {result['ab_overhead']:+.2%} |\n"
          f"| timer bookkeeping per step | {cost * 1e6:.1f} us = {result['timer_cost_frac']:.3%} of a step |\n"
          f"| claim (<= 2%) | {'holds' if result['pass'] else 'FAILS'} |\n")
    (RESULTS / "profile_overhead.md").write_text(md)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
