"""Where a :class:`~trainfit.plan.cost.Basis` comes from: the model's shape, or memory reports.

``analytic_basis`` costs a transformer from its shape alone (no torch): any size, in
microseconds -- what paper-scale plans use. ``basis_from_reports`` turns two memory reports
of the same (precision, checkpointing) at two micro-batch sizes (from the memory
estimator, or measured on a small model) into a basis by fitting each part linearly in
the micro-batch. Everything else (micro-batch, accumulation, strategy, world size, gradient
sync) is scaled analytically in ``plan.cost``; precision and checkpointing change *which*
tensors are saved, so each of those pairs gets its own basis.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.plan import recompute as recompute_rules
from trainfit.plan.cost import Basis
from trainfit.plan.shapes import TransformerShape
from trainfit.plan.trainable import Trainable, full_training, saved_input_elems
from trainfit.vocabulary import (
    EveryKthBlock,
    NoCheckpointing,
    Optimizer,
    SelectiveOps,
    parse_checkpoint_policy,
    precision_facts,
)

BASIS_BATCHES = (2, 4)
"""Micro-batches a traced basis is fitted from: large enough that activations dominate the forward/backward
peak (at 1 the peak can sit at a different moment, late in backward, which a line through it misses)."""

OPTIMIZER_BYTES = {Optimizer.ADAMW: 8, Optimizer.ADAM: 8, Optimizer.SGD: 4}
"""Optimizer state bytes per parameter: Adam's two fp32 moments; SGD's momentum."""


def checkpointed_blocks(spec: str, n_layer: int) -> int:
    return len(checkpointed_indices(spec, n_layer))


def checkpointed_indices(spec: str, n_layer: int) -> frozenset[int]:
    """The blocks a policy checkpoints (``levers.checkpointing``: every:K takes blocks 0, K, 2K, ...)."""
    policy = parse_checkpoint_policy(spec)
    if isinstance(policy, NoCheckpointing):
        return frozenset()
    if isinstance(policy, EveryKthBlock):
        return frozenset(range(0, n_layer, policy.k))
    return frozenset(range(n_layer))  # full, and class:Name on a transformer: the blocks


@dataclass(frozen=True)
class _BlockSums:
    """What the blocks of a step add up to, per token: bytes they keep saved for backward, the bytes of the
    largest block recomputed in backward, and their forward, backward and recompute FLOPs."""

    kept: float
    recomputed: float
    forward: float
    backward: float
    recompute: float


def _block_sums(shape: TransformerShape, t: Trainable, *, checkpointing: str, seq_len: int, residual_bytes: int,
                compute_bytes: int) -> _BlockSums:
    """Sum the blocks of ``shape`` under ``checkpointing`` for what trains (``t``): what each saves (its residual
    stream in ``residual_bytes``, the rest in ``compute_bytes``), what checkpointing keeps and recomputes of it,
    and the FLOPs of each pass; blocks below ``t.lowest_block`` save nothing and run no backward."""
    rb, cb, d = residual_bytes, compute_bytes, shape.d_model
    resid, mm = shape.saved_elems_per_token()
    inputs = saved_input_elems(shape)
    policy = parse_checkpoint_policy(checkpointing)
    ckpt = recompute_rules.checkpointed_indices(checkpointing, shape, residual_bytes=rb, compute_bytes=cb)
    sel = recompute_rules.selective_cost(shape, seq_len) if isinstance(policy, SelectiveOps) else None
    kept = recomputed = 0  # bytes per token: saved by the blocks; the largest block recomputed in backward
    block_flops = shape.block_forward_flops_per_token(seq_len)
    fwd = bwd = recompute = 0.0  # FLOPs per token
    for i in range(shape.n_layer):
        f_i = block_flops + t.adapter_flops_per_token[i]
        fwd += f_i
        if i < t.lowest_block:
            continue  # nothing below needs a gradient: no saved tensors, no backward
        tok = resid * rb + (mm - sum(inputs[x] for x in t.frozen_inputs[i]) + t.adapter_elems[i]) * cb
        tok += t.adapter_mask_bytes[i]
        if sel is not None:  # op level: matmul and attention outputs kept, the rest rebuilt in backward
            tok_kept = d * rb + sel.kept_elems_per_token * cb + sel.kept_fp32_elems_per_token * 4
            kept += tok_kept
            recomputed = max(recomputed, tok - tok_kept)
            recompute += sel.recompute_flops_per_token
        elif i in ckpt:
            kept += d * rb  # a checkpointed block keeps only its input
            recomputed = max(recomputed, tok)
            # rerun up to its last saved tensor, the down projection's input; with --freeze or --lora that may
            # be an adapter's or an earlier input, so the whole forward is priced there (an upper bound)
            whole = bool(t.frozen_inputs[i] or t.adapter_elems[i])  # (an adapter saves at least A's r outputs)
            recompute += f_i - (0.0 if whole else shape.down_flops_per_token)
        else:
            kept += tok
        bwd += 2 * f_i - 2 * t.frozen_weight_params[i]  # input gradients, and weight gradients that train
    return _BlockSums(kept=kept, recomputed=recomputed, forward=fwd, backward=bwd, recompute=recompute)


def analytic_basis(shape: TransformerShape, *, precision: str, checkpointing: str, seq_len: int,
                   optimizer: str = "adamw", trainable: Trainable | None = None) -> Basis:
    """Memory and FLOPs of a transformer step from its shape (per sample of ``seq_len`` tokens).

    ``trainable`` (``plan.trainable``, for ``--freeze`` / ``--lora``): weights count every parameter (the
    adapters' too); gradients, optimizer state, the fp32 master copy and the gradient traffic count only the
    trainable ones; activations and FLOPs follow that module's model (frozen Linear inputs unsaved, adapters'
    inputs and r-wide outputs saved, no backward below the lowest trainable block, no weight gradient for a
    frozen weight). Default: every parameter trains.
    """
    t = trainable or full_training(shape)
    w, g, master, cb = precision_facts(precision).bytes_per_param  # (weights, grads, master, compute) bytes
    rb = 4 if w == 4 else 2  # residual stream dtype: the weights' (autocast keeps it fp32)
    n, nt, s, d, V, L = t.n_params, t.n_trainable, seq_len, shape.d_model, shape.vocab_size, shape.n_layer
    blocks = _block_sums(shape, t, checkpointing=checkpointing, seq_len=s, residual_bytes=rb, compute_bytes=cb)
    head = 2.0 * V * d + t.head_adapter_flops
    fwd = blocks.forward + head
    bwd = blocks.backward + (2 * head - 2 * t.top_frozen_weight_params)  # head: input, trained weight grads
    top_tok = d * rb + (d + t.head_adapter_elems) * cb + V * 4  # final norm in, head in, fp32 log-softmax out
    act = s * (blocks.kept + top_tok + 2 * 8)  # + int64 ids and labels
    # At the backward peak: logits and their fp32 gradient, plus one block recomputed.
    temp = s * (V * (cb + 4) + blocks.recomputed)
    largest = V * d * 4
    return Basis(
        precision=precision, checkpointing=checkpointing, n_params=n, n_blocks=L, n_trainable=nt,
        params_bytes=n * w, grads_bytes=nt * (g if not master else 4), grads_at_peak_bytes=nt * g,
        optimizer_bytes=nt * (OPTIMIZER_BYTES[optimizer] + master), compute_bytes_per_param=cb,
        act_fixed_bytes=0.0, act_per_sample_bytes=float(act), temp_fixed_bytes=0.0,
        temp_per_sample_bytes=float(temp), step_temp_bytes=2.0 * largest,
        model_flops_per_sample=(fwd + bwd) * s, hardware_flops_per_sample=(fwd + bwd + blocks.recompute) * s,
        grad_comm_bytes=nt * 4.0, param_comm_bytes=n * float(cb),
        source=f"analytic {shape.family} shape (plan.basis.analytic_basis)", n_param_tensors=t.n_trainable_tensors,
        max_unit_params=float(max(shape.block_params, shape.n_params - L * shape.block_params)),
    )


def _split_peak(r, *, most: bool = False) -> tuple[int, int, int]:
    """(activations, temporaries, gradients) at the forward/backward peak of report ``r`` (at micro-batch 1 the
    optimizer step may be the overall peak).

    ``most``: the activations are the most the window holds (every saved tensor, at the end of its forward)
    rather than those live at the peak, the temporaries the rest of the peak. For when the peak's moment moves
    between the two batches -- an MoE's backward peaks mid-backward at batch 2 and at its start at 4 -- and a line
    through the two moments' activations goes negative at batch 1 (a negative offload cost broke the ranking).
    The peak stays exact at both batches either way."""
    phase = max(("forward", "backward"), key=lambda ph: r.phases.get(ph, {}).get("peak", 0))
    parts = r.phases[phase]
    state = r.params_bytes + parts.get("grads", 0) + r.optimizer_bytes
    act = parts.get("activations", 0)
    if most:
        act = max(r.phases.get(ph, {}).get("activations", 0) for ph in ("forward", "backward"))
    return act, parts["peak"] - state - act, parts.get("grads", 0)


def basis_from_reports(r1, r2, *, model_flops_per_sample: float, hardware_flops_per_sample: float,
                       n_blocks: int, acc_reports: tuple | None = None, n_param_tensors: int = 0,
                       max_unit_params: float = 0.0) -> Basis:
    """A basis from two memory reports of the same run at micro-batches ``r1.batch < r2.batch``.

    Each of activations and temporaries at the peak is fitted as fixed + per-sample x batch;
    the gradients missing at a single micro-batch's backward peak are kept apart so that
    accumulation (where all gradients are live) adds them back. ``acc_reports``: the same two
    batches at accumulation 2, fitted separately for windows of several micro-batches.
    """
    if not r2.batch > r1.batch:
        raise ValueError(f"reports need two different batches, got {r1.batch} and {r2.batch}")

    (a1, t1, _), (a2, t2, g2) = _split_peak(r1), _split_peak(r2)
    db = r2.batch - r1.batch
    if a2 - (a2 - a1) / db * (r2.batch - 1) < 0:  # the two peaks are different moments: see _split_peak
        (a1, t1, _), (a2, t2, g2) = _split_peak(r1, most=True), _split_peak(r2, most=True)
    act_ps, temp_ps = (a2 - a1) / db, (t2 - t1) / db
    opt_phase = r2.phases.get("optimizer", {}).get("peak", 0)
    acc_fixed = acc_ps = None
    if acc_reports is not None:
        def extra(r):
            peak = max(r.phases.get(ph, {}).get("peak", 0) for ph in ("forward", "backward"))
            return peak - (r.params_bytes + r.grads_bytes + r.optimizer_bytes)

        (q1, q2) = acc_reports
        acc_ps = (extra(q2) - extra(q1)) / (q2.batch - q1.batch)
        acc_fixed = extra(q2) - acc_ps * q2.batch
    _, _, _, cb = precision_facts(r2.precision).bytes_per_param
    return Basis(
        precision=r2.precision, checkpointing=r2.checkpointing, n_params=r2.n_params, n_blocks=n_blocks,
        params_bytes=r2.params_bytes, grads_bytes=r2.grads_bytes, grads_at_peak_bytes=g2,
        optimizer_bytes=r2.optimizer_bytes, compute_bytes_per_param=cb,
        act_fixed_bytes=a2 - act_ps * r2.batch, act_per_sample_bytes=act_ps,
        temp_fixed_bytes=t2 - temp_ps * r2.batch, temp_per_sample_bytes=temp_ps,
        step_temp_bytes=max(0.0, opt_phase - (r2.params_bytes + r2.grads_bytes + r2.optimizer_bytes)),
        model_flops_per_sample=model_flops_per_sample, hardware_flops_per_sample=hardware_flops_per_sample,
        acc_extra_fixed_bytes=acc_fixed, acc_extra_per_sample_bytes=acc_ps,
        grad_comm_bytes=r2.n_params * 4.0, param_comm_bytes=r2.n_params * float(cb),
        source=f"{r2.method} memory reports at micro-batch {r1.batch} and {r2.batch}"
               + (" (and at accumulation 2)" if acc_reports else ""),
        n_param_tensors=n_param_tensors, max_unit_params=max_unit_params,
    )
