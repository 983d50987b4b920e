"""Launching: torchrun's environment in, torch's own launcher out.

The only module of trainfit that reads environment variables (the ones torchrun sets for
each worker). ``trainfit train --devices N`` re-runs itself under
``torch.distributed.run`` (the code behind ``torchrun``), standalone: a c10d rendezvous on a
free loopback port, so nothing is fixed and nothing is home-made.

Bounded: the processes it starts are capped by what this machine runs (:func:`trainfit.gate.max_processes`), a
multi-node job's node count by :data:`MAX_NODES`; node 0's address is resolved once, within
:data:`RESOLVE_TIMEOUT_S` (:func:`resolve_host`), and a node waits for its peers at most ``--join-timeout``
(:data:`JOIN_TIMEOUT_S` by default), saying so once, then stops in one line (:class:`PeersMissing`).
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import trainfit.gate as gate
from trainfit.errors import ConfigError, TrainfitError, shown
from trainfit.progress import info
from trainfit.strategies import process_group as pg

MAX_NODES = 16_384
"""The most nodes a ``--nodes`` job may name: above every machine built so far (the largest have about 10,000
nodes), so a typo (``--nodes 2**20``) is refused instead of node 0 waiting for a million peers."""

RESOLVE_TIMEOUT_S = 10.0
"""How long node 0's address may take to resolve (once, before anything is created): a name that does not resolve
is refused at once, a resolver that does not answer after this long."""

JOIN_TIMEOUT_S = 300.0
"""How long a node of a multi-node job waits for its peers by default (``--join-timeout``, ``join_timeout_s``):
node 0 for the others to join, the others for node 0 to listen. Then it stops in one line."""

MAX_JOIN_TIMEOUT_S = 86_400.0
"""The longest ``--join-timeout`` (a day)."""


@dataclass(frozen=True, kw_only=True)
class TorchrunEnv:
    """What torchrun tells a worker."""

    rank: int
    world_size: int
    local_rank: int
    restart_count: int
    """How many times the elastic agent has restarted the workers (0 on the first attempt)."""
    master_addr: str
    master_port: int
    agent_store: bool
    """Whether the elastic agent hosts the key-value store (else rank 0 does)."""


def torchrun_env() -> TorchrunEnv | None:
    """This process's torchrun environment, or None when not launched by torchrun."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_RANK" not in env:
        return None
    return TorchrunEnv(rank=int(env.get("RANK", 0)), world_size=int(env.get("WORLD_SIZE", 1)),
                       local_rank=int(env.get("LOCAL_RANK", 0)),
                       restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                       master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 29500)),
                       agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str | None:
    """Name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or None."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return None


def bind_gloo_to_loopback() -> None:
    """Make gloo use the loopback interface (single-machine jobs: no traffic leaves the host)."""
    name = loopback_interface()
    if name and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def init_from_torchrun(env: TorchrunEnv, *, timeout_s: float) -> pg.World:
    """Create the process group from torchrun's environment.

    The store is torchrun's, but under a prefix per restart attempt: the agent's store outlives
    a restart, and without the prefix a restarted rank can read the address a dead rank published
    in the previous attempt (gloo then fails with "connection refused").
    """
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    if _is_loopback(env.master_addr):
        bind_gloo_to_loopback()
    store = TCPStore(env.master_addr, env.master_port, env.world_size, is_master=not env.agent_store and env.rank == 0,
                     timeout=timedelta(seconds=timeout_s), multi_tenant=True)
    store = PrefixStore(f"trainfit/attempt-{env.restart_count}", store)
    return pg.init(store=store, rank=env.rank, world_size=env.world_size, local_rank=env.local_rank,
                   timeout_s=timeout_s)


REFUSALS_ENV = "TRAINFIT_REFUSALS"
"""Set by :func:`launch` for its workers: the directory where a worker that refuses the job writes its one
line (``rank-N.txt``) instead of printing it, so the launcher prints it once."""


class PeersMissing(TrainfitError):
    """A node of a multi-node job did not meet its peers within the join timeout (or lost them at the rendezvous)."""


def resolve_host(field: str, host: str, *, port: int, timeout_s: float = RESOLVE_TIMEOUT_S) -> str:
    """The first address ``host`` resolves to, looked up once in a thread with a deadline (``getaddrinfo`` itself
    has none: a resolver that never answers would hold the caller, and torch's rendezvous retries a name that
    does not resolve forever, a warning line each time). Refused naming ``field`` otherwise."""
    found: dict[str, object] = {}

    def look_up() -> None:
        try:
            found["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError) as e:  # gaierror; a label over 63 characters; a NUL
            found["error"] = e

    worker = threading.Thread(target=look_up, name="trainfit-resolve", daemon=True)
    worker.start()
    worker.join(timeout_s)
    allowed = "a host name or address of node 0 that this machine resolves"
    if worker.is_alive():
        raise ConfigError(field, host, allowed, f"the resolver did not answer within {timeout_s:g} s")
    if "error" in found or not found.get("infos"):
        e = found.get("error")
        why = (e.strerror if isinstance(e, OSError) and e.strerror else shown(str(e), 80)) if e else "no address"
        raise ConfigError(field, host, allowed, f"it does not resolve here: {why}")
    return found["infos"][0][4][0]


def wait_for_listener(host: str, port: int, *, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` within ``timeout_s`` (tried every ``poll_s``;
    the connection is closed at once). A node other than 0 waits so before torch's rendezvous, whose client would
    print a warning line per failed try."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, left))):
                return True
        except OSError:
            pass
        if deadline - time.monotonic() <= 0:
            return False
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def _say_waiting(nnodes: int, node_rank: int, where: str, timeout_s: float) -> None:
    peers = (f"the other {nnodes - 1} node{'s' if nnodes > 2 else ''} to join" if node_rank == 0
             else "node 0 to listen")
    info("train", f"node {node_rank} of {nnodes}: waiting up to {timeout_s:g} s for {peers} at {where} "
                  "(--join-timeout)")


def _join_peers(nnodes: int, node_rank: int, master_addr: str, master_port: int, timeout_s: float) -> list[str]:
    """Say once that this node waits for its peers, wait for node 0 (on another node), and return torchrun's
    arguments of a static rendezvous that gives up after ``timeout_s``."""
    where = f"{master_addr}:{master_port}"
    _say_waiting(nnodes, node_rank, where, timeout_s)
    if node_rank > 0 and not wait_for_listener(master_addr, master_port, timeout_s=timeout_s):
        raise PeersMissing(f"train --nodes {nnodes}: node {node_rank} waited {timeout_s:g} s for node 0 at {where} "
                           "and nothing listened there; start node 0 (--node-rank 0) with the same --master-addr "
                           "and --master-port, or raise --join-timeout")
    return [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
            f"--master-port={master_port}", f"--rdzv-conf=timeout={max(1, math.ceil(timeout_s))}"]


def launch(nproc: int, child_argv: list[str], *, max_restarts: int = 0, refusals: str | Path | None = None,
           nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int = 29500,
           join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Run ``python -m trainfit <child_argv>`` in ``nproc`` processes through torch.distributed.run.

    ``nnodes`` 1: standalone (a c10d rendezvous on a free loopback port). More: these ``nproc`` processes are
    node ``node_rank`` of ``nnodes`` (torchrun's static rendezvous at ``master_addr:master_port``, which node 0
    hosts; global ranks ``node_rank * nproc + local rank``), as ``torchrun --nnodes --node-rank --master-addr
    --master-port`` starts them.

    ``refusals``: a directory the workers write their refusals to (:func:`relay_refusal`); once one is there,
    torch's launcher logs nothing more (its line per failed worker): the caller prints the refusal, once. Its
    OMP_NUM_THREADS banner is not printed (the variable is set here, as it would set it).

    ``join_timeout_s`` (several nodes): how long this node waits for its peers, said once before it waits.

    Raises:
        ConfigError: ``nproc`` above what this machine runs (the caller checks first, before it creates anything).
        PeersMissing: several nodes that did not all meet within ``join_timeout_s``.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a worker failed
            (after ``max_restarts`` restarts of the whole group).
    """
    from torch.distributed import DistError
    from torch.distributed.run import parse_args

    gate.check_process_count("devices", nproc)
    where = ["--standalone"] if nnodes == 1 else _join_peers(nnodes, node_rank, master_addr, master_port,
                                                             join_timeout_s)
    if nnodes == 1 or _is_loopback(master_addr):
        bind_gloo_to_loopback()  # inherited by the workers (a job spread over machines keeps gloo's own choice)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torch's launcher sets for several workers, unannounced
    args = parse_args([*where, f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
                       "--no-python", sys.executable, "-m", "trainfit", *child_argv])
    try:
        _run(args, refusals)
    except DistError as e:  # the static rendezvous's store: a peer that never came, or went at the rendezvous
        if nnodes == 1:
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PeersMissing(f"train --nodes {nnodes}: node {node_rank} stopped at the rendezvous at "
                           f"{master_addr}:{master_port} (torch: {first[:160].rstrip('.')}); every node runs the "
                           f"same command with its --node-rank, 0 to {nnodes - 1}, within --join-timeout "
                           f"{join_timeout_s:g} s of node 0") from None


def _run(args, refusals: str | Path | None) -> None:
    """torch's launcher on ``args``, its log lines held back once a worker has relayed a refusal."""
    import logging

    from torch.distributed.run import run

    if refusals is not None:
        os.environ[REFUSALS_ENV] = str(refusals)
    quiet = _QuietAfterRefusal(refusals)
    handlers = [h for name in ("torch", "torch.distributed") for h in logging.getLogger(name).handlers]
    for h in handlers:  # a crash or a restart is still logged as torch logs it
        h.addFilter(quiet)
    try:
        run(args)
    finally:
        for h in handlers:
            h.removeFilter(quiet)
        os.environ.pop(REFUSALS_ENV, None)


class _QuietAfterRefusal:
    """A logging filter: nothing from torch's launcher once a worker has relayed a refusal."""

    def __init__(self, refusals: str | Path | None) -> None:
        self.refusals = refusals

    def filter(self, record) -> bool:
        return not (self.refusals and any(Path(self.refusals).glob("rank-*.txt")))


REFUSAL_GRACE_S = 15.0
"""How long a worker that refused waits for its peers to refuse too before it exits: the same job is refused
by every rank, a second apart; a rank that left first would break a peer still joining the process group
(a traceback and gloo's own log lines on stderr)."""


def relay_refusal(rank: int, world_size: int, message: str) -> bool:
    """In a worker :func:`launch` started: write this rank's refusal for the launcher to print, wait (at most
    :data:`REFUSAL_GRACE_S`) until every rank has, and say so (False when not launched that way: the caller
    prints it)."""
    where = os.environ.get(REFUSALS_ENV)
    if not where or not Path(where).is_dir():
        return False
    Path(where, f"rank-{rank}.txt").write_text(message)
    deadline = time.monotonic() + REFUSAL_GRACE_S
    while len(list(Path(where).glob("rank-*.txt"))) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def relayed_refusal(refusals: str | Path) -> str:
    """The refusal the lowest rank wrote into ``refusals`` ("" when none refused)."""
    found = sorted(Path(refusals).glob("rank-*.txt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[0].read_text() if found else ""


def join_if_launched(*, timeout_s: float = pg.DEFAULT_TIMEOUT_S) -> pg.World | None:
    """Under torchrun: join the process group (once) and return this rank's place; else None."""
    env = torchrun_env()
    if env is None:
        return None
    return pg.current() or init_from_torchrun(env, timeout_s=timeout_s)


def _spawned(fn, rank: int, world_size: int, root: str, timeout_s: float, args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch

    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 for several processes per host
    try:
        pg.init(init_method=f"file://{root}/rendezvous", rank=rank, world_size=world_size, backend="gloo",
                timeout_s=timeout_s)
        fn(rank, Path(root), *args)
    except BaseException:
        import traceback

        Path(root, f"error-rank{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # skip interpreter teardown (and destroy_process_group's barrier with a dead peer)


def spawn_local(fn, root: str | Path, *args, world_size: int = 2, timeout_s: float = 240,
                collective_timeout_s: float = 60) -> list[int]:
    """Run ``fn(rank, root, *args)`` in ``world_size`` fresh processes on this host, each inside a gloo
    group (file rendezvous in ``root``, loopback, one torch thread); return their exit codes.

    ``fn`` must be importable (spawn pickles it by name). A rank that raises writes its traceback
    to ``root/error-rank{r}.txt`` (:func:`spawn_errors`) and exits 1; ranks still running after
    ``timeout_s`` are killed. Used by ``plan --calibrate`` on several CPU devices, the benchmarks
    and the distributed tests."""
    import multiprocessing

    gate.check_process_count("world_size", world_size)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_spawned, args=(fn, r, world_size, str(root), collective_timeout_s, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def spawn_errors(root: str | Path) -> str:
    """The tracebacks :func:`spawn_local`'s ranks left in ``root``, in rank order ('' if none)."""
    return "\n".join(p.read_text() for p in sorted(Path(root).glob("error-rank*.txt")))
