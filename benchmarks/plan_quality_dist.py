"""Plan quality on 2 gloo processes: does the calibrated planner pick the fastest strategy that fits?

    .venv/bin/python benchmarks/plan_quality_dist.py

Search space small enough to measure exhaustively: gpt-tiny (2 layers, d_model 64, seq 64), global
batch 8 on 2 devices, fp32, no checkpointing, ddp / zero1 / zero2 / zero3 x micro-batch 1, 2, 4
(accumulation 4, 2, 1) x FSDP gradient sync, under a per-device budget that excludes some of them.
The planner is calibrated as ``trainfit plan --device cpu --devices 2 --calibrate`` does it
(loopback bandwidth and latency, one-process compute fit, the distributed overhead fitted on 2
spawned processes at micro-batch 2). Then every candidate is run on 2 fresh gloo processes: the
median of 15 steps (rank 0) and whether two steps under the per-rank memory cap (the budget less
headroom, enforced by the tracker on every rank) go out of memory. Claims checked: the top choice
reaches >= 90% of the best measured throughput among configurations that ran under the cap, and no
configuration the planner says fits went out of memory. Writes plan_quality_dist.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODEL = {"model": "gpt-tiny", "model_config": "n_layer=2,d_model=64,n_head=2", "seq_len": 64}
GLOBAL_BATCH = 8
BUDGET = 4_300_000  # bytes per device; with 10% headroom the larger unsharded micro-batches do not fit


def rank_main(rank: int, root: Path, entries: list, cap: int) -> None:
    """Inside each of the 2 ranks (``_common.spawn_ranks``)."""
    import torch
    import torch.distributed as dist
    from plan_quality import runs_under_cap

    from trainfit.config import make_config
    from trainfit.probes.calibrate import measure_step_s

    base = make_config(MODEL)
    out = []
    first = True
    for e in entries:
        cfg = make_config({"strategy": e["strategy"], "grad_sync": e["grad_sync"], "micro_batch": e["micro_batch"],
                           "accumulation": e["accumulation"]}, base=base)
        if first:  # warm-up, as the calibration does
            measure_step_s(cfg, reps=3)
            first = False
        dist.barrier()
        ok = runs_under_cap(cfg, cap)
        flag = torch.tensor([0.0 if ok else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # any rank out of memory = the config does not fit
        dist.barrier()
        out.append({"ran_under_cap": flag.item() == 0.0,
                    "measured_step_s": measure_step_s(cfg, reps=15, statistic="median")})
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help only
    import torch

    torch.set_num_threads(1)
    from _common import spawn_ranks, write_results

    from trainfit.config import make_config
    from trainfit.meters.devices import device_row, measure_loopback
    from trainfit.plan.rules import Context
    from trainfit.plan.search import SearchSpace, search
    from trainfit.probes.calibrate import basis_provider, calibrated_links, links_provider, with_dist_overhead

    base = make_config(MODEL)
    space = SearchSpace(global_batch=GLOBAL_BATCH, devices=2, memory_bytes=BUDGET, precisions=("fp32",),
                        checkpointings=("none",), strategies=("ddp", "zero1", "zero2", "zero3"),
                        micro_batches=(1, 2, 4))
    basis, _ = basis_provider(base, source="estimate")
    bw, lat = measure_loopback()
    links = links_provider(device_row("cpu"), nodes=1, devices=2, intra=bw, inter=None, latency_s=lat)
    links = calibrated_links(base, links, basis)
    links, fitted = with_dist_overhead(links, base, basis, world=2, strategies=space.strategies)
    result = search(space, ctx=Context(devices=2, dtypes=("fp32", "bf16", "fp16")), basis=basis, links=links)
    entries = [{"rank": i, "strategy": e.strategy, "grad_sync": e.grad_sync, "micro_batch": e.micro_batch,
                "accumulation": e.accumulation, "planned_fits": e.fits, "predicted_peak_bytes": e.peak_bytes_per_device,
                "predicted_step_s": e.step_s} for i, e in enumerate(result.entries, 1)]
    root = spawn_ranks(rank_main, entries, int(space.budget_bytes))
    measured = json.loads(Path(root, "rank0.json").read_text())
    rows = [{**e, **m} for e, m in zip(entries, measured)]
    for r in rows:
        print(json.dumps(r), flush=True)
    fitting = [r for r in rows if r["ran_under_cap"]]
    best = min(fitting, key=lambda r: r["measured_step_s"])
    top = rows[0]
    ratio = best["measured_step_s"] / top["measured_step_s"]
    false_fits = [r for r in rows if r["planned_fits"] and not r["ran_under_cap"]]
    lines = ["| rank | strategy | sync | mb x acc | planned fits | ran under cap | predicted peak | predicted s | "
             "measured s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rank']} | {r['strategy']} | {r['grad_sync']} | {r['micro_batch']} x {r['accumulation']} | "
                     f"{r['planned_fits']} | {r['ran_under_cap']} | {r['predicted_peak_bytes']:,} | "
                     f"{r['predicted_step_s']:.4f} | {r['measured_step_s']:.4f} |")
    fits = "; ".join(f"{s}/{sync} {ps * 1e3:+.1f} ms/step {pm * 1e3:+.1f} ms/micro-batch" for s, sync, ps, pm in fitted)
    write_results("plan_quality_dist", {"model": MODEL, "global_batch": GLOBAL_BATCH, "budget_bytes": BUDGET,
                                        "top_vs_best_throughput": ratio, "planned_fit_but_oom": len(false_fits),
                                        "dist_overhead": [list(f) for f in fitted], "notes": result.notes, "rows": rows},
                  f"2 gloo processes, model {MODEL}, global batch {GLOBAL_BATCH}, budget {BUDGET:,} bytes per device "
                  f"(10% headroom). Top choice's measured throughput = {ratio:.0%} of the best measured configuration "
                  f"that ran under the cap ({best['strategy']} {best['grad_sync']} {best['micro_batch']} x "
                  f"{best['accumulation']}); planned to fit but out of memory under the cap: {len(false_fits)}.\n\n"
                  + "\n".join(lines) + f"\n\nFitted distributed overhead: {fits}.\n")
    print(f"top/best throughput {ratio:.2f}; planned-fit-but-OOM {len(false_fits)}")


if __name__ == "__main__":
    main()
