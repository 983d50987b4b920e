"""Predicted vs measured step time on 2 gloo processes (one torch thread each on this 2-core machine).

    .venv/bin/python benchmarks/planner_time_dist.py [--out benchmarks/results]

Prediction: compute from ``calibrated_links`` fitted to single-process steps (one thread, wall
clock), plus the communication of ``plan.comm`` at the loopback bandwidth measured by timing
an all-reduce of the gradient size inside the two ranks; gloo on CPU does not overlap it with
backward. Measurement: the fastest of 5 steps (wall clock) inside rank 0. Both use the
fastest of several tries because other processes on this shared machine only ever add time.
Writes planner_time_dist.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

MODEL = {"model": "gpt-tiny", "model_config": "n_layer=2,d_model=64,n_head=2", "seq_len": 64}
GRID = [("ddp", 4, 1, "deferred"), ("ddp", 4, 2, "deferred"), ("zero1", 4, 1, "deferred"),
        ("zero2", 4, 2, "per-micro-batch"), ("zero3", 4, 1, "deferred")]


def rank_main(rank: int, root: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from trainfit.config import make_config
    from trainfit.plan.sources import measure_step_s
    from trainfit.strategies import process_group as pg
    from trainfit.tasks import make_task

    pg.init(init_method=f"file://{root}/rendezvous", rank=rank, world_size=2, timeout_s=300)
    task = make_task(MODEL["model"], model_config=MODEL["model_config"], seq_len=MODEL["seq_len"])
    n = sum(p.numel() for p in task.build_model().parameters())
    buf = torch.zeros(n)
    times = []
    for _ in range(10):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    steps = [measure_step_s(make_config({**MODEL, "strategy": s, "micro_batch": mb, "accumulation": acc,
                                         "grad_sync": sync})) for s, mb, acc, sync in GRID]
    Path(root, f"rank{rank}.json").write_text(json.dumps({"all_reduce_s": min(times), "grad_bytes": 4 * n,
                                                          "steps": steps}))
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, root)) for r in range(2)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(1800)
    meas = json.loads(Path(root, "rank0.json").read_text())

    import torch

    torch.set_num_threads(1)
    from trainfit.config import make_config
    from trainfit.plan.cost import Candidate, step_time
    from trainfit.plan.devices import device_row
    from trainfit.plan.sources import basis_provider, calibrated_links, links_provider

    base = make_config(MODEL)
    # A ring all-reduce of B bytes on 2 devices sends B per device: bandwidth = B / t.
    bw = meas["grad_bytes"] / meas["all_reduce_s"]
    basis, _ = basis_provider(base, source="estimate")
    plain = links_provider(device_row("cpu"), nodes=1, devices=2, intra=bw, inter=None)
    links = calibrated_links(base, plain, basis)
    rows = []
    for (s, mb, acc, sync), measured in zip(GRID, meas["steps"]):
        c = Candidate(precision="fp32", micro_batch=mb, accumulation=acc, checkpointing="none", strategy=s,
                      grad_sync=sync, n=2)
        t = step_time(basis("fp32", "none"), c, dataclasses.replace(links("fp32", "none"), bandwidth_bytes_per_s=bw))
        rows.append({"strategy": s, "micro_batch": mb, "accumulation": acc, "grad_sync": sync,
                     "pred_compute_s": t.compute_s, "pred_comm_s": t.comm_s, "pred_step_s": t.step_s,
                     "meas_step_s": measured, "time_err": t.step_s / measured - 1})
        print(json.dumps(rows[-1]), flush=True)
    summary = {"command": "python benchmarks/planner_time_dist.py", "model": MODEL,
               "loopback_bytes_per_s": bw, "rows": rows}
    (out / "planner_time_dist.json").write_text(json.dumps(summary, indent=1))
    lines = ["| strategy | mb x acc | sync | predicted compute s | predicted comm s | predicted step s | "
             "measured step s | error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['micro_batch']} x {r['accumulation']} | {r['grad_sync']} | "
                     f"{r['pred_compute_s']:.4f} | {r['pred_comm_s']:.4f} | {r['pred_step_s']:.4f} | "
                     f"{r['meas_step_s']:.4f} | {r['time_err']:+.0%} |")
    (out / "planner_time_dist.md").write_text(
        "# Predicted vs measured step time, 2 gloo processes\n\nCommand: `python benchmarks/planner_time_dist.py`; "
        f"loopback all-reduce bandwidth measured {bw / 1e6:.0f} MB/s.\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
