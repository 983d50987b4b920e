"""The process group: one per run, created by the entry point, read by the strategies.

Backend: NCCL when CUDA is present, gloo on CPU. Every collective has a timeout, so a
rank whose peer died raises instead of waiting forever (gloo notices a closed socket at
once; the timeout is the backstop for a peer that hangs without closing its sockets).
The environment (``RANK``, ``MASTER_ADDR`` ...) is read by :mod:`trainfit.strategies.launch`,
not here.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trainfit.errors import ConfigError, TrainfitError

DEFAULT_TIMEOUT_S = 300.0
"""Collective timeout when the config does not say: long enough for a slow checkpoint write."""


@dataclass(frozen=True, kw_only=True)
class World:
    """Where this process sits in the job."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes in the job."""
    device: torch.device
    """cuda:LOCAL_RANK under NCCL, cpu under gloo."""
    backend: str
    """nccl or gloo."""


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init(*, init_method: str | None = "env://", rank: int | None = None, world_size: int | None = None,
         local_rank: int = 0, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
         store: dist.Store | None = None) -> World:
    """Create the default process group (no-op when one exists) and return this rank's place.

    Args:
        init_method: ``env://`` (torchrun), ``file:///path`` or ``tcp://host:port``.
        rank, world_size: needed unless ``init_method`` is ``env://``.
        store: a ready key-value store to rendezvous through instead of ``init_method``.
        local_rank: index of this process on its node (selects the GPU under NCCL).
        backend: nccl or gloo; default NCCL with CUDA, gloo without.
        timeout_s: collective timeout in seconds.
    """
    backend = backend or default_backend()
    if backend not in ("nccl", "gloo"):
        raise ConfigError("backend", backend, ("nccl", "gloo"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        if store is not None:
            kw = {"store": store, "rank": rank, "world_size": world_size}
        elif init_method == "env://":
            kw = {"init_method": init_method}
        else:
            kw = {"init_method": init_method, "rank": rank, "world_size": world_size}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kw)
    return current()


def current() -> World | None:
    """This process's place in the default group, or None without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return World(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, backend=backend)


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(t: torch.Tensor, op: dist.ReduceOp, device: torch.device) -> None:
    """In-place all-reduce of a small tensor that may live on the CPU (NCCL needs it on the GPU)."""
    if t.device == device:
        dist.all_reduce(t, op=op)
        return
    buf = t.to(device)
    dist.all_reduce(buf, op=op)
    t.copy_(buf)  # host-device sync under NCCL


class RankStopped(TrainfitError):
    """This rank stopped because a step or collective failed (typically: another rank died)."""


@contextlib.contextmanager
def stop_on_peer_failure(last_checkpoint: Callable[[], str | None]) -> Iterator[None]:
    """Turn a failed collective into one clear error naming this rank and the checkpoint to resume.

    gloo raises at once when a peer's socket closes, and after the collective timeout when a
    peer hangs; either way this rank exits instead of waiting. Out-of-memory is passed through.
    """
    world = current()
    if world is not None:
        register_process(_default_store(), world.rank)
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        world = current()
        if world is None or world.world_size == 1 or isinstance(e, torch.OutOfMemoryError):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        ckpt = last_checkpoint()
        resume = (f"the last checkpoint is {ckpt}: continue with --resume (or launch with torchrun --max-restarts N)"
                  if ckpt else "no checkpoint was written yet (set --checkpoint-every)")
        lost = _wait_for_exited(world)
        who = (f"lost: rank {', '.join(map(str, lost))} (its process on this host has exited)" if lost
               else "If another rank died (its log says why), this is the consequence")
        raise RankStopped(
            f"rank {world.rank} of {world.world_size} stopped: {type(e).__name__}: {first}. {who}: the ranks stop "
            f"rather than wait; {resume}") from e


def _wait_for_exited(world: World, grace_s: float = 1.0) -> list[int]:
    # A peer's sockets close a moment before its process turns into a zombie: look again briefly.
    deadline = time.monotonic() + grace_s
    while not (lost := exited_ranks(_default_store(), world.rank, world.world_size)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return lost


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()  # torchrun's agent / the file store: outlives a rank
    except (RuntimeError, ValueError, AttributeError):
        return None


def register_process(store, rank: int) -> None:
    """Publish ``host:pid`` of this rank, so a survivor can tell which peer died (see :func:`exited_ranks`)."""
    if store is not None:
        with contextlib.suppress(RuntimeError, dist.DistError, OSError):
            store.set(f"trainfit/process/{rank}", f"{socket.gethostname()}:{os.getpid()}")


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie awaiting its parent is dead
    except FileNotFoundError:
        return True
    except OSError:
        return False


def exited_ranks(store, rank: int, world_size: int) -> list[int]:
    """Peers on this host whose process has exited (instant: no waiting, which matters under torchrun,
    whose agent stops the survivors within a fraction of a second). Peers on other hosts are not judged."""
    if store is None or not os.path.isdir("/proc"):
        return []
    lost = []
    host = socket.gethostname()
    for r in range(world_size):
        try:
            if r == rank or not store.check([f"trainfit/process/{r}"]):
                continue
            peer_host, pid = store.get(f"trainfit/process/{r}").decode().rsplit(":", 1)
        except (RuntimeError, dist.DistError, OSError, ValueError):
            continue
        if peer_host == host and _exited(int(pid)):
            lost.append(r)
    return lost


def gather_to_rank0(obj: object) -> list | None:
    """Every rank's ``obj`` (picklable), in rank order, on rank 0; None on the others.

    Without a process group: ``[obj]``.
    """
    world = current()
    if world is None:
        return [obj]
    out = [None] * world.world_size if world.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out
