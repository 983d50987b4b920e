"""Run inside 2 spawned gloo ranks (see distributed.harness.spawn). Results go to rank<r>.json.

Each rank builds the same job twice -- on one device (``Single``) and under ddp -- and
alternates their steps: one single-device step on both processes at once (so each gets what
a ddp rank gets: one thread, half of the 2-core machine, under the same outside load), then
one ddp step. The 2-device prediction is made from the single-device steps and the link's
bandwidth and latency (given to it as a user would; here timed on the live group, because on
an oversubscribed machine a gloo hop costs ~1-2 ms of peer scheduling that an idle loopback
ping does not show). The loopback-based default prediction is recorded too.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import torch.distributed as dist

CFG = {"model_config": "n_layer=2,d_model=128,n_head=2", "seq_len": 64, "micro_batch": 8, "accumulation": 2,
       "dataset_size": 512}


def single_then_ddp(rank: int, root: Path, steps: int) -> None:
    from trainfit.config import make_config
    from trainfit.probes import scaleout
    from trainfit.probes.profile import ProfileOptions, run_steps, step_batches
    from trainfit.run import build_run
    from trainfit.strategies.single import Single

    cfg = make_config(CFG)
    one, ddp = build_run(cfg, strategy=Single("cpu")), build_run(dataclasses.replace(cfg, strategy="ddp"))
    b_one, b_ddp = step_batches(one, cfg.micro_batch), step_batches(ddp, cfg.micro_batch)
    run_steps(one, b_one, steps=0, warmup=3)
    run_steps(ddp, b_ddp, steps=0, warmup=3)
    rows_one, rows_ddp = [], []
    for _ in range(steps):
        dist.barrier()  # untimed: both processes start each step together
        rows_one += run_steps(one, b_one, steps=1, warmup=0)
        dist.barrier()
        rows_ddp += run_steps(ddp, b_ddp, steps=1, warmup=0)
    # Both processes' single-device steps are samples of "a device" under the same conditions.
    mine = [r["step_s"] - r["data_wait_s"] - r["comm_exposed_s"] for r in rows_one]
    gathered: list = [None, None]
    dist.all_gather_object(gathered, mine)
    samples = [x for g in gathered for x in g]
    small = max(r["collectives"] for r in rows_one) + 1  # + the token count, skipped on one process
    grad_bytes = sum(p.numel() * p.element_size() for p in one.model.parameters())
    bw, latency, _ = scaleout.bandwidth(ddp, ProfileOptions(), grad_bytes)  # the link, timed on the live group
    args = (statistics.median(samples), statistics.median(r["backward_s"] for r in rows_one), samples, small)
    sc = scaleout.scaling(one, ProfileOptions(bandwidth_bytes_per_s=bw, latency_s=latency), *args)
    loop = scaleout.scaling(one, ProfileOptions(), *args)  # the single-process default: TCP loopback, idle peer
    at2 = lambda s: {p["n"]: p for p in s["curves"]["ddp"]["points"]}[2]  # noqa: E731
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    out = {"predicted_2": at2(sc), "predicted_2_loopback": at2(loop), "scaling": sc, "loopback": loop,
           "single": {k: med(rows_one, k) for k in rows_one[0]},
           "ddp": {k: med(rows_ddp, k) for k in rows_ddp[0]}, "world_size": ddp.strategy.world_size}
    (root / f"rank{rank}.json").write_text(json.dumps(out))
