"""Functions run inside the 2 spawned ranks (see harness.spawn). Results go to files under root."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .harness import ADAMW, BASE, write_json

FP32_CASES = [("ddp", "deferred"), ("ddp", "per-micro-batch"), ("zero1", "deferred"), ("zero2", "deferred"),
              ("zero2", "per-micro-batch"), ("zero3", "deferred"), ("zero3", "per-micro-batch")]
MIXED_CASES = [("ddp", "bf16-mixed"), ("zero1", "bf16-mixed"), ("zero2", "bf16-mixed"), ("zero3", "bf16-mixed"),
               ("ddp", "fp16-mixed"), ("zero3", "fp16-mixed")]
ADAMW_CASES = ["ddp", "zero1", "zero2", "zero3"]
STEPS = 5


def cfg(root: Path, name: str, **kw):
    from trainfit.config import make_config

    return make_config({**BASE, "steps": STEPS, "run_dir": str(root / name), **kw})


def equivalence_and_more(rank: int, root: Path) -> None:
    """Every strategy trains 5 steps; zero3 continues to 10 from its checkpoint; bad input; sync observables;
    memory per rank; then rank 1 dies and rank 0 must stop with a clear error."""
    from trainfit.train import train

    for strategy, sync in FP32_CASES:
        train(cfg(root, f"{strategy}-fp32-{sync}", strategy=strategy, grad_sync=sync), progress=False)
    for strategy in ADAMW_CASES:
        train(cfg(root, f"{strategy}-adamw", strategy=strategy, **ADAMW), progress=False)
    for strategy, precision in MIXED_CASES:
        train(cfg(root, f"{strategy}-{precision}", strategy=strategy, precision=precision), progress=False)
    # zero3 on 2 ranks, resumed from its own step-5 checkpoint, to step 10.
    train(cfg(root, "zero3-fp32-deferred", strategy="zero3", steps=2 * STEPS), resume=True, progress=False)
    bad_input(rank, root)
    memory_per_rank(rank, root)
    grad_sync_observables(rank, root)
    if rank == 0:
        (root / "phase-1-done").write_text("ok")
    dead_peer(rank, root)  # last: rank 1 exits with code 17 in it


def bad_input(rank: int, root: Path) -> None:
    from trainfit.errors import ConfigError
    from trainfit.train import train

    out = {}
    for name, kw in {"indivisible": dict(strategy="ddp", global_batch=5),
                     "single_in_group": dict(strategy="single")}.items():
        try:
            train(cfg(root, f"bad-{name}", **kw), progress=False)
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)
        out[name + "_stepped"] = (root / f"bad-{name}" / "metrics.jsonl").exists()
    if rank == 0:
        write_json(root / "bad_input.json", out)


def grad_sync_observables(rank: int, root: Path) -> None:
    """After one non-last micro-batch: are the gradients already synced? (DDP: equal on both ranks;
    FSDP2: the sharded .grad exists only after a reduce-scatter.)"""
    from trainfit.data import rank_micro_batches
    from trainfit.run import build_run

    out = {}
    for strategy in ("ddp", "zero2"):
        for sync in ("deferred", "per-micro-batch"):
            run = build_run(cfg(root, f"obs-{strategy}-{sync}", strategy=strategy, grad_sync=sync))
            ds = run.task.dataset()
            idx = rank_micro_batches(0, micro_batch=2, accumulation=2, rank=rank, world_size=2,
                                     dataset_size=len(ds), seed=0)[0]
            mb = run.task.collate([ds[i] for i in idx])
            with run.strategy.sync_context(run.model, is_last=False):
                loss, _ = run.task.loss(run.model, mb)
                loss.backward()
            if strategy == "ddp":
                g = torch.cat([p.grad.flatten() for p in run.model.parameters()])
                other = g.clone()
                dist.broadcast(other, src=0)
                out[f"{strategy}-{sync}"] = bool(torch.equal(g, other))  # on rank 1: synced?
            else:
                out[f"{strategy}-{sync}"] = all(p.grad is not None for p in run.model.parameters())
            if strategy == "zero2":  # leave FSDP2 in a clean state: finish the window with a synced pass
                from torch.distributed.fsdp import FSDPModule

                run.model.set_requires_gradient_sync(True)
                out["fsdp_units"] = [n for n, m in run.model.named_modules() if isinstance(m, FSDPModule)]
    if rank == 1:
        write_json(root / "grad_sync.json", out)


def dead_peer(rank: int, root: Path) -> None:
    """Rank 1 dies at its 3rd optimizer step; rank 0 must stop with a clear error, not hang."""
    import trainfit.train as train_mod
    from trainfit.strategies import process_group as pg

    if rank == 1:  # the task's loss is looked up when the task is built: die in step 3's first micro-batch
        import trainfit.tasks.builtin as builtin

        real, calls = builtin.gpt_loss, [0]

        def dying(model, batch):
            calls[0] += 1
            if calls[0] == 2 * BASE["accumulation"] + 1:
                os._exit(17)
            return real(model, batch)

        builtin.gpt_loss = dying
    c = cfg(root, "dead", strategy="zero2", steps=50, checkpoint_every=2, collective_timeout_s=30)
    t0 = time.monotonic()
    try:
        with pg.stop_on_peer_failure(lambda: str(sorted((root / "dead" / "checkpoints").glob("step-*"))[-1])):
            train_mod.train(c, progress=False)
        write_json(root / "dead.json", {"error": None})
    except pg.RankStopped as e:
        write_json(root / "dead.json", {"error": str(e), "seconds": time.monotonic() - t0})


MEMORY_STRATEGIES = ("zero1", "zero2", "zero3")


def memory_cfg(root: Path, strategy: str):
    # One micro-batch per step: under deferred sync FSDP2 would hold whole gradients during the window.
    return cfg(root, f"mem-{strategy}", strategy=strategy, accumulation=1, **ADAMW)


def memory_per_rank(rank: int, root: Path) -> None:
    """The memory issue's measured accounting, inside each rank (sharded tensors count their local shard)."""
    from trainfit.probes.memory import measure_memory
    from trainfit.run import build_run

    out = {}
    for strategy in MEMORY_STRATEGIES:
        c = memory_cfg(root, strategy)
        run = build_run(c)
        r = measure_memory(c, run=run)
        out[strategy] = {p: getattr(r, f"{p}_bytes") for p in ("params", "grads", "optimizer")}
        if strategy == "zero1":  # which whole parameters ZeroRedundancyOptimizer gave this rank
            out["zero1_partition_numel"] = [p.numel() for g in run.optimizer.optim.param_groups for p in g["params"]]
    write_json(root / f"memory-rank{rank}.json", out)
    from trainfit.strategies.process_group import gather_to_rank0

    gathered = gather_to_rank0(out)  # how `trainfit memory` under torchrun reports every rank from rank 0
    if rank == 0:
        write_json(root / "memory-gathered.json", gathered)
