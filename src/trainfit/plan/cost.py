"""Predicted per-device memory and step time of one candidate (pure: no torch).

Memory comes from a :class:`Basis` -- the model's parts for one (precision, checkpointing)
pair on one device, from the memory estimator or from the shape -- scaled analytically:

    model state   params, grads, optimizer: divided by the data-parallel degree n where the
                  strategy shards them (its vocabulary row's ``shards``), plus what the strategy keeps
                  unsharded (DDP's gradient buckets, FSDP's gathered compute copies)
    activations   fixed + per_sample x micro_batch        (linear in the micro-batch)
    temporaries   fixed + per_sample x micro_batch        (live at the peak besides the above)
    peak          max(backward peak, optimizer-step peak)

Step time, two clocks:

- op by op (``Links.clock`` set: a device row with the model's shape; ``plan.clock``): every weight GEMM at a
  shape- and dtype-dependent rate, the attention kernel as it runs, the memory-bound ops at HBM speed, the
  optimizer step, kernel fixed costs, and each strategy's communication with the overlap it really gets;
- by FLOPs (no clock: this CPU, calibrated): hardware FLOPs (recompute included) / achievable FLOP/s +
  per-micro-batch overhead + communication not hidden behind backward (ring model of ``plan.comm``: bytes /
  bandwidth plus, per collective call the strategy really issues, its ring steps x latency).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from trainfit.plan import comm
from trainfit.plan.clock import (
    Clock,
    behind,
    optimizer_seconds,
    overlapped,
    ring_seconds,
    weight_cast_seconds,
)
from trainfit.plan.offload import offload_price
from trainfit.vocabulary import (
    PRECISIONS,
    GradSync,
    PrecisionName,
    StrategyFacts,
    precision_facts,
    strategy_facts,
)


@dataclass(frozen=True, kw_only=True)
class Basis:
    """The model's memory and FLOPs for one (precision, checkpointing) pair on one device."""

    precision: str
    checkpointing: str
    n_params: int
    n_blocks: int
    params_bytes: float
    """Parameters as stored on one unsharded device."""
    grads_bytes: float
    """All gradients (what the optimizer step holds)."""
    grads_at_peak_bytes: float
    """Gradients live at the backward peak of a one-micro-batch step (with accumulation all of them are)."""
    optimizer_bytes: float
    """Optimizer state including fp32 master weights."""
    compute_bytes_per_param: float
    """Bytes of a parameter as computed with (FSDP's gathered copy): 2 for half compute, 4 for fp32."""
    act_fixed_bytes: float
    act_per_sample_bytes: float
    temp_fixed_bytes: float
    """Transient bytes at the backward peak besides activations (batch, logits, their gradients)."""
    temp_per_sample_bytes: float
    step_temp_bytes: float
    """Transient bytes during the optimizer step (e.g. fp32 master gradients, foreach buffers)."""
    model_flops_per_sample: float
    """Forward + backward FLOPs of one sample, recompute excluded."""
    hardware_flops_per_sample: float
    """As executed: recompute included."""
    acc_extra_fixed_bytes: float | None = None
    acc_extra_per_sample_bytes: float | None = None
    """When known (from reports at accumulation 2): the forward/backward peak minus the whole model state,
    as fixed + per-sample, for windows of several micro-batches -- where the peak can move (e.g. under
    checkpointing) once the previous micro-batches' gradients are live. None: activations + temporaries."""
    grad_comm_bytes: float
    """Gradient bytes as reduced (fp32 reduce dtype)."""
    param_comm_bytes: float
    """Parameter bytes as gathered (compute dtype)."""
    source: str
    n_trainable: int = 0
    """Parameters that train (get gradients and optimizer state; ``--freeze``/``--lora``); 0: all ``n_params``."""
    n_param_tensors: int = 0
    """Trainable parameter tensors (zero1 broadcasts each per step); 0 when unknown (then not costed)."""
    max_unit_params: float = 0.0
    """Parameters of the largest FSDP unit (a block, or the root: what is outside the blocks);
    0 when unknown (then the mean, n_params / n_blocks)."""
    full_recompute_flops_per_sample: float = 0.0
    """FLOPs full checkpointing would recompute per sample, counted in a trace without checkpointing (the
    planner bounds a fully checkpointed row's step with it before tracing that pair); 0 when not counted."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    precision: str
    micro_batch: int
    accumulation: int
    checkpointing: str
    strategy: str
    grad_sync: str
    n: int
    """Data-parallel degree (devices)."""
    compile: bool = False
    """``torch.compile`` per block (``levers/compile.py``): compute priced at ``Links.compile_speedup``."""
    offload: str = ""
    """``--offload`` parts, comma-separated and sorted ("" none): what rests in host memory
    (``levers/offload.py``; the settings each strategy runs: ``plan.offload.offload_choices``)."""


@dataclass(frozen=True, kw_only=True)
class Memory:
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    temporaries_bytes: float
    peak_bytes: float
    offloaded_activation_bytes: float = 0.0
    """Activations saved for backward per micro-batch that ``--offload activations`` keeps in host memory."""

    def parts(self) -> dict[str, float]:
        return {"params": self.params_bytes, "grads": self.grads_bytes, "optimizer": self.optimizer_bytes,
                "activations": self.activations_bytes, "temporaries": self.temporaries_bytes}


class _ModelState(NamedTuple):
    """Per-device bytes of the model state: at the backward peak (``params``, ``grads``, ``optimizer``) and
    what the optimizer step holds besides them (``step_grads``, ``step_temp``)."""

    params: float
    grads: float
    step_grads: float
    optimizer: float
    step_temp: float


def memory(b: Basis, c: Candidate, *, act_basis: Basis | None = None) -> Memory:
    """Per-device bytes of candidate ``c`` from basis ``b``.

    ``act_basis``: where activations and temporaries come from when the strategy computes in
    another way than the precision alone would (see :func:`activation_precision`); default ``b``.
    """
    facts = strategy_facts(c.strategy)
    a = act_basis or b
    window_fix = _window_fix(b, c, a)
    state = _model_state(b, c, facts, window_fix)
    act, temp = _activations_and_temporaries(a, c)
    offloaded_act = 0.0
    parts = set(c.offload.split(",")) - {""}
    if "optimizer" in parts:
        state = _optimizer_offloaded(b, c, facts, state, window_fix)
    if "activations" in parts:  # saved for backward in host memory, brought back one op at a time in backward
        # (fp32 without checkpointing only: plan.rules says why)
        offloaded_act, act = act, 0.0
    peak = max(state.params + state.grads + state.optimizer + act + temp,
               state.params + state.step_grads + state.optimizer + state.step_temp)
    return Memory(params_bytes=state.params, grads_bytes=state.grads, optimizer_bytes=state.optimizer,
                  activations_bytes=act, temporaries_bytes=temp, peak_bytes=peak,
                  offloaded_activation_bytes=offloaded_act)


def _unit_compute_bytes(b: Basis) -> float:
    """Bytes of the largest FSDP unit as computed with (its gathered copy); the mean unit where not known."""
    unit_params = b.max_unit_params or b.n_params / max(b.n_blocks, 1)
    return unit_params * b.compute_bytes_per_param


def _window_fix(b: Basis, c: Candidate, a: Basis) -> float:
    """Half-precision gradient bytes a window of several micro-batches adds back in backward (0 elsewhere).

    A traced basis fits a window of several micro-batches as its forward/backward peak less the whole model
    state, the gradients counted at their largest: the optimizer step's, where a *-true precision also holds
    fp32 master gradients that backward never does. FSDP2 runs *-mixed on the *-true activation basis ``a``, so
    that window comes out short by the half-precision gradients, which are added back here, in backward only.
    (On 2 and 4 gloo ranks what a window's second micro-batch adds is then exactly what was measured: the
    sharded fp32 gradients per micro-batch sync, the whole ones deferred -- benchmarks/results/
    fsdp_accumulation_grads.md. The analytic basis fits no window; the optimizer step holds the sharded
    gradients only. An earlier version added these bytes to the step too, as whole half gradients FSDP2 was
    taken to hold: n_params x 2 per device, 131 GiB for a 70B model, so no half precision fitted one.)"""
    return ((b.n_trainable or b.n_params) * b.compute_bytes_per_param
            if c.accumulation > 1 and b.compute_bytes_per_param < 4 and a.acc_extra_per_sample_bytes is not None
            else 0.0)


def _per_device_grads(b: Basis, c: Candidate, facts: StrategyFacts, whole: float, extra: float = 0.0) -> float:
    """Gradient bytes one device holds of ``whole`` (plus ``extra``) under ``c``'s strategy (``facts``: its row)
    and gradient sync."""
    if facts.distributed and not facts.fsdp:
        return whole + b.grads_bytes  # DDP's flat buckets: a whole second copy, allocated up front
    if "grads" not in facts.shards:
        return whole
    if c.accumulation > 1 and c.grad_sync == GradSync.DEFERRED:
        return whole + extra  # deferred sync keeps whole, unsharded gradients across the window
    return whole / c.n + extra


def _model_state(b: Basis, c: Candidate, facts: StrategyFacts, window_fix: float) -> _ModelState:
    """Parameters, gradients, optimizer state and the step's temporaries on one device, sharded per the
    strategy (``facts``: its vocabulary row; its ``shards``), everything resident on the device."""
    n = c.n
    params, opt = b.params_bytes, b.optimizer_bytes
    if "optimizer" in facts.shards:
        opt /= n
    # With one micro-batch only the gradients produced so far are live at the backward peak.
    grads = _per_device_grads(b, c, facts, b.grads_bytes if c.accumulation > 1 else b.grads_at_peak_bytes,
                              window_fix)
    step_grads = _per_device_grads(b, c, facts, b.grads_bytes)
    if facts.fsdp and not facts.reshard_after_forward:
        params = params / n + b.n_params * b.compute_bytes_per_param  # gathered compute copy stays whole
    if facts.fsdp and facts.reshard_after_forward:
        # The peak is where activations peak: the loss at the end of forward / the start of backward.
        # There FSDP2 (reshard_after_forward=True) has freed every forward unit and re-gathers at most
        # one (the root for the head's backward, or the last block) -- measured on 2 gloo ranks for GPT
        # and Llama: the shard plus 0 to 1 unit (benchmarks/results/planner_accuracy_dist*.md); the
        # planner takes the largest unit, the side that never under-predicts by more than the gap.
        params = params / n + _unit_compute_bytes(b)
    # The optimizer step's temporaries follow the tensors it steps: a rank of a strategy that shards the state
    # steps 1/n of them (foreach, the CUDA default, holds temporaries for all of them at once).
    step_temp = b.step_temp_bytes / n if "optimizer" in facts.shards else b.step_temp_bytes
    return _ModelState(params=params, grads=grads, step_grads=step_grads, optimizer=opt, step_temp=step_temp)


def _activations_and_temporaries(a: Basis, c: Candidate) -> tuple[float, float]:
    """(activations, temporaries) at the backward peak of one micro-batch of ``c``, from basis ``a``; a window of
    several micro-batches takes its temporaries from the accumulation fit where ``a`` has one."""
    act = a.act_fixed_bytes + a.act_per_sample_bytes * c.micro_batch
    temp = a.temp_fixed_bytes + a.temp_per_sample_bytes * c.micro_batch
    if c.accumulation > 1 and a.acc_extra_per_sample_bytes is not None:
        temp = a.acc_extra_fixed_bytes + a.acc_extra_per_sample_bytes * c.micro_batch - act
    return act, temp


def _optimizer_offloaded(b: Basis, c: Candidate, facts: StrategyFacts, state: _ModelState,
                         window_fix: float) -> _ModelState:
    """``state`` under ``--offload optimizer`` (``facts``: the strategy's row).

    The optimizer state (and any fp32 master) rests in host memory and the step runs there: none of it,
    nor the step's temporaries, on the device. FSDP2's CPUOffloadPolicy also keeps the sharded parameters
    and their sharded gradients on the host: the device holds what it gathers (zero2 the whole compute
    copy through backward, zero3 one unit at a time) and the unsharded gradients a deferred window
    accumulates across its micro-batches."""
    off = state._replace(optimizer=0.0, step_temp=0.0)
    if not facts.fsdp:
        return off
    params = _unit_compute_bytes(b) if facts.reshard_after_forward else b.n_params * b.compute_bytes_per_param
    deferred = c.accumulation > 1 and c.grad_sync == GradSync.DEFERRED
    # the whole gradients a deferred window accumulates stay on the device (and the window's fix, above)
    return off._replace(params=params, grads=(b.grads_bytes if deferred else 0.0) + window_fix,
                        step_grads=b.grads_bytes if deferred else 0.0)


def activation_precision(strategy: str, precision: str) -> str:
    """The precision whose activations a strategy's run saves.

    FSDP2 (zero2/zero3) runs ``*-mixed`` through its MixedPrecisionPolicy: parameters are cast to
    the half dtype and the model runs without autocast, so it saves what a ``*-true`` model saves
    (no fp32 residual stream, no autocast copies) -- measured on 2 gloo ranks, see
    benchmarks/results/planner_accuracy_dist.md.
    """
    p = precision_facts(precision)
    if strategy_facts(strategy).fsdp and p.autocast:
        return next(q.name for q in PRECISIONS.values() if q.master_copy and q.compute == p.compute)
    return precision


@dataclass(frozen=True, kw_only=True)
class Links:
    """What the devices compute and send at (per device)."""

    flops_per_s: float
    """Achievable FLOP/s for the candidate's compute dtype."""
    bandwidth_bytes_per_s: float
    """Per-device ring bandwidth (the slowest hop: inter-node when the ring spans nodes)."""
    latency_s: float = 0.0
    """Per ring step of every collective call (a call costs its ring steps x this, plus bytes / bandwidth)."""
    overlap: float = 0.0
    """Fraction of backward time that can hide communication."""
    overhead_per_micro_batch_s: float = 0.0
    """Fixed cost per forward+backward (launches, Python), measured or 0."""
    per_step_s: float = 0.0
    """Fixed cost per optimizer step (the update, zeroing), measured or 0."""
    host_bytes_per_s: float | None = None
    """One-direction device-host bandwidth (the device row's datasheet link, or ``measure_host_copy`` on this
    CPU under ``--calibrate``): offload's copies are priced at it; None: offload is not priced, so not searched."""
    compile_speedup: float = 1.0
    """Eager step / compiled step, measured (``--compile-speedup measure`` on CPU) or given by the user; a
    compiled candidate's compute (FLOPs and the per-step and per-micro-batch costs, not the communication)
    is divided by it. 1.0: no speed-up known."""
    dist_overhead: tuple[tuple[str, str, float, float], ...] = ()
    """``(strategy, grad_sync, per_step_s, per_micro_batch_s)`` rows: time a multi-device step spends
    beyond the compute and the modelled communication, fitted to measured steps of that strategy
    (``plan.sources.fit_dist_overhead``). On CPU/gloo it is FSDP2's per-unit CPU work (DTensor
    bookkeeping, copy-in/out, hooks) and each collective's wait for its peer; empty elsewhere."""
    clock: Clock | None = None
    """The op-level clock (``plan.clock``) of this pair on a device with a table row; None: priced by FLOPs at
    ``flops_per_s`` (the CPU's calibrated rate)."""

    def dist_overhead_s(self, strategy: str, grad_sync: str, accumulation: int) -> float:
        for s, sync, per_step, per_mb in self.dist_overhead:
            if s == strategy and sync == grad_sync:
                return max(0.0, per_step + per_mb * accumulation)
        return 0.0


@dataclass(frozen=True, kw_only=True)
class Time:
    compute_s: float
    recompute_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    scaling_efficiency: float
    """compute / step: the share of the step the devices spend computing (1 = perfect scaling)."""
    overhead_s: float = 0.0
    """Measured distributed overhead beyond compute and modelled communication (Links.dist_overhead)."""
    offload_s: float = 0.0
    """The host copies of ``--offload`` (:func:`offload_seconds`), not overlapped with compute."""
    matmul_s: float = 0.0
    """Of ``compute_s``: compute-bound kernels (weight GEMMs, attention), recompute excluded."""
    memory_s: float = 0.0
    """Of ``compute_s``: memory-bound kernels (norms, activations, casts, loss, optimizer step), recompute excluded."""
    fixed_s: float = 0.0
    """Of ``compute_s``: fixed costs (kernel launches, measured per-step and per-micro-batch overheads)."""

    def parts(self) -> dict[str, float]:
        """The step split as ``plan --explain`` prints it (sums to ``step_s``)."""
        return {"compute_bound_s": self.matmul_s, "memory_bound_s": self.memory_s, "recompute_s": self.recompute_s,
                "exposed_comm_s": self.exposed_comm_s, "fixed_s": self.fixed_s,
                "dist_overhead_s": self.overhead_s, "offload_s": self.offload_s}


BACKWARD_SHARE = 2 / 3
"""Backward is ~2/3 of forward+backward FLOPs (two matmuls per forward matmul)."""


def offload_seconds(b: Basis, c: Candidate, links: Links, *, activation_bytes: float = 0.0) -> float:
    """Seconds per step of ``c.offload``'s host copies (``plan.offload``: down and up summed, not overlapped
    with compute -- an upper bound); 0 without offload. ``activation_bytes``: saved per micro-batch."""
    if not c.offload:
        return 0.0
    facts = precision_facts(c.precision)
    weight, _, master, _ = facts.bytes_per_param
    price = offload_price(parts=set(c.offload.split(",")), strategy=c.strategy, n_params=b.n_trainable or b.n_params,
                          world_size=c.n, accumulation=c.accumulation, weight_bytes=weight,
                          master_bytes_per_param=master,  # the optimizer state stays put: no copies
                          activation_bytes_per_micro_batch=int(activation_bytes), grad_sync=c.grad_sync,
                          host_bytes_per_s=links.host_bytes_per_s)
    if price.seconds_per_step is None:
        raise ValueError(f"offload {c.offload!r} is priced at the host link, and these links have none")
    return price.seconds_per_step


def step_time(b: Basis, c: Candidate, links: Links, *, offloaded_activation_bytes: float = 0.0) -> Time:
    if links.clock is not None:
        return clocked_step_time(b, c, links, offloaded_activation_bytes=offloaded_activation_bytes)
    samples = c.micro_batch * c.accumulation
    compute = (b.hardware_flops_per_sample * samples / links.flops_per_s
               + c.accumulation * links.overhead_per_micro_batch_s + links.per_step_s)
    recompute = (b.hardware_flops_per_sample - b.model_flops_per_sample) * samples / links.flops_per_s
    if c.compile:  # the kernels and launches compile changes; the communication stays as it was
        compute, recompute = compute / links.compile_speedup, recompute / links.compile_speedup
    comm_s = small_s = overhead = 0.0
    if c.n > 1 and c.strategy in comm.DISTRIBUTED:
        overhead = links.dist_overhead_s(c.strategy, c.grad_sync, c.accumulation)
        per_mb = c.grad_sync == "per-micro-batch"
        # The real calls (per DDP bucket, per FSDP unit = each block + the root, per parameter under
        # ZeroRedundancyOptimizer), each paying its ring steps of latency; grad clipping assumed on
        # (the config default), loss scaling under fp16.
        calls = comm.collective_calls(c.strategy, grad_bytes=b.grad_comm_bytes, n_param_tensors=b.n_param_tensors,
                                      fsdp_units=b.n_blocks + 1, accumulation=c.accumulation, per_micro_batch=per_mb,
                                      loss_scaling=c.precision.startswith("fp16"))
        comm_s = comm.comm_seconds(c.strategy, n=c.n, grad_bytes=b.grad_comm_bytes, param_bytes=b.param_comm_bytes,
                                   bandwidth_bytes_per_s=links.bandwidth_bytes_per_s, latency_s=links.latency_s,
                                   accumulation=c.accumulation, per_micro_batch=per_mb, calls=calls)
        # The engine's small all-reduces (token count, loss, norm, overflow) block the step: never hidden.
        small_s = 2 * (c.n - 1) * calls.small_all_reduce * links.latency_s
    exposed = max(0.0, comm_s - links.overlap * BACKWARD_SHARE * compute) + small_s
    comm_s += small_s
    offload = offload_seconds(b, c, links, activation_bytes=offloaded_activation_bytes)
    step = compute + exposed + overhead + offload
    fixed = c.accumulation * links.overhead_per_micro_batch_s + links.per_step_s
    if c.compile:
        fixed /= links.compile_speedup
    return Time(compute_s=compute, recompute_s=recompute, comm_s=comm_s, exposed_comm_s=exposed, step_s=step,
                scaling_efficiency=compute / step if step > 0 else 1.0, overhead_s=overhead, offload_s=offload,
                matmul_s=compute - recompute - fixed, fixed_s=fixed)


def recompute_share(b: Basis) -> float:
    """What checkpointing reruns, as a share of one forward: recompute FLOPs / forward FLOPs (a third of the
    forward + backward the basis counts)."""
    forward = b.model_flops_per_sample / 3
    return max(0.0, b.hardware_flops_per_sample - b.model_flops_per_sample) / forward if forward > 0 else 0.0


def clocked_step_time(b: Basis, c: Candidate, links: Links, *, offloaded_activation_bytes: float = 0.0) -> Time:
    """Step time op by op (``plan.clock``): micro-batches x (GEMMs + attention + memory-bound ops + kernel
    fixed costs), recompute as its share of the forward, the optimizer step over the parameters this device
    steps, and the communication each strategy leaves exposed."""
    clock = links.clock
    dev = clock.device
    mb = clock.micro_batch(c.micro_batch)
    acc = c.accumulation
    facts = strategy_facts(c.strategy)
    stepped = (b.n_trainable or b.n_params) / (c.n if facts.distributed and "optimizer" in facts.shards else 1)
    opt = optimizer_seconds(stepped, dev, tensors=b.n_param_tensors)
    share = recompute_share(b)
    matmul = acc * (mb.matmul_s + mb.attention_s)
    mem = acc * mb.memory_s + opt
    if precision_facts(c.precision).autocast:  # fp32 weights cast each micro-batch (FSDP2: the shard, pre-gather)
        mem += acc * weight_cast_seconds(b.n_params / (c.n if facts.fsdp else 1), dev)
    recompute = acc * share * mb.forward_s
    fixed = acc * (mb.fixed_s + links.overhead_per_micro_batch_s) + links.per_step_s
    # an eager step does not run its kernels back to back (DeviceClock.eager_share)
    matmul, mem, recompute = (x / dev.eager_share for x in (matmul, mem, recompute))
    if c.compile:  # the kernels and launches compile changes; the communication stays as it was
        matmul, mem, recompute, fixed = (x / links.compile_speedup for x in (matmul, mem, recompute, fixed))
    compute = matmul + mem + recompute + fixed
    comm_s = exposed = overhead = 0.0
    if c.n > 1 and c.strategy in comm.DISTRIBUTED:
        overhead = links.dist_overhead_s(c.strategy, c.grad_sync, c.accumulation)
        comm_s, exposed = _clocked_comm(b, c, links, forward_s=mb.forward_s / dev.eager_share,
                                        backward_s=(mb.total_s - mb.forward_s + share * mb.forward_s) / dev.eager_share)
    offload = offload_seconds(b, c, links, activation_bytes=offloaded_activation_bytes)
    step = compute + exposed + overhead + offload
    return Time(compute_s=compute, recompute_s=recompute, comm_s=comm_s, exposed_comm_s=exposed, step_s=step,
                scaling_efficiency=compute / step if step > 0 else 1.0, overhead_s=overhead, offload_s=offload,
                matmul_s=matmul, memory_s=mem, fixed_s=fixed)


def _clocked_comm(b: Basis, c: Candidate, links: Links, *, forward_s: float, backward_s: float) -> tuple[float, float]:
    """(all communication, the part left exposed) of one step, per the strategy's real overlap.

    FSDP2 (zero2/zero3): every micro-batch all-gathers each unit (the blocks and the root) in forward, unit i's
    gather prefetched behind unit i-1's compute (the first exposed); zero3 gathers again in backward; each
    unit's reduce-scatter (in the micro-batches that sync) runs behind the next unit's backward, the last
    exposed. DDP and zero1: bucketed all-reduces behind the last micro-batch's backward, the last bucket
    exposed; zero1 then broadcasts the updated parameters, exposed. The small all-reduces (token count, loss,
    clip norm, overflow flag) block the step."""
    n, dev = c.n, links.clock.device
    ring = dict(bandwidth_bytes_per_s=links.bandwidth_bytes_per_s, bus_share=dev.bus_share, latency_s=links.latency_s)
    facts = strategy_facts(c.strategy)
    per_mb = c.grad_sync == GradSync.PER_MICRO_BATCH
    calls = comm.collective_calls(c.strategy, grad_bytes=b.grad_comm_bytes, n_param_tensors=b.n_param_tensors,
                                  fsdp_units=b.n_blocks + 1, accumulation=c.accumulation, per_micro_batch=per_mb,
                                  loss_scaling=c.precision.startswith("fp16"))
    small = 2 * (n - 1) * calls.small_all_reduce * links.latency_s
    acc = c.accumulation
    if facts.fsdp:
        units = b.n_blocks + 1
        ag = ring_seconds(b.param_comm_bytes / units, n, **ring)
        rs = ring_seconds(b.grad_comm_bytes / units, n, **ring)
        again = ag if facts.reshard_after_forward else 0.0
        syncs = acc if per_mb else 1
        fwd, bwd = forward_s / units, backward_s / units
        exposed = (acc * overlapped(ag, fwd, units) + syncs * overlapped(again + rs, bwd, units)
                   + (acc - syncs) * overlapped(again, bwd, units))
        total = units * (acc * (ag + again) + syncs * rs)
        return total + small, exposed + small
    buckets = comm.ddp_buckets(b.grad_comm_bytes)
    ar = (ring_seconds(b.grad_comm_bytes, n, all_reduce=True, **ring)
          + (buckets - 1) * 2 * (n - 1) * links.latency_s)
    last = ring_seconds(min(b.grad_comm_bytes, comm.DDP_BUCKET_BYTES), n, all_reduce=True, **ring)
    exposed = last + behind(ar - last, backward_s)  # the buckets before the last run beside backward, slowing it
    total = ar
    if facts.shards_optimizer_by_parameter:  # ZeroRedundancyOptimizer: each rank broadcasts its updated share
        bcast = ring_seconds(b.params_bytes, n, **ring) + max(0, b.n_param_tensors - 1) * (n - 1) * links.latency_s
        exposed += bcast
        total += bcast
    return total + small, exposed + small


def _per_step_only(strategy: str) -> bool:
    """DDP-based strategies: their deferred-sync overhead :func:`fit_dist_overhead` fits per step only."""
    return not strategy_facts(strategy).fsdp


def fit_dist_overhead(b: Basis, links: Links, *, n: int, measured: dict[tuple[str, str, int, int], float],
                      precision: str = PrecisionName.FP32) -> tuple[tuple[str, str, float, float], ...]:
    """``Links.dist_overhead`` rows from measured multi-device steps.

    ``measured`` maps ``(strategy, grad_sync, micro_batch, accumulation)`` to a measured step (s) on
    ``n`` devices; for each (strategy, grad_sync) two accumulations or more at one micro-batch.
    The residual (measured minus this model's step without the term) is fitted as
    ``per_step + per_micro_batch x accumulation`` by least squares over the accumulations -- for
    FSDP2 (zero2/zero3), which gathers every unit again in every micro-batch. DDP and zero1 with
    deferred sync do nothing distributed before the last micro-batch (``no_sync``), so their
    overhead is fitted per step only (the mean residual): a free slope there fits noise (measured
    fits gave -1 to -3 ms per micro-batch) and extrapolates it to larger accumulations."""
    groups: dict[tuple[str, str], dict[int, tuple[int, float]]] = {}
    for (s, sync, mb, acc), t in measured.items():
        c = Candidate(precision=precision, micro_batch=mb, accumulation=acc, checkpointing="none", strategy=s,
                      grad_sync=sync, n=n)
        residual = t - step_time(b, c, dataclasses.replace(links, dist_overhead=())).step_s
        groups.setdefault((s, sync), {})[acc] = (mb, residual)
    rows = []
    for (s, sync), by_acc in sorted(groups.items()):
        if len(by_acc) < 2:
            raise ValueError(f"{s}/{sync}: need steps at two accumulations or more, got {sorted(by_acc)}")
        # least squares of residual = per_step + per_mb x accumulation over the measured points
        xs = sorted(by_acc)
        ys = [by_acc[a][1] for a in xs]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        if _per_step_only(s) and sync == GradSync.DEFERRED:
            rows.append((s, sync, my, 0.0))
            continue
        per_mb = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        rows.append((s, sync, my - per_mb * mx, per_mb))
    return tuple(rows)
