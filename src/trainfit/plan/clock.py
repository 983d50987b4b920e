"""The planner's clock: a device step priced op by op (pure: no torch).

A GPU step is not the model's FLOPs at one fixed share of the peak. It is a sequence of kernels, each
bound by one of three things, and communication that hides behind them only where the strategy lets it:

    matmul      max(FLOPs / (peak x gemm_share), bytes / HBM) + kernel_s       (roofline, Williams et al. 2009,
                                                                                 with Hockney's fixed start-up)
    attention   the fused kernel: causal FLOPs / (peak x attention_share)       (FlashAttention-2/3 papers)
                or, materialised (math), its two batched matmuls + the softmax's bytes at HBM speed
    memory      bytes moved / (HBM x hbm_share): norms, activations, residual adds, casts, the loss, the
                optimizer's update of every parameter it steps, gradient clipping, zeroing
    comm        ring collectives at link x bus_share, (n-1) latencies per call; FSDP's all-gather of unit i
                behind unit i-1's compute (the first exposed), its reduce-scatter behind the next unit's
                backward (the last exposed); DDP's buckets behind backward (the last bucket exposed); HSDP's
                cross-node all-reduce of each unit's shard behind the next units' backward (the last exposed);
                compute beside an FSDP/HSDP collective slowed by OVERLAP_SLOWDOWN (Lee et al. 2025)

The op list comes from the model's shape (:class:`ModelOps`: the same transformer the analytic memory basis
counts); recompute is priced as the share of the forward the basis says checkpointing reruns. Every
coefficient is a field of :class:`DeviceClock` with its source, printed with the plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from trainfit.plan.shapes import TransformerShape
from trainfit.vocabulary import precision_facts


@dataclass(frozen=True, kw_only=True)
class DeviceClock:
    """What one device computes and moves at (every field from a datasheet, a paper or a measurement)."""

    name: str
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per dtype (fp32, tf32, bf16, fp16): the datasheet's."""
    hbm_bytes_per_s: float
    """Datasheet memory bandwidth."""
    gemm_share: float
    """Share of the dense peak a large, well-shaped GEMM sustains."""
    attention_share: float
    """Share of the dense peak the fused (flash) attention kernel sustains, forward and backward."""
    hbm_share: float
    """Share of the datasheet bandwidth a streaming elementwise kernel reaches."""
    kernel_s: float
    """Fixed cost of one kernel (launch and ramp-up), paid by every op."""
    bus_share: float
    """Collective bus bandwidth as a share of the per-direction link bandwidth (NCCL's busBw)."""
    eager_share: float = 1.0
    """Share of the kernel-priced rate an eager PyTorch step sustains (launch gaps, hooks, the allocator,
    collectives sharing the SMs): every kernel's time is divided by it. 1.0: kernels back to back."""
    gemm_shares: dict[str, float] = field(default_factory=dict)
    """Large-GEMM share per dtype where one was measured on the device (``plan --calibrate`` on CUDA:
    ``probes.calibrate.calibrated_clock_facts``); a dtype not in it runs at ``gemm_share``."""
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        shares = [(n, getattr(self, n)) for n in ("gemm_share", "attention_share", "hbm_share", "bus_share",
                                                   "eager_share")]
        for name, v in shares + [(f"gemm_shares[{d!r}]", v) for d, v in self.gemm_shares.items()]:
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name}={v!r} is not valid; allowed: a share in (0, 1]")
        if not self.hbm_bytes_per_s > 0 or self.kernel_s < 0:
            raise ValueError(f"hbm_bytes_per_s={self.hbm_bytes_per_s!r}, kernel_s={self.kernel_s!r}: need > 0, >= 0")

    @property
    def hbm_rate(self) -> float:
        """Achievable bytes/s of a streaming kernel."""
        return self.hbm_bytes_per_s * self.hbm_share

    def gemm_rate(self, dtype: str) -> float:
        """FLOP/s of a large GEMM in ``dtype``: the dense peak at this dtype's measured share, else ``gemm_share``."""
        return self.peak_flops[dtype] * self.gemm_shares.get(dtype, self.gemm_share)


# -- the terms, one function each (tested against hand calculations in tests/plan/test_clock.py) --------------------
def gemm_seconds(m: float, n: float, k: float, *, dtype: str, elem_bytes: int, dev: DeviceClock) -> float:
    """One (m x k) @ (k x n) GEMM: the slower of its FLOPs at the large-GEMM rate and its bytes (A, B read, C
    written once) at HBM speed, plus one kernel's fixed cost. A skinny GEMM (small m, or small n and k) is
    bandwidth-bound and runs below the large-GEMM rate; a tiny one pays mostly the fixed cost."""
    flops = 2.0 * m * n * k
    moved = elem_bytes * (m * k + k * n + m * n)
    return max(flops / dev.gemm_rate(dtype), moved / dev.hbm_rate) + dev.kernel_s


def memory_seconds(nbytes: float, *, dev: DeviceClock, kernels: float = 1.0) -> float:
    """A memory-bound op (or ``kernels`` of them) moving ``nbytes`` in all: bytes / achievable HBM bandwidth."""
    return nbytes / dev.hbm_rate + kernels * dev.kernel_s


def ring_seconds(nbytes: float, n: int, *, bandwidth_bytes_per_s: float, bus_share: float, latency_s: float,
                 all_reduce: bool = False) -> float:
    """One ring collective of a ``nbytes`` buffer over ``n`` devices (Patarasuk & Yuan 2009): each device sends
    (n-1)/n of it (twice for an all-reduce) at the link's achievable bus bandwidth, one latency per ring step."""
    if n <= 1:
        return 0.0
    times = 2 if all_reduce else 1
    return times * ((n - 1) / n * nbytes / (bandwidth_bytes_per_s * bus_share) + (n - 1) * latency_s)


OVERLAP_SLOWDOWN = 0.189
"""How much slower compute kernels run while a collective runs beside them (0.189: 18.9% longer): the collective's
kernels hold SMs and draw HBM bandwidth and power the compute would have had. Lee, Oh, Kim, Go, Park and Mahajan
2025, "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning: Performance and
Power Implications" (arXiv 2507.03114), abstract: overlapping computation and communication slows the computation
by 18.9% on average (40.0% at most) against the same computation with no communication, over GPT and Llama
models on 4 A100, H100, MI250 and MI210 GPUs. One average for every device: the paper's abstract gives no
per-device figure. Why it weighs more on a faster GPU: the slowdown is paid only while a collective runs, and
from A100 to H100 the dense peak grew 3.2x but NVLink 1.5x, so a unit's collective covers about twice as much of
its compute."""


def overlapped(comm_per_unit: float, compute_per_unit: float, units: int, *,
               slowdown: float = OVERLAP_SLOWDOWN) -> float:
    """Exposed seconds of ``units`` equal collectives each prefetched behind the previous unit's compute:
    the first one waits in full; behind every later one the compute runs ``1 + slowdown`` times slower while the
    collective is in flight (:data:`OVERLAP_SLOWDOWN`). With c the collective and t the compute it hides behind:
    if c >= t (1 + s), the compute finishes under the collective and the unit waits c - t; else the compute does
    c / (1 + s) of its work during the collective and the rest at full speed, so the unit takes t + c s / (1 + s).
    Both cases: max(c - t, c s / (1 + s)) beyond t. ``slowdown=0``: perfect overlap, max(0, c - t)."""
    if units <= 0:
        return 0.0
    return comm_per_unit + (units - 1) * behind(comm_per_unit, compute_per_unit, slowdown=slowdown)


def behind(comm_s: float, compute_s: float, *, slowdown: float = OVERLAP_SLOWDOWN) -> float:
    """Seconds a collective of ``comm_s`` started with ``compute_s`` of compute beside it adds beyond that compute:
    max(c - t, c s / (1 + s)) (derived in :func:`overlapped`); 0 for no collective."""
    return max(comm_s - compute_s, comm_s * slowdown / (1.0 + slowdown), 0.0)


def hsdp_all_reduce(grad_bytes: float, *, shard_over: int, replicas: int, units: int, backward_s: float,
                    bandwidth_bytes_per_s: float, bus_share: float, latency_s: float = 0.0,
                    slowdown: float = OVERLAP_SLOWDOWN) -> tuple[float, float]:
    """(total, exposed) seconds of HSDP's cross-replica gradient all-reduce in one synced backward.

    HSDP shards within a group of ``shard_over`` devices (a node) and replicates across ``replicas`` groups
    (nodes). After each unit's reduce-scatter inside the group, every device holds its 1/``shard_over`` shard
    of that unit's gradients and all-reduces it with the devices of the same rank in the other replicas: a
    ring all-reduce of ``grad_bytes / shard_over / units`` over ``replicas`` devices on the inter-node link
    (``bandwidth_bytes_per_s`` per device at ``bus_share``). Each runs behind the backward of the units after
    it (:func:`overlapped`: the last unit's is exposed in full, the others where they outlast a unit's backward,
    ``backward_s / units``, or by the ``slowdown`` they cause the backward running beside them). One group
    (``replicas`` = 1) sends nothing."""
    if replicas <= 1 or units < 1:
        return 0.0, 0.0
    per_unit = ring_seconds(grad_bytes / shard_over / units, replicas, bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                            bus_share=bus_share, latency_s=latency_s, all_reduce=True)
    return units * per_unit, overlapped(per_unit, backward_s / units, units, slowdown=slowdown)


# -- the model's ops ---------------------------------------------------------------------------------------------
ATTENTION_KERNELS = ("flash", "efficient", "math")
FLASH_BACKWARD = 2.5
"""Flash attention's backward runs 2.5x its forward's matmul FLOPs (it recomputes QK^T and the softmax:
five matmuls to the forward's two; Dao 2023, FlashAttention-2, section 3)."""


@dataclass(frozen=True, kw_only=True)
class ModelOps:
    """The op list of one (model, precision) on one device: what the clock prices per micro-batch."""

    shape: TransformerShape
    seq_len: int
    dtype: str
    """The dtype matmuls run in (tf32 for fp32 where TF32 is on)."""
    compute_bytes: int
    """Bytes of an activation as computed (2 half, 4 fp32)."""
    residual_bytes: int
    """Bytes of the residual stream (4 under autocast: it stays fp32)."""
    attention: str = "flash"
    """The attention kernel the estimator picks on this device for this dtype (:data:`ATTENTION_KERNELS`)."""
    causal: bool = True
    """A causal mask: the flash kernel skips the masked half of QK^T and AV."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention={self.attention!r} is not valid; allowed: {', '.join(ATTENTION_KERNELS)}")

    def gemms(self) -> list[tuple[int, int, float]]:
        """(n, k, count) of the forward's weight GEMMs per block (m = tokens), then the head's (count 1)."""
        d, f, q, kv = self.shape.d_model, self.shape.d_ff, self.shape.q_dim, self.shape.kv_dim
        if self.shape.family == "gpt":
            block = [(q + 2 * kv, d, 1.0), (d, q, 1.0), (f, d, 1.0), (d, f, 1.0)]
        else:  # q, k, v; o; gate, up; down
            block = [(q, d, 1.0), (kv, d, 2.0), (d, q, 1.0), (f, d, 2.0), (d, f, 1.0)]
        return block

    def block_elementwise_bytes(self, tokens: float) -> tuple[float, float, float]:
        """(forward bytes, backward bytes, kernels) of one block's memory-bound ops for ``tokens`` tokens.

        Per token, e = compute bytes, r = residual bytes: two norms (read r.d, write e.d; backward reads the
        gradient, the input and writes the input's gradient), the MLP activation (GELU: read and write f;
        SwiGLU: read gate and up, write f), two residual adds (read 2 r.d, write r.d), the cast of the
        residual stream to the matmul dtype where it differs, Llama's rotary embedding of q and k."""
        s, e, r = self.shape, self.compute_bytes, self.residual_bytes
        d, f, q, kv = s.d_model, s.d_ff, s.q_dim, s.kv_dim
        norm_f, norm_b = (2 * x for x in norm_bytes(d, in_bytes=r, out_bytes=e))
        if s.family == "gpt":
            act_f, act_b = 2 * e * f, 3 * e * f
        else:
            act_f, act_b = 3 * e * f, 5 * e * f
        add_f, add_b = 2 * 3 * r * d, 2 * 3 * r * d
        cast = 2 * (r + e) * d if r != e else 0
        rope = 2 * 2 * e * (q + kv) if s.family != "gpt" else 0
        kernels = 2 + 1 + 2 + (2 if cast else 0) + (2 if rope else 0)
        return (tokens * (norm_f + act_f + add_f + cast + rope), tokens * (norm_b + act_b + add_b + cast + rope),
                kernels)


def norm_bytes(width: int, *, in_bytes: int, out_bytes: int) -> tuple[int, int]:
    """(forward, backward) bytes per token of one LayerNorm/RMSNorm over ``width`` features: forward reads the
    input and writes the output; backward reads the output's gradient and the input and writes the input's
    gradient (the per-token statistics and the weight are noise next to them)."""
    return width * (in_bytes + out_bytes), width * (out_bytes + 2 * in_bytes)


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """Seconds of one micro-batch's forward + backward, by what bounds them."""

    matmul_s: float
    """Weight GEMMs (forward, input and weight gradients)."""
    attention_s: float
    memory_s: float
    """Norms, activations, residual adds, casts, the loss."""
    fixed_s: float
    """Kernel fixed costs."""
    forward_s: float
    """The forward alone (what recompute reruns a share of)."""

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.attention_s + self.memory_s + self.fixed_s


def micro_batch_time(ops: ModelOps, micro_batch: int, dev: DeviceClock) -> MicroBatch:
    """Forward + backward of ``micro_batch`` samples, op by op."""
    s, e = ops.shape, ops.compute_bytes
    tokens = float(micro_batch * ops.seq_len)
    L = s.n_layer
    gemm_f = gemm_b = 0.0
    kernels = 0.0
    for n, k, count in ops.gemms():
        one = gemm_seconds(tokens, n, k, dtype=ops.dtype, elem_bytes=e, dev=dev)
        # backward: the input's gradient (tokens x k x n) and the weight's (n x k over the tokens)
        back = (gemm_seconds(tokens, k, n, dtype=ops.dtype, elem_bytes=e, dev=dev)
                + gemm_seconds(n, k, tokens, dtype=ops.dtype, elem_bytes=e, dev=dev))
        gemm_f += count * one * L
        gemm_b += count * back * L
        kernels += 3 * count * L
    head_f = gemm_seconds(tokens, s.vocab_size, s.d_model, dtype=ops.dtype, elem_bytes=e, dev=dev)
    head_b = (gemm_seconds(tokens, s.d_model, s.vocab_size, dtype=ops.dtype, elem_bytes=e, dev=dev)
              + gemm_seconds(s.vocab_size, s.d_model, tokens, dtype=ops.dtype, elem_bytes=e, dev=dev))
    attn_f, attn_b, attn_bytes_f, attn_bytes_b = _attention(ops, micro_batch, dev)
    mem_f, mem_b, k_block = ops.block_elementwise_bytes(tokens)
    # the loss: the head's logits read, fp32 log-softmax written, read back in backward and the gradient written
    V = s.vocab_size
    loss_f, loss_b = tokens * V * (e + 4), tokens * V * (4 + 2 * e)
    embed = tokens * s.d_model * (e + ops.residual_bytes) * 2  # the embedding's gather and its gradient's scatter
    memory_f = memory_seconds(L * mem_f + attn_bytes_f * L + loss_f + embed / 2, dev=dev, kernels=0)
    memory_b = memory_seconds(L * mem_b + attn_bytes_b * L + loss_b + embed / 2, dev=dev, kernels=0)
    n_kernels = kernels + L * (3 * k_block + 3) + 12  # elementwise ops fwd + bwd (x3), attention, head, loss
    fixed = n_kernels * dev.kernel_s
    forward = gemm_f + head_f + attn_f * L + memory_f
    return MicroBatch(matmul_s=gemm_f + gemm_b + head_f + head_b, attention_s=(attn_f + attn_b) * L,
                      memory_s=memory_f + memory_b, fixed_s=fixed, forward_s=forward)


def _attention(ops: ModelOps, micro_batch: int, dev: DeviceClock) -> tuple[float, float, float, float]:
    """(forward s, backward s, forward bytes, backward bytes) of one block's attention core (QK^T, softmax, AV),
    priced as the chosen kernel runs it. The bytes are the memory-bound part, priced with the other ops."""
    s, e, b = ops.shape, ops.compute_bytes, micro_batch
    seq, hd, heads = ops.seq_len, ops.shape.q_dim // ops.shape.n_head, ops.shape.n_head
    full = 4.0 * b * seq * seq * s.q_dim  # QK^T and AV over the whole square
    if ops.attention == "math":  # materialised: two batched GEMMs per head, the probabilities through HBM
        qk = heads * b * gemm_seconds(seq, seq, hd, dtype=ops.dtype, elem_bytes=e, dev=dev)
        av = heads * b * gemm_seconds(seq, hd, seq, dtype=ops.dtype, elem_bytes=e, dev=dev)
        probs = b * heads * seq * seq
        # forward: scores written, softmax reads them and writes the probabilities (+ mask); backward twice that
        return qk + av, 2 * (qk + av), probs * (e + 2 * e + e), probs * 2 * (e + 2 * e + e)
    share = dev.attention_share
    executed = full * (0.5 if ops.causal else 1.0)
    rate = dev.peak_flops[ops.dtype] * share
    fwd = executed / rate
    io = b * seq * (3 * s.q_dim) * e  # q, k, v read and the output written once (kv heads read as q's)
    return fwd, FLASH_BACKWARD * fwd, io, 2 * io


OPTIMIZER_STEP_BYTES = 4 * 7
"""AdamW's update of one fp32 parameter: read the parameter, its gradient and the two moments, write the
parameter and the moments (7 x 4 bytes; the foreach/fused kernels stream each once)."""
CLIP_BYTES = 4 * 3
"""Gradient clipping: the norm reads every gradient, the scale reads and writes it again."""
ZERO_GRAD_BYTES = 4
"""Zeroing (or freeing and refilling) the gradients: one write."""


def optimizer_seconds(n_params: float, dev: DeviceClock, *, tensors: int = 0) -> float:
    """The optimizer step of ``n_params`` parameters on one device (memory-bound) with clipping and zeroing;
    the foreach kernels batch tensors, so ``tensors`` adds one kernel per 64 of them per pass."""
    passes = 4  # clip norm, clip scale, the update, zeroing
    kernels = passes * max(1, math.ceil(tensors / 64))
    return memory_seconds(n_params * (OPTIMIZER_STEP_BYTES + CLIP_BYTES + ZERO_GRAD_BYTES), dev=dev,
                          kernels=kernels)


@dataclass(frozen=True, kw_only=True)
class Clock:
    """The op-level clock of one (precision, checkpointing) pair on one device (``Links.clock``)."""

    device: DeviceClock
    ops: ModelOps
    _seen: dict = field(default_factory=dict, compare=False, repr=False)
    """Micro-batches already priced (a search asks for the same few thousands of times)."""

    def micro_batch(self, micro_batch: int) -> MicroBatch:
        """:func:`micro_batch_time` of ``micro_batch`` samples, priced once."""
        if micro_batch not in self._seen:
            self._seen[micro_batch] = micro_batch_time(self.ops, micro_batch, self.device)
        return self._seen[micro_batch]


def model_ops(shape: TransformerShape, *, seq_len: int, precision: str) -> ModelOps:
    """The op list of ``shape`` trained under ``precision`` on a GPU: matmuls in the compute dtype, the residual
    stream in the weights' dtype (autocast keeps it fp32), and the attention kernel SDPA picks there for that
    dtype (``meters.attention``'s rules: flash for fp16/bf16, the memory-efficient kernel for fp32, priced alike
    at the fp32 rate)."""
    p = precision_facts(precision)
    w, _, _, cb = p.bytes_per_param
    return ModelOps(shape=shape, seq_len=seq_len, dtype=str(p.compute), compute_bytes=cb,
                    residual_bytes=4 if w == 4 else 2, attention="flash" if cb == 2 else "efficient")


def weight_cast_seconds(n_params: float, dev: DeviceClock) -> float:
    """Autocast's (or FSDP's mixed-precision policy's) cast of ``n_params`` fp32 weights to the half dtype, once
    per micro-batch: read 4, write 2 bytes each."""
    return memory_seconds(6.0 * n_params, dev=dev)


def clocked_links(links, device: DeviceClock, shape: TransformerShape, *, seq_len: int):
    """``links(precision, checkpointing)`` (``plan.cost.Links``) carrying the op-level clock of ``shape`` at
    ``seq_len`` tokens on ``device``: what ``plan.cost.step_time`` then prices op by op."""
    clocks: dict[str, Clock] = {}

    def with_clock(p: str, ck: str = "none"):
        if p not in clocks:
            clocks[p] = Clock(device=device, ops=model_ops(shape, seq_len=seq_len, precision=p))
        return dataclasses.replace(links(p, ck), clock=clocks[p])
    return with_clock
