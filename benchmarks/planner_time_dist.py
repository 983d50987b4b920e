"""Predicted vs measured step time on 2 gloo processes (one torch thread each on this 2-core machine).

    .venv/bin/python benchmarks/planner_time_dist.py [--model llama] [--runs 3]

Prediction (what ``trainfit plan --device cpu --devices 2 --calibrate`` does): compute from
``calibrated_links`` fitted to single-process steps (one thread, wall clock), plus the communication of ``plan.comm`` at the loopback bandwidth measured by timing
an all-reduce of the gradient size inside the two ranks, and a per-collective-call latency
(each call the strategy issues -- DDP buckets, ZeroRedundancyOptimizer broadcasts, FSDP2
per-unit gathers and scatters, the engine's small all-reduces -- pays its ring steps of it)
from the median one-element all-reduce inside the ranks, as measure/scaleout.py takes it;
gloo on CPU does not overlap communication with backward, plus the distributed overhead the
planner's calibration fits per (strategy, grad_sync) to steps measured on 2 processes at
micro-batch 2, accumulation 1, 2 and 3 (``plan.sources.measure_dist_steps``, ``plan.cost.fit_dist_overhead``):
FSDP2's per-unit CPU work and each collective's wait for its peer. The grid below is held out
(micro-batch 4 and 6, accumulation 1-3). Measurement: the median of 15 steps (wall clock) inside rank 0, as the calibration: 2 gloo ranks
on 2 cores vary 2x from step to step, so the minimum is a lucky draw and the median the throughput.
Writes planner_time_dist.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

MODEL = {"model": "gpt-tiny", "model_config": "n_layer=2,d_model=64,n_head=2", "seq_len": 64}
MODELS = {"gpt-tiny": MODEL,
          "llama": {"model": "hf:LlamaForCausalLM", "model_config": "vocab_size=256,num_hidden_layers=2,hidden_size=64,"
                    "num_attention_heads=4,num_key_value_heads=2,intermediate_size=128", "seq_len": 64}}
GRID = [(s, mb, acc, sync, "fp32", "none") for s, mb, acc, sync in (
    ("ddp", 4, 1, "deferred"), ("ddp", 4, 2, "deferred"), ("ddp", 6, 3, "deferred"),
    ("zero1", 4, 1, "deferred"), ("zero1", 4, 2, "deferred"),
    ("zero2", 4, 1, "deferred"), ("zero2", 4, 2, "per-micro-batch"), ("zero2", 6, 3, "deferred"),
    ("zero3", 4, 1, "deferred"), ("zero3", 4, 2, "per-micro-batch"), ("zero3", 6, 3, "deferred"))] + [
    ("ddp", 4, 2, "deferred", "bf16-mixed", "none"), ("zero1", 4, 1, "deferred", "bf16-mixed", "full"),
    ("zero2", 4, 2, "per-micro-batch", "bf16-mixed", "none"), ("zero3", 4, 1, "deferred", "fp32", "full"),
    ("zero3", 6, 3, "deferred", "bf16-mixed", "full")]
"""Held out: the distributed overhead is fitted at micro-batch 2 (plan.sources.DIST_POINTS) and
predicted here at 4 and 6, with accumulations 1-3; it is fitted in fp32 without checkpointing, and
the last five rows test it on other precisions and checkpointing (as the planner applies it)."""


def rank_main(rank: int, root: Path, model: dict) -> None:
    """Inside each of the 2 ranks (``_common.spawn_ranks``)."""
    import torch
    import torch.distributed as dist

    from trainfit.config import make_config
    from trainfit.probes.calibrate import measure_step_s
    from trainfit.tasks.make import make_task

    task = make_task(model["model"], model_config=model["model_config"], seq_len=model["seq_len"])
    n = sum(p.numel() for p in task.build_model().parameters())
    buf = torch.zeros(n)
    times = []
    for _ in range(10):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    # Per-call latency as measure/scaleout.py takes it: the median of one-element all-reduces
    # (= 2(n-1) ring steps). A one-element all-gather and broadcast are recorded beside it.
    one, two = torch.zeros(1), torch.zeros(2)

    def tiny(op) -> float:
        ts = []
        for _ in range(20):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    tiny_s = {"all_reduce": tiny(lambda: dist.all_reduce(one)),
              "all_gather": tiny(lambda: dist.all_gather_into_tensor(two, one)),
              "broadcast": tiny(lambda: dist.broadcast(one, src=0))}
    s0, mb0, acc0, sync0, _, _ = GRID[0]  # warm-up, as the calibration does (a fresh group's first steps run slow)
    measure_step_s(make_config({**model, "strategy": s0, "micro_batch": mb0, "accumulation": acc0, "grad_sync": sync0}),
                   reps=3)
    steps = [measure_step_s(make_config({**model, "strategy": s, "micro_batch": mb, "accumulation": acc,
                                         "grad_sync": sync, "precision": p, "checkpointing": ck}), reps=15, statistic="median")
             for s, mb, acc, sync, p, ck in GRID]
    Path(root, f"rank{rank}.json").write_text(json.dumps({"all_reduce_s": min(times), "grad_bytes": 4 * n,
                                                          "tiny_s": tiny_s, "steps": steps}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3, help="independent calibrate+measure rounds (spread)")
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt-tiny")
    args = ap.parse_args()
    model = MODELS[args.model]
    name = "planner_time_dist" + ("" if args.model == "gpt-tiny" else f"_{args.model}")
    import torch

    torch.set_num_threads(1)
    from _common import spawn_ranks, write_results

    from trainfit.config import make_config
    from trainfit.meters.devices import device_row
    from trainfit.plan import comm
    from trainfit.plan.cost import Candidate, fit_dist_overhead, step_time
    from trainfit.probes.calibrate import basis_provider, calibrated_links, links_provider, measure_dist_steps

    base = make_config(model)
    basis, _ = basis_provider(base, source="estimate")
    b = basis("fp32", "none")
    runs = []
    for run in range(args.runs):
        # 1. the ranks: link bandwidth/latency and the held-out grid (measurement)
        root = spawn_ranks(rank_main, model)
        meas = json.loads(Path(root, "rank0.json").read_text())
        # 2. the planner's calibration: one-process compute, then the distributed overhead fitted
        # at micro-batch 2, accumulation 1-3 (plan.sources.DIST_POINTS), in separate processes
        bw = meas["grad_bytes"] / meas["all_reduce_s"]  # a 2-rank ring all-reduce of B bytes sends B
        latency = meas["tiny_s"]["all_reduce"] / 2  # one-element all-reduce = 2(n-1) = 2 ring steps
        plain = links_provider(device_row("cpu"), nodes=1, devices=2, intra=bw, inter=None, latency_s=latency)
        calibrated = calibrated_links(base, plain, basis)
        fit_points = measure_dist_steps(base, world=2)
        fitted = fit_dist_overhead(b, calibrated("fp32", "none"), n=2, measured=fit_points)
        rows = []
        for (s, mb, acc, sync, p, ck), measured in zip(GRID, meas["steps"]):
            c = Candidate(precision=p, micro_batch=mb, accumulation=acc, checkpointing=ck, strategy=s,
                          grad_sync=sync, n=2)
            links = dataclasses.replace(calibrated(p, ck), dist_overhead=fitted)  # as plan --calibrate applies it
            t = step_time(basis(p, ck), c, links)
            bare = step_time(basis(p, ck), c, dataclasses.replace(links, dist_overhead=()))
            calls = comm.collective_calls(s, grad_bytes=b.grad_comm_bytes, n_param_tensors=b.n_param_tensors,
                                          fsdp_units=b.n_blocks + 1, accumulation=acc,
                                          per_micro_batch=sync == "per-micro-batch")
            rows.append({"strategy": s, "micro_batch": mb, "accumulation": acc, "grad_sync": sync, "precision": p,
                         "checkpointing": ck,
                         "calls": calls.total(), "pred_compute_s": t.compute_s, "pred_comm_s": t.comm_s,
                         "pred_overhead_s": t.overhead_s, "pred_step_s": t.step_s, "pred_without_overhead_s": bare.step_s,
                         "meas_step_s": measured, "ratio": t.step_s / measured,
                         "ratio_without_overhead": bare.step_s / measured})
            print(run, json.dumps(rows[-1]), flush=True)
        runs.append({"loopback_bytes_per_s": bw, "latency_per_ring_step_s": latency, "tiny_collective_s": meas["tiny_s"],
                     "fit_points": [[*k, v] for k, v in fit_points.items()],
                     "dist_overhead": [list(r) for r in fitted], "rows": rows})
    lines = ["| strategy | precision | ckpt | mb x acc | sync | calls/step | predicted compute s | comm s | overhead s | predicted step s | "
             "measured step s (median) | predicted/measured: median (min-max over runs) | without the overhead term |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    within = 0
    for i, r in enumerate(runs[0]["rows"]):
        ratios = [run["rows"][i]["ratio"] for run in runs]
        bare = [run["rows"][i]["ratio_without_overhead"] for run in runs]
        med = lambda key: statistics.median(run["rows"][i][key] for run in runs)  # noqa: E731
        within += all(0.75 <= x <= 1.25 for x in ratios)
        lines.append(f"| {r['strategy']} | {r['precision']} | {r['checkpointing']} | {r['micro_batch']} x {r['accumulation']} | {r['grad_sync']} | {r['calls']} | "
                     f"{med('pred_compute_s'):.4f} | {med('pred_comm_s'):.4f} | {med('pred_overhead_s'):.4f} | "
                     f"{med('pred_step_s'):.4f} | {med('meas_step_s'):.4f} | {statistics.median(ratios):.2f} "
                     f"({min(ratios):.2f}-{max(ratios):.2f}) | {statistics.median(bare):.2f} |")
    all_ratios = [r["ratio"] for run in runs for r in run["rows"]]
    per_run = sum(0.75 <= x <= 1.25 for x in all_ratios)
    med_ok = sum(0.75 <= statistics.median(run["rows"][i]["ratio"] for run in runs) <= 1.25 for i in range(len(GRID)))
    fits = "; ".join(f"{s}/{sync}: {ps * 1e3:+.2f} ms/step {pm * 1e3:+.2f} ms/micro-batch"
                     for s, sync, ps, pm in runs[0]["dist_overhead"])
    table = (f"Model {model}; {args.runs} independent runs (each: measure the grid on 2 ranks, then calibrate). "
             f"Median ratio within 25%: {med_ok} of {len(GRID)} rows; single runs: {per_run} of {len(all_ratios)} "
             f"row-runs; rows within 25% in every run: {within} of {len(GRID)}.\n\n" + "\n".join(lines)
             + f"\n\nFitted overhead (run 1, at micro-batch 2, accumulation 1-3): {fits}.\n")
    write_results(name, {"model": model, "grid": GRID, "runs": runs}, table + f"\nScatter plot: {name}.png.\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        pts = [(r["meas_step_s"] * 1e3, r["pred_step_s"] * 1e3) for run in runs for r in run["rows"]
               if r["strategy"] == strategy]
        ax.scatter([x for x, _ in pts], [y for _, y in pts], label=strategy, s=18)
    hi = max(max(r["meas_step_s"], r["pred_step_s"]) for run in runs for r in run["rows"]) * 1e3 * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=1, label="predicted = measured")
    ax.plot([0, hi], [0, hi * 1.25], "k:", lw=0.8, label="+/- 25%")
    ax.plot([0, hi], [0, hi * 0.75], "k:", lw=0.8)
    ax.set_xlabel("measured step (ms, median of 15)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title(f"{model['model']}, 2 gloo processes, {args.runs} runs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(__file__).resolve().parent / "results" / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
