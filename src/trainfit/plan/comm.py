"""Communication cost model for data-parallel strategies (pure: no torch).

How many bytes each device sends per optimizer step under each strategy, and what that
does to step time, speed-up and efficiency on ``n`` devices. Each strategy is one row of
the vocabulary's strategy row (its collectives, formula and source). Used by ``trainfit profile`` (scale-out advice)
and by the planner.

Model (weak scaling: every device keeps its micro-batch, the global batch grows with n)::

    comm_s(n)    = sum over the step's collectives of  steps(n) * latency_s + bytes(n) / bandwidth
    exposed_s(n) = max(0, comm_s(n) - overlap * backward_s)      # part hidden behind backward
                   + small_all_reduces * 2(n-1) * latency_s      # token count, loss, overflow flag
    step_s(n)    = compute_s + straggler_s(n) + exposed_s(n)      # compute_s: the 1-device step
    straggler_s  = slowest_of(1-device step samples, n) - compute_s   # a synchronous step waits for the slowest
    speedup(n)   = n * compute_s / step_s(n)                      # samples/s relative to 1 device
    efficiency   = speedup(n) / n

The collectives are counted as the libraries issue them (:func:`collective_calls`): one
all-reduce per DDP bucket, one broadcast per parameter under ZeroRedundancyOptimizer, one
all-gather / reduce-scatter per FSDP2 unit and micro-batch; each call pays its ring steps of
latency. Without ``calls``, one call per collective of the strategy's row (the textbook volume).

A ring collective over n devices runs n-1 steps, each moving 1/n of the buffer per device
(Patarasuk & Yuan 2009): reduce-scatter and all-gather send (n-1)/n x B bytes each, an
all-reduce (= reduce-scatter + all-gather) sends 2(n-1)/n x B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainfit.vocabulary import distributed_strategies, strategy_facts


def __getattr__(name: str):
    # DISTRIBUTED: the strategies the comm model prices (the single-device one sends nothing), read from the
    # table when asked for, so a row registered after import is priced too
    if name == "DISTRIBUTED":
        return distributed_strategies()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def ring_bandwidth(*, intra: float | None, inter: float | None, nodes: int, per_node: int,
                   channel_per_nic: bool) -> float | None:
    """Bytes/s per device of a ring collective: ``intra`` (the device's link inside a node) when the ring stays in
    one node; spanning nodes, its slowest hop.

    ``inter`` is each device's share of its node's network. With ``channel_per_nic`` (NCCL on GPU nodes), NCCL
    runs one ring channel per NIC: each channel crosses a node boundary at its own NIC and carries 1/channels of the
    buffer, so the node's NICs together (``inter x per_node``) carry what one device's share of the ring sends, and
    the hop is ``min(intra, inter x per_node)``. Measured figures agree: NVIDIA/nccl-tests issues 100, 119 and 175
    (8 A100s and four 200 Gb/s NICs per node) report 85-96 GB/s of all-reduce bus bandwidth across nodes, against
    the four NICs' 100 GB/s together (one NIC's 25 GB/s would cap it far lower). Without it (gloo on CPUs: one
    ring, one TCP stream per hop), the hop is ``inter``.
    """
    if nodes <= 1:
        return intra
    if not inter or not channel_per_nic:
        return inter
    return min(intra, inter * per_node) if intra else inter * per_node


def _ring_factor(op: str, n: int) -> float:
    return (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n


def _ring_steps(op: str, n: int) -> int:
    return (2 if op == "all_reduce" else 1) * (n - 1)


def _check(n: int, grad_bytes: float, param_bytes: float, accumulation: int, strategy: str) -> None:
    if strategy not in (known := distributed_strategies()):
        raise ValueError(f"strategy={strategy!r} is not modelled; choose one of: {', '.join(known)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} is not valid; allowed: an integer >= 1 (devices)")
    if grad_bytes < 0 or param_bytes < 0:
        raise ValueError(f"grad_bytes={grad_bytes}, param_bytes={param_bytes}: sizes must be >= 0")
    if accumulation < 1:
        raise ValueError(f"accumulation={accumulation!r} is not valid; allowed: an integer >= 1")


def _times(c, accumulation: int, per_micro_batch: bool) -> int:
    if c.times == "per_micro_batch":
        return accumulation
    # ZeRO-2/3 with per-micro-batch sync reduce-scatter gradients every micro-batch.
    return accumulation if per_micro_batch and c.of == "grads" else 1


def bytes_per_step(strategy: str, *, n: int, grad_bytes: float, param_bytes: float | None = None,
                   accumulation: int = 1, per_micro_batch: bool = False) -> float:
    """Bytes each device sends per optimizer step (0 for n = 1).

    Args:
        strategy: a distributed strategy (``distributed_strategies()``).
        n: number of devices.
        grad_bytes: bytes of all gradients as communicated (e.g. 4 x parameters for fp32 grads).
        param_bytes: bytes of all parameters as gathered (defaults to ``grad_bytes``).
        accumulation: micro-batches per optimizer step.
        per_micro_batch: ZeRO-2/3 reduce-scatter every micro-batch instead of once.
    Raises:
        ValueError: unknown strategy, n < 1, negative sizes.
    """
    param_bytes = grad_bytes if param_bytes is None else param_bytes
    _check(n, grad_bytes, param_bytes, accumulation, strategy)
    facts = strategy_facts(strategy)
    per_mb = per_micro_batch and facts.fsdp
    total = 0.0
    for c in facts.collectives:
        size = grad_bytes if c.of == "grads" else param_bytes
        total += _times(c, accumulation, per_mb) * _ring_factor(c.op, n) * size
    return total


def comm_seconds(strategy: str, *, n: int, grad_bytes: float, bandwidth_bytes_per_s: float,
                 latency_s: float = 0.0, param_bytes: float | None = None, accumulation: int = 1,
                 per_micro_batch: bool = False, calls: Calls | None = None) -> float:
    """Seconds of communication per step: ring steps x latency + bytes / bandwidth.

    ``bandwidth_bytes_per_s`` is what one device can send while receiving as much (the
    unidirectional link bandwidth of the ring's slowest hop). ``calls``: the step's real
    collective calls (:func:`collective_calls`, small all-reduces left out here); without it,
    one call per collective of the strategy's row.
    """
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r}: must be > 0")
    if latency_s < 0:
        raise ValueError(f"latency_s={latency_s!r}: must be >= 0")
    param_bytes = grad_bytes if param_bytes is None else param_bytes
    _check(n, grad_bytes, param_bytes, accumulation, strategy)
    facts = strategy_facts(strategy)
    per_mb = per_micro_batch and facts.fsdp
    if calls is not None:
        steps = calls.ring_steps(n, small=False)
    else:
        steps = sum(_times(c, accumulation, per_mb) * _ring_steps(c.op, n) for c in facts.collectives)
    sent = bytes_per_step(strategy, n=n, grad_bytes=grad_bytes, param_bytes=param_bytes,
                          accumulation=accumulation, per_micro_batch=per_micro_batch)
    return steps * latency_s + sent / bandwidth_bytes_per_s


DDP_FIRST_BUCKET_BYTES = 2**20
"""``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``: DDP caps its first gradient bucket at 1 MiB."""
DDP_BUCKET_BYTES = 25 * 2**20
"""``DistributedDataParallel(bucket_cap_mb=25)`` default: every later bucket holds up to 25 MiB."""


def ddp_buckets(grad_bytes: float) -> int:
    """All-reduces DDP issues per gradient sync: one per bucket (1 MiB first, then 25 MiB each).

    DDP fills buckets with whole tensors in reverse registration order, so a tensor that
    straddles a cap closes the bucket early; this count ignores that and is a lower bound.
    """
    if grad_bytes <= DDP_FIRST_BUCKET_BYTES:
        return 1
    return 1 + math.ceil((grad_bytes - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES)


@dataclass(frozen=True, kw_only=True)
class Calls:
    """Collective calls one optimizer step issues, by op. Each call pays its ring steps of latency.

    The byte model above treats a strategy's traffic as one collective per buffer; the real
    libraries split it into many calls (per bucket, per FSDP unit, per parameter), and on a
    small model or a slow-to-start transport (gloo on CPU) their fixed cost dominates.
    """

    all_reduce: int = 0
    """Gradient all-reduces (DDP buckets)."""
    reduce_scatter: int = 0
    all_gather: int = 0
    broadcast: int = 0
    small_all_reduce: int = 0
    """Latency-bound all-reduces of a few bytes (token count, loss, clip norm, overflow flag)."""

    def __post_init__(self) -> None:
        for k, v in self.__dict__.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{k}={v!r} is not valid; allowed: an integer >= 0 (calls per step)")

    def ring_steps(self, n: int, *, small: bool = True) -> int:
        """Latency steps of the calls on n devices: a ring all-reduce 2(n-1), reduce-scatter and
        all-gather n-1 each; a broadcast is counted as a pipelined ring too, n-1.
        ``small=False`` leaves out the small all-reduces (costed apart: never overlapped)."""
        ar = self.all_reduce + (self.small_all_reduce if small else 0)
        return 2 * (n - 1) * ar + (n - 1) * (self.reduce_scatter + self.all_gather + self.broadcast)

    def total(self) -> int:
        return self.all_reduce + self.reduce_scatter + self.all_gather + self.broadcast + self.small_all_reduce


def collective_calls(strategy: str, *, grad_bytes: float, n_param_tensors: int, fsdp_units: int,
                     accumulation: int = 1, per_micro_batch: bool = False, grad_clip: bool = True,
                     loss_scaling: bool = False) -> Calls:
    """Collective calls of one optimizer step of trainfit's strategies (read from torch 2.x sources).

    Args:
        grad_bytes: gradient bytes as reduced (sets DDP's bucket count).
        n_param_tensors: trainable parameter tensors (ZeroRedundancyOptimizer broadcasts each).
        fsdp_units: FSDP2 parameter groups: one per ``fully_shard`` call (trainfit: one per
            block + the root).
        accumulation: micro-batches per step.
        per_micro_batch: FSDP reduce-scatters after every micro-batch instead of the last only.
        grad_clip: the engine clips the global gradient norm (default config: yes).
        loss_scaling: fp16 dynamic loss scaling (an overflow-flag all-reduce per step).
    """
    if strategy not in (known := distributed_strategies()):
        raise ValueError(f"strategy={strategy!r} is not modelled; choose one of: {', '.join(known)}")
    if accumulation < 1 or n_param_tensors < 0 or fsdp_units < 0 or grad_bytes < 0:
        raise ValueError(f"accumulation={accumulation!r}, n_param_tensors={n_param_tensors!r}, "
                         f"fsdp_units={fsdp_units!r}, grad_bytes={grad_bytes!r}: need accumulation >= 1, rest >= 0")
    # engine.optimizer_step: one all-reduce of the window's token count (AccumulationWindow) and one
    # of the summed loss, every strategy; the fp16 scaler all-reduces its overflow flag (MAX).
    small = 2 + int(loss_scaling)
    facts = strategy_facts(strategy)
    if not facts.fsdp:
        # DDP: gradients all-reduced bucket by bucket in the last micro-batch's backward (no_sync
        # before it); the planner's rules allow per-micro-batch sync only for zero2/zero3. Replicated
        # gradients need no all-reduce for the clip norm (strategies/ddp.py clip_grad_norm).
        calls = Calls(all_reduce=ddp_buckets(grad_bytes), small_all_reduce=small)
        if facts.shards_optimizer_by_parameter:
            # ZeroRedundancyOptimizer.step -> _sync_params -> _broadcast_params_from_rank(r) for every
            # rank r: with parameters_as_bucket_view=False (the default, which trainfit keeps) one
            # async broadcast per parameter of r's partition, i.e. one per parameter tensor in all.
            calls = Calls(all_reduce=calls.all_reduce, broadcast=n_param_tensors, small_all_reduce=small)
        return calls
    # FSDP2 (fully_shard docstring and _fsdp_param_group.py): each parameter group is all-gathered in
    # one collective by its forward pre-hook and its gradients reduce-scattered in one collective.
    # reshard_after_backward defaults to True, so every micro-batch's forward gathers again (zero2
    # too). zero3 (reshard_after_forward=True, passed explicitly, so the root is not exempted as
    # under the auto default) frees after forward and gathers again in backward. The reduce-scatter
    # runs in every backward that syncs: the last only (set_requires_gradient_sync(False) before it)
    # or every micro-batch. Sharded gradients need one all-reduce for the global clip norm.
    gathers_per_mb = fsdp_units * (2 if facts.reshard_after_forward else 1)
    scatters = fsdp_units * (accumulation if per_micro_batch else 1)
    return Calls(all_gather=gathers_per_mb * accumulation, reduce_scatter=scatters,
                 small_all_reduce=small + int(grad_clip))


@dataclass(frozen=True, kw_only=True)
class ScalePoint:
    n: int
    """Devices."""
    comm_bytes: float
    """Bytes each device sends per step."""
    comm_s: float
    """Communication time per step."""
    exposed_comm_s: float
    """Communication not hidden behind backward."""
    straggler_s: float
    """Time waiting for the slowest device."""
    step_s: float
    """Predicted step time."""
    speedup: float
    """Throughput relative to one device."""
    efficiency: float
    """speedup / n."""
    source: str
    """Formula source of the strategy's traffic row."""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def slowest_of(samples: list[float], n: int) -> float:
    """Median of the slowest of ``n`` devices' step times, each drawn from ``samples``.

    A synchronous step waits for the slowest rank. For n independent draws from a distribution
    F, P(max <= x) = F(x)^n, so the median of the maximum is F's quantile 0.5^(1/n) (n=1: the
    median; n=2: the 71st percentile; large n: towards the slowest sample). Linear interpolation
    between the sorted samples.
    """
    if not samples:
        raise ValueError("samples: need at least one measured step time")
    xs = sorted(samples)
    pos = (len(xs) - 1) * 0.5 ** (1.0 / n)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def predict(strategy: str, *, n: int, compute_s: float, grad_bytes: float, bandwidth_bytes_per_s: float,
            latency_s: float = 0.0, backward_s: float = 0.0, overlap: float = 0.0, straggler_s: float = 0.0,
            small_all_reduces: int = 0, param_bytes: float | None = None, accumulation: int = 1,
            per_micro_batch: bool = False, calls: Calls | None = None) -> ScalePoint:
    """Predicted step time, speed-up and efficiency on ``n`` devices (weak scaling).

    Args:
        compute_s: measured 1-device step time without communication (what every device still does).
        backward_s: measured backward time, behind which communication may hide.
        overlap: fraction of ``backward_s`` that can hide communication (0 = none, pessimistic;
            DDP buckets and FSDP prefetch approach 1 on GPUs with a separate comm stream).
        straggler_s: extra time the slowest of the n devices takes over ``compute_s``
            (e.g. ``slowest_of(samples, n) - median(samples)``); 0 assumes identical steps.
        small_all_reduces: latency-bound all-reduces of a few bytes per step (token count, loss,
            overflow flag), each 2(n-1) x ``latency_s``, never hidden behind compute.
        calls: the step's real collective calls (:func:`collective_calls`), each paying its ring
            steps of latency; without it one call per collective of the strategy's row.
    """
    if not compute_s > 0:
        raise ValueError(f"compute_s={compute_s!r}: must be > 0 (a measured step time)")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap!r} is not valid; allowed: a number in [0, 1]")
    if straggler_s < 0:
        raise ValueError(f"straggler_s={straggler_s!r}: must be >= 0")
    kw = dict(grad_bytes=grad_bytes, param_bytes=param_bytes, accumulation=accumulation, per_micro_batch=per_micro_batch)
    sent = bytes_per_step(strategy, n=n, **kw)
    comm = 0.0 if n == 1 else comm_seconds(strategy, n=n, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                                           latency_s=latency_s, calls=calls, **kw)
    small = 0.0 if n == 1 else small_all_reduces * 2 * (n - 1) * latency_s
    exposed = max(0.0, comm - overlap * backward_s) + small
    comm += small
    step = compute_s + straggler_s + exposed
    speedup = n * compute_s / step
    return ScalePoint(n=n, comm_bytes=sent, comm_s=comm, exposed_comm_s=exposed, straggler_s=straggler_s,
                      step_s=step, speedup=speedup,
                      efficiency=speedup / n, source=strategy_facts(strategy).traffic_source)


def comm_dominates_beyond(strategy: str, *, max_n: int = 65536, **kw) -> int | None:
    """Smallest n >= 2 whose exposed communication exceeds the compute time, or None up to ``max_n``.

    Exposed time grows with n (the ring factor rises towards its limit, latency grows linearly),
    so a doubling search followed by bisection finds the crossover.
    """
    compute_s = kw["compute_s"]

    def dominated(n: int) -> bool:
        return predict(strategy, n=n, **kw).exposed_comm_s > compute_s

    if dominated(2):
        return 2
    lo, hi = 2, 4
    while hi <= max_n and not dominated(hi):
        lo, hi = hi, hi * 2
    if hi > max_n:
        if not dominated(max_n):
            return None
        hi = max_n
    while hi - lo > 1:  # invariant: not dominated(lo), dominated(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if dominated(mid) else (mid, hi)
    return hi
