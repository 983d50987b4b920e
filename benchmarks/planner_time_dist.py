"""Predicted vs measured step time on 2 gloo processes (one torch thread each on this 2-core machine).

    .venv/bin/python benchmarks/planner_time_dist.py [--out benchmarks/results]

Prediction: compute from ``calibrated_links`` fitted to single-process steps (one thread, wall
clock), plus the communication of ``plan.comm`` at the loopback bandwidth measured by timing
an all-reduce of the gradient size inside the two ranks, and a per-collective-call latency
(each call the strategy issues -- DDP buckets, ZeroRedundancyOptimizer broadcasts, FSDP2
per-unit gathers and scatters, the engine's small all-reduces -- pays its ring steps of it)
from the median one-element all-reduce inside the ranks, as measure/scaleout.py takes it;
gloo on CPU does not overlap communication with backward. Measurement: the fastest of 5 steps (wall clock) inside rank 0. Both use the
fastest of several tries because other processes on this shared machine only ever add time.
Writes planner_time_dist.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import statistics
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
    steps = [measure_step_s(make_config({**MODEL, "strategy": s, "micro_batch": mb, "accumulation": acc,
                                         "grad_sync": sync})) for s, mb, acc, sync in GRID]
    Path(root, f"rank{rank}.json").write_text(json.dumps({"all_reduce_s": min(times), "grad_bytes": 4 * n,
                                                          "tiny_s": tiny_s, "steps": steps}))
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
    from trainfit.plan import comm
    from trainfit.plan.cost import Candidate, step_time
    from trainfit.plan.devices import device_row
    from trainfit.plan.sources import basis_provider, calibrated_links, links_provider

    base = make_config(MODEL)
    # A ring all-reduce of B bytes on 2 devices sends B per device: bandwidth = B / t.
    bw = meas["grad_bytes"] / meas["all_reduce_s"]
    basis, _ = basis_provider(base, source="estimate")
    plain = links_provider(device_row("cpu"), nodes=1, devices=2, intra=bw, inter=None)
    links = calibrated_links(base, plain, basis)
    # A one-element all-reduce on 2 ranks is 2(n-1) = 2 ring steps of latency (as measure/scaleout.py).
    latency = meas["tiny_s"]["all_reduce"] / 2
    rows = []
    for (s, mb, acc, sync), measured in zip(GRID, meas["steps"]):
        c = Candidate(precision="fp32", micro_batch=mb, accumulation=acc, checkpointing="none", strategy=s,
                      grad_sync=sync, n=2)
        t = step_time(basis("fp32", "none"), c, dataclasses.replace(links("fp32", "none"), bandwidth_bytes_per_s=bw,
                                                                   latency_s=latency))
        b = basis("fp32", "none")
        calls = comm.collective_calls(s, grad_bytes=b.grad_comm_bytes, n_param_tensors=b.n_param_tensors,
                                      fsdp_units=b.n_blocks + 1, accumulation=acc,
                                      per_micro_batch=sync == "per-micro-batch")
        rows.append({"strategy": s, "micro_batch": mb, "accumulation": acc, "grad_sync": sync,
                     "calls": calls.total(), "pred_compute_s": t.compute_s, "pred_comm_s": t.comm_s, "pred_step_s": t.step_s,
                     "meas_step_s": measured, "ratio": t.step_s / measured, "time_err": t.step_s / measured - 1})
        print(json.dumps(rows[-1]), flush=True)
    summary = {"command": "python benchmarks/planner_time_dist.py", "model": MODEL,
               "loopback_bytes_per_s": bw, "latency_per_ring_step_s": latency, "tiny_collective_s": meas["tiny_s"],
               "rows": rows}
    (out / "planner_time_dist.json").write_text(json.dumps(summary, indent=1))
    lines = ["| strategy | mb x acc | sync | calls/step | predicted compute s | predicted comm s | predicted step s | "
             "measured step s | predicted/measured |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['micro_batch']} x {r['accumulation']} | {r['grad_sync']} | {r['calls']} | "
                     f"{r['pred_compute_s']:.4f} | {r['pred_comm_s']:.4f} | {r['pred_step_s']:.4f} | "
                     f"{r['meas_step_s']:.4f} | {r['ratio']:.2f} |")
    (out / "planner_time_dist.md").write_text(
        "# Predicted vs measured step time, 2 gloo processes\n\nCommand: `python benchmarks/planner_time_dist.py`; "
        f"loopback all-reduce bandwidth measured {bw / 1e6:.0f} MB/s; one-element all-reduce "
        f"{meas['tiny_s']['all_reduce'] * 1e6:.0f} us (latency {latency * 1e6:.0f} us per ring step), all-gather "
        f"{meas['tiny_s']['all_gather'] * 1e6:.0f} us, broadcast {meas['tiny_s']['broadcast'] * 1e6:.0f} us.\n\n"
        + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
