"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), for the distributed strategies.

Layout under ``RUN_DIR/checkpoints``::

    step-00000050.dcp/        one directory per checkpoint
        __0_0.distcp ...      each rank writes its own shards (plus one copy of replicated tensors)
        .metadata             DCP's index: global shape and placement of every tensor
        trainfit.json         step, config, world size, strategy, precision and scaler state, schedule

Atomic at the directory level: every rank writes into ``.step-00000050.dcp.tmp``; after all
have finished, rank 0 adds ``trainfit.json`` and renames the directory into place, so a
directory named ``step-*.dcp`` is always complete. A multi-node job needs ``RUN_DIR`` on a
filesystem all nodes share.

Keys are parameter names (the unwrapped model's), never positions or ranks, so a checkpoint
loads into any world size and any strategy: DCP reshards each tensor on load (zero3 on 2
ranks -> single on 1, ddp -> zero2, ...). What is stored: model weights, the optimizer
state of every parameter (under ``zero1`` each rank writes the partition it owns), and the
fp32 master weights of ``*-true`` precisions, the learning-rate schedule's state (in ``trainfit.json``,
restored with the param groups' lr), and each rank's torch RNG state (``rng/rankN.pt``,
CPU and, on a GPU, the current device's), restored when the checkpoint is resumed on the same
number of ranks -- so dropout continues the same streams. On another world size the streams
cannot be mapped; the resume says so (a warning) and continues with fresh ones. The data order
depends only on the step.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainfit.checkpoint import (
    atomic_write_bytes,
    check_resumable,
    checkpoint_dir,
    list_checkpoints,
    load_latest,
    restore_rng,
    resume_record,
    rng_state,
)
from trainfit.errors import CheckpointError
from trainfit.gate import RECORD, read_document
from trainfit.levers.schedule import restore_scheduler
from trainfit.strategies.base import Checkpointed, unwrap

FORMAT = "trainfit-dcp-v1"
META = "trainfit.json"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def list_dcp(run_dir: str | Path) -> list[Path]:
    """Complete sharded checkpoints, oldest first."""
    d = checkpoint_dir(run_dir)
    return sorted(p for p in d.glob("step-*.dcp") if (p / META).is_file()) if d.is_dir() else []


def _step_of(path: Path) -> int:
    return int(re.search(r"step-(\d+)", path.name).group(1))


def _trainable_names(run: Checkpointed) -> list[str]:
    names = [n for n, p in unwrap(run.model).named_parameters() if p.requires_grad]
    assert len(names) == len(run.precision.optimizer_params(run.model)), "optimizer params must follow model order"
    return names


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's partition


@torch.no_grad()
def _materialise_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (DCP loads *into* existing tensors).

    One step with lr=0 on zero gradients creates them without changing any weight
    (decoupled weight decay multiplies by 1 - lr*wd = 1).
    """
    opt = _local_optimizer(optimizer)
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(p in opt.state for p in params):
        return
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def _state(run: Checkpointed) -> tuple[dict, dict]:
    """The DCP state (tensors keyed by parameter name) and the precision's non-tensor state."""
    model_sd = unwrap(run.model).state_dict()
    opt = _local_optimizer(run.optimizer)
    optim = {}
    for name, p in zip(_trainable_names(run), run.precision.optimizer_params(run.model)):
        if p in opt.state:  # zero1: only the partition this rank owns
            optim[name] = opt.state[p]
    precision = run.precision.state_dict()
    masters = precision.pop("master", None)
    state = {"model": model_sd, "optim": optim}
    if masters is not None:
        state["master"] = dict(zip(_trainable_names(run), masters))
    return state, precision


def save(run: Checkpointed, step: int) -> Path:
    """Write a sharded checkpoint after ``step`` optimizer steps (a collective: every rank calls it)."""
    d = checkpoint_dir(run.cfg.run_dir)
    final = d / f"step-{step:08d}.dcp"
    tmp = d / f".{final.name}.tmp"
    if _rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a rank that died mid-write
        tmp.mkdir()
    _barrier()
    _materialise_optimizer_state(run.optimizer)
    state, precision = _state(run)
    dcp.save(state, checkpoint_id=str(tmp))
    _save_rng(tmp, run)
    _barrier()  # every rank's RNG file is in place before rank 0 renames the directory
    if _rank() == 0:
        meta = {"format": FORMAT, "step": step, "config": resume_record(run.cfg), "world_size": _world(),
                "strategy": run.strategy.name, "precision": precision, "schedule": run.scheduler.state_dict()}
        atomic_write_bytes(tmp / META, json.dumps(meta).encode())
        if final.exists():  # re-written after a restart: the new one is at least as recent
            shutil.rmtree(final)
        os.replace(tmp, final)
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for old in list_dcp(run.cfg.run_dir)[: -run.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(run: Checkpointed, path: Path) -> int:
    """Load a sharded checkpoint into ``run`` (any strategy, any world size); returns the next step.

    Raises:
        CheckpointError: unreadable, or written for a different model/optimizer/precision/global batch.
    """
    meta = read_document(path / META, field=f"checkpoint {path.name}/{META}", fmt="json", limits=RECORD,
                         error=CheckpointError)  # bounded: a sidecar nested thousands deep is refused in one line
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a trainfit sharded checkpoint (expected {FORMAT!r})")
    check_resumable(meta["config"], int(meta["world_size"]), resume_record(run.cfg), _world(), path)
    _materialise_optimizer_state(run.optimizer)
    state, _ = _state(run)
    try:
        dcp.load(state, checkpoint_id=str(path))
        unwrap(run.model).load_state_dict(state["model"])
        precision = dict(meta["precision"])
        if "master" in state:
            precision["master"] = [state["master"][n] for n in _trainable_names(run)]
        run.precision.load_state_dict(precision)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} does not match this model/optimizer: {str(e).splitlines()[0]}") from None
    _load_rng(path, run, saved_world=int(meta["world_size"]))
    try:  # the param groups' lr too: DCP holds the optimizer's state tensors, not its groups
        restore_scheduler(run.scheduler, meta.get("schedule"), int(meta["step"]))  # absent: an older trainfit
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: its learning-rate schedule state is unreadable "
                              f"({type(e).__name__})") from None
    return int(meta["step"])


def _save_rng(directory: Path, run: Checkpointed) -> None:
    """This rank's RNG state into ``directory/rng/rank{r}.pt`` (plain tensors: loads with weights_only)."""
    (directory / "rng").mkdir(exist_ok=True)
    buf = io.BytesIO()
    torch.save(rng_state(run.strategy.device), buf)
    atomic_write_bytes(directory / "rng" / f"rank{_rank()}.pt", buf.getvalue())


def _load_rng(path: Path, run: Checkpointed, *, saved_world: int) -> None:
    if saved_world != _world():
        if _rank() == 0:
            warnings.warn(f"checkpoint {path.name} was written by {saved_world} ranks, this run has {_world()}: "
                          "the torch RNG streams cannot be mapped between world sizes and start fresh "
                          "(dropout masks will differ from an uninterrupted run; weights and optimizer state "
                          "are restored exactly)", stacklevel=2)
        return
    file = path / "rng" / f"rank{_rank()}.pt"
    if not file.exists():  # written before RNG was stored
        if _rank() == 0:
            warnings.warn(f"checkpoint {path.name} holds no RNG state (an older trainfit): the torch RNG "
                          "streams start fresh", stacklevel=2)
        return
    try:
        restore_rng(torch.load(file, weights_only=True), run.strategy.device)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one clear message
        raise CheckpointError(f"checkpoint {path}: unreadable RNG state {file.name} ({type(e).__name__})") from None


def resume(run: Checkpointed, run_dir: str | Path) -> int | None:
    """Restore the newest checkpoint in ``run_dir``, sharded or one-file; the next step, or None when there is none.

    A sharded checkpoint loads into any strategy and world size; a one-file (``.pt``) one only into ``single``.

    Raises:
        CheckpointError: the newest checkpoint is a one-file one and this run is distributed, or none verifies.
    """
    sharded, single = list_dcp(run_dir), list_checkpoints(run_dir)
    newest_single = _step_of(single[-1]) if single else -1
    if sharded and _step_of(sharded[-1]) >= newest_single:
        return load(run, sharded[-1])
    if not single:
        return None
    if run.strategy.world_size > 1:
        raise CheckpointError(
            f"the newest checkpoint {single[-1]} was written by strategy=single; resume it with strategy=single "
            f"(sharded checkpoints, written by the distributed strategies, load into any strategy)")
    path, state = load_latest(run_dir)
    return run.restore(state, path)


def has_checkpoints(run_dir: str | Path) -> bool:
    return bool(list_dcp(run_dir) or list_checkpoints(run_dir))
