"""Verify the levers: one optimizer step of the configured run against the plain reference.

The reference is written here in plain PyTorch, independent of the levers: an fp32 model
on one device, the whole global batch in one forward, ``loss_sum / count`` backward,
the same clipping and the same optimizer. The configured run is built exactly as
``trainfit train`` builds it and stepped once through :func:`trainfit.engine.optimizer_step`
on the same samples, starting from the same weights.

Reported:
  * gradient cosine similarity and relative error (``||g - g_ref|| / ||g_ref||``), the
    gradients taken right after unscaling, before clipping -- what the optimizer would use;
  * the worst per-tensor relative error of the update (``||du - du_ref|| / ||du_ref||``), judged against the
    precision's tolerance -- or, when only the update is outside it, against the noise floor measured in the
    same call (:class:`NoiseFloor`: Adam turns a 1e-7 reordering of a near-zero gradient into a per-tensor
    update difference near 1e-3, so a compiled or accumulated step can exceed the fp32 tolerance by rounding
    alone); the report's ``update_bound`` and ``update_bound_kind`` say which bound was used;
  * skipped steps (overflow), retried on the same data as training would;
  * the share of non-zero gradient values that fp16 *without* loss scaling flushes to zero.

A failure names its likely cause by testing hypotheses against the reference: gradients
still multiplied by the loss scale (a scaler never unscaled), or gradients equal to a
mean of per-micro-batch means (accumulation normalised per micro-batch).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from trainfit.config import LeversSection, ModelSection, RunConfig, RunSection
from trainfit.data import global_indices, rank_micro_batches
from trainfit.errors import ConfigError, TrainfitError
from trainfit.levers.schedule import lr_factor
from trainfit.results import VerifyReport  # the result type; also importable from here, as before
from trainfit.run import Run, build_run, make_optimizer
from trainfit.strategies import Strategy, fit_to_world, make_strategy
from trainfit.tasks.base import to_device
from trainfit.vocabulary import PrecisionName, Tolerance, precision_facts

MAX_ATTEMPTS = 16
"""Overflowing attempts tolerated (each halves the loss scale) before giving up."""


# ----------------------------------------------------------------- pure helpers

def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors]) if tensors else torch.zeros(0)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(a @ b) / (na * nb)


def rel_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    nr = float(ref.norm())
    diff = float((a - ref).norm())
    return diff / nr if nr > 0 else (0.0 if diff == 0 else math.inf)


def update_rel_error(upd: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Worst per-tensor relative error of the update."""
    return max((rel_error(u.double().reshape(-1), r.double().reshape(-1)) for u, r in zip(upd, ref)), default=0.0)


def fp16_underflow_fraction(grads: list[torch.Tensor]) -> float:
    """Share of non-zero gradient values that round to zero in fp16 (below ~2**-25)."""
    g = flat(grads)
    nz = g != 0
    n = int(nz.sum())
    return float(((g.to(torch.float16) == 0) & nz).sum()) / n if n else 0.0


def judge(*, precision: str, cos: float, grad_rel: float, upd_rel: float, stepped: bool) -> tuple[Tolerance, bool]:
    tol = precision_facts(precision).tolerance
    ok = stepped and cos >= tol.min_cosine and grad_rel <= tol.max_grad_rel_error and upd_rel <= tol.max_update_rel_error
    return tol, ok


def near_ratio(x: float, target: float, factor: float = 1.5) -> bool:
    return x > 0 and target > 0 and abs(math.log(x / target)) < math.log(factor)


# ----------------------------------------------------------------- torch shell

def _full(t: torch.Tensor) -> torch.Tensor:
    """A full local copy of a (possibly sharded DTensor) tensor. Collective when sharded."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def reference_grads(model: nn.Module, task, batches: list) -> list[torch.Tensor]:
    """fp32 gradient of ``sum(loss_sums) / sum(counts)`` over ``batches`` (no grads left behind)."""
    model.zero_grad(set_to_none=True)
    total = sum(task.count(b) for b in batches)
    for b in batches:
        loss_sum, _ = task.loss(model, b)
        (loss_sum / total).backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def mean_of_means_grads(model: nn.Module, task, micro_batches: list) -> list[torch.Tensor]:
    """Gradient a mis-normalised accumulation computes: mean over micro-batches of each one's mean loss."""
    model.zero_grad(set_to_none=True)
    for b in micro_batches:
        loss_sum, _ = task.loss(model, b)
        (loss_sum / max(task.count(b), 1) / len(micro_batches)).backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def optimizer_update(cfg: RunConfig, model: nn.Module, init: list[torch.Tensor],
                     grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The update one plain optimizer step of ``cfg`` makes from ``init`` with ``grads``: a copy of ``model``,
    the run's parameter groups, the first step's learning rate and the same clipping (``model`` is untouched)."""
    copy_ = copy.deepcopy(model)
    params = list(copy_.parameters())
    with torch.no_grad():
        for p, a in zip(params, init):
            p.copy_(a)
    opt = make_optimizer(cfg.section("schedule"), params, model=copy_)  # the same groups: no decay on biases, norms, embeddings
    first_lr = cfg.lr * lr_factor(0, schedule=cfg.schedule, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps,
                                  lr=cfg.lr, min_lr=cfg.min_lr)  # the run's first step is at the schedule's start
    for group in opt.param_groups:
        group["lr"] = first_lr
    for p, g in zip(params, grads):
        p.grad = g.detach().to(p.dtype).clone()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    return [p.detach() - a for p, a in zip(params, init)]


NOISE_MARGIN = 2.0
"""An update within this many times the noise floor measured in the same call passes."""


@dataclass(frozen=True, kw_only=True)
class NoiseFloor:
    """How far the update moves from the reference through rounding alone, measured in the same call.

    Adam divides each gradient value by its own magnitude, so where a gradient is near zero a relative
    rounding difference of 1e-7 (another kernel's summation order: torch.compile, accumulation) becomes a
    per-tensor update difference near 1e-3, the fp32 tolerance. The floor is the larger of two measurements:
    the reference optimizer fed the run's own gradient (the update error that gradient's rounding explains;
    the gradient itself is judged against its tolerance), and the eager reference recomputed with the global
    batch's rows in reverse order (eager fp32's own reordering noise)."""

    run_gradient: float
    """Worst per-tensor update error of the reference optimizer stepped with the run's gradient."""
    reordered: float
    """Worst per-tensor update error of the eager reference summed in another order."""
    reordered_grad: float
    """That reordered reference's gradient relative error."""
    tolerance: float
    """The precision's update tolerance; the bound is never below it."""

    @property
    def bound(self) -> float:
        return max(self.tolerance, NOISE_MARGIN * max(self.run_gradient, self.reordered))

    def to_dict(self) -> dict[str, float | str]:
        return {"update_bound": self.bound, "update_bound_kind": "noise floor",
                "noise_floor_run_gradient": self.run_gradient, "noise_floor_reordered": self.reordered,
                "noise_floor_reordered_grad": self.reordered_grad}


def update_noise_floor(cfg: RunConfig, ref: nn.Module, init: list[torch.Tensor], task, samples: list, *,
                       ref_grads: list[torch.Tensor], ref_update: list[torch.Tensor],
                       run_grads: list[torch.Tensor]) -> NoiseFloor:
    """Measure :class:`NoiseFloor` for this step (two more reference optimizer steps, one more backward)."""
    reordered = reference_grads(ref, task, [task.collate(samples[::-1])])
    return NoiseFloor(
        run_gradient=update_rel_error(optimizer_update(cfg, ref, init, run_grads), ref_update),
        reordered=update_rel_error(optimizer_update(cfg, ref, init, reordered), ref_update),
        reordered_grad=rel_error(flat(reordered), flat(ref_grads)),
        tolerance=precision_facts(cfg.precision).tolerance.max_update_rel_error)


def verify(cfg: RunConfig, *, strategy: Strategy | None = None) -> VerifyReport:
    """Step the configured levers once and compare with the fp32 big-batch reference.

    Raises:
        ConfigError: ``micro_batch="auto"`` (verify needs a concrete split).
        TrainfitError: the configured model does not start from the reference's weights.
    """
    if cfg.micro_batch == "auto":
        raise ConfigError("micro_batch", "auto", "an integer", "verify checks one concrete split; pass --micro-batch N")
    strategy = strategy or make_strategy(cfg)
    cfg = fit_to_world(cfg, strategy.world_size)  # global_batch -> this rank's accumulation
    run = build_run(cfg, strategy=strategy)
    task, world = run.task, run.strategy.world_size
    levers, run_section = cfg.section("levers"), cfg.section("run")
    ds = task.dataset()
    global_batch = cfg.micro_batch * cfg.accumulation * world

    # The reference: fp32, one device, same seed -> same initial weights (checked).
    ref, init, params, before = _reference_model(cfg.section("model"), run_section, run)
    idx = global_indices(0, global_batch, len(ds), cfg.seed)
    ref_grads = reference_grads(ref, task, [task.collate([ds[i] for i in idx])])
    ref_update = optimizer_update(cfg, ref, init, ref_grads)

    # The configured step, observed from outside: capture gradients right after unscaling.
    captured, stepped, skipped, scale = _observed_step(run, params, _rank_micro_batches(levers, run_section, run, ds))
    grads = captured if captured is not None else [torch.zeros_like(g) for g in ref_grads]
    update = [_full(p).float() - b for p, b in zip(params, before)]
    gap = _gap(cfg.precision, grads, ref_grads, update, ref_update, stepped=stepped, skipped=skipped, scale=scale)
    ok, extra = gap.ok, {}
    if _only_the_update_outside(cfg.precision, gap):
        # Only the update is outside the tolerance: judge it against this call's noise floor instead.
        floor = update_noise_floor(cfg, ref, init, task, [ds[i] for i in idx], ref_grads=ref_grads,
                                   ref_update=ref_update, run_grads=grads)
        extra = floor.to_dict()
        ok = gap.upd_rel <= floor.bound
    causes = [] if ok else _diagnose(levers, run_section, run, ref, init, ds, gap)
    return VerifyReport(precision=cfg.precision, strategy=cfg.strategy, micro_batch=cfg.micro_batch,
                        accumulation=cfg.accumulation, world_size=world, global_batch=global_batch,
                        grad_cosine=gap.cos, grad_rel_error=gap.grad_rel, grad_norm_ratio=gap.ratio,
                        update_max_rel_error=gap.upd_rel, skipped_steps=skipped,
                        fp16_underflow_frac=fp16_underflow_fraction(ref_grads), loss_scale=scale,
                        tolerance=gap.tol, passed=ok, causes=tuple(causes), checkpointing=cfg.checkpointing.spec,
                        compiled=run.compiled is not None, extra=extra)


def _reference_model(model_section: ModelSection, run_section: RunSection,
                     run: Run) -> tuple[nn.Module, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(the fp32 reference model, its initial weights, the run's optimizer parameters, their full fp32 values
    before the step).

    Raises:
        TrainfitError: the run's model does not start from the reference's weights.
    """
    ref = run.task.build_model().float()
    ref_params = list(ref.parameters())
    init = [p.detach().clone() for p in ref_params]
    params = run.precision.optimizer_params(run.model)
    before = [_full(p).float() for p in params]
    if len(before) != len(init) or any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(before, init)):
        raise TrainfitError(
            f"verify: model {model_section.model!r} does not build the same initial weights twice from seed "
            f"{run_section.seed}; seed its initialisation inside the factory so the reference starts from the same "
            "point")
    return ref, init, params, before


def _rank_micro_batches(levers: LeversSection, run_section: RunSection, run: Run, ds) -> list:
    """This rank's micro-batches of the first step, on its device (the samples training would give it)."""
    st = run.strategy
    local_idx = rank_micro_batches(0, micro_batch=levers.micro_batch, accumulation=levers.accumulation, rank=st.rank,
                                   world_size=st.world_size, dataset_size=len(ds), seed=run_section.seed)
    return [to_device(run.task.collate([ds[i] for i in mb]), st.device) for mb in local_idx]


def _observed_step(run: Run, params: list[torch.Tensor],
                   mbs: list) -> tuple[list[torch.Tensor] | None, bool, int, float]:
    """Step ``run`` once on ``mbs``, an overflowing attempt retried on the same data as training would, with the
    gradients of ``params`` captured right after unscaling: (the last attempt's gradients, or None when none was
    captured; whether it stepped; the attempts skipped; the loss scale of the last attempt)."""
    prec = run.precision
    captured: list[list[torch.Tensor]] = []
    original = prec.unscale_and_check

    def observed_unscale(model, all_reduce_max=None):
        ok = original(model, all_reduce_max)
        captured.append([_full(p.grad).float() if p.grad is not None else torch.zeros(p.shape) for p in params])
        return ok

    prec.unscale_and_check = observed_unscale
    skipped, stepped, scale = 0, False, prec.loss_scale
    try:
        for _ in range(MAX_ATTEMPTS):
            scale = prec.loss_scale
            res = run.step(mbs)
            if res.stepped:
                stepped = True
                break
            skipped += 1
            if not prec.scales_loss:
                break  # without a scaler a retry would overflow the same way
    finally:
        prec.unscale_and_check = original
    return (captured[-1] if captured else None), stepped, skipped, scale


@dataclass(frozen=True, kw_only=True)
class _Gap:
    """How far the configured step is from the reference, and what the precision's tolerance says of it."""

    g: torch.Tensor
    """The configured step's gradient, flat."""
    cos: float
    grad_rel: float
    ratio: float
    """||g|| / ||g_ref||."""
    upd_rel: float
    """Worst per-tensor relative error of the update (inf when the step never ran)."""
    tol: Tolerance
    ok: bool
    """Within the precision's tolerance."""
    stepped: bool
    skipped: int
    scale: float
    """The loss scale of the last attempt."""


def _gap(precision: PrecisionName, grads: list[torch.Tensor], ref_grads: list[torch.Tensor], update: list[torch.Tensor],
         ref_update: list[torch.Tensor], *, stepped: bool, skipped: int, scale: float) -> _Gap:
    """Compare the configured step's gradients and update with the reference's, judged in ``precision``."""
    g, gr = flat(grads), flat(ref_grads)
    cos, grad_rel = cosine(g, gr), rel_error(g, gr)
    ratio = float(g.norm()) / max(float(gr.norm()), 1e-300)
    upd_rel = update_rel_error(update, ref_update) if stepped else math.inf
    tol, ok = judge(precision=precision, cos=cos, grad_rel=grad_rel, upd_rel=upd_rel, stepped=stepped)
    return _Gap(g=g, cos=cos, grad_rel=grad_rel, ratio=ratio, upd_rel=upd_rel, tol=tol, ok=ok, stepped=stepped,
                skipped=skipped, scale=scale)


def _only_the_update_outside(precision: PrecisionName, gap: _Gap) -> bool:
    """The step ran and only its update is outside the tolerance (the gradient is inside it)."""
    return (gap.stepped and not gap.ok and gap.upd_rel > gap.tol.max_update_rel_error
            and judge(precision=precision, cos=gap.cos, grad_rel=gap.grad_rel, upd_rel=0.0, stepped=True)[1])


def _diagnose(levers: LeversSection, run_section: RunSection, run: Run, ref, init, ds, gap: _Gap) -> list[str]:
    """Test the known failure hypotheses against the reference; most specific first."""
    causes = []
    ratio, scale = gap.ratio, gap.scale
    n_micro_batches = levers.accumulation * run.strategy.world_size  # micro-batches over all ranks
    if not gap.stepped:
        causes.append(f"all {gap.skipped} attempts were skipped (non-finite gradients or loss) with precision="
                      f"{levers.precision}; the step never ran")
        return causes
    if run.precision.scales_loss and near_ratio(ratio, scale):
        causes.append(f"gradients reach the optimizer still multiplied by the loss scale (norm {ratio:.4g}x the "
                      f"reference, loss scale {scale:g}): the loss scaler is never unscaled before clipping/step")
    elif run.precision.scales_loss and near_ratio(ratio, 1 / scale):
        causes.append(f"gradients are divided by the loss scale twice (norm {ratio:.3g}x the reference, "
                      f"1/scale = {1 / scale:.3g}): unscaled more than once")
    if n_micro_batches > 1:
        causes += _mean_of_means(levers, run_section, run, ref, init, ds, gap)
    if not causes and near_ratio(ratio, n_micro_batches, 1.2) and n_micro_batches > 1:
        causes.append(f"gradient norm is {ratio:.3g}x the reference (= micro-batches x ranks): losses are summed over "
                      "the window without dividing by its token count")
    if not causes and run.batchnorm and levers.accumulation > 1:
        causes.append(f"BatchNorm layers ({', '.join(run.batchnorm)}) normalise over each micro-batch, so "
                      f"accumulation={levers.accumulation} cannot equal one big batch; use accumulation=1 or "
                      "GroupNorm/LayerNorm")
    if not causes:
        tol = gap.tol
        causes.append(
            f"gradients or update outside the {levers.precision} tolerance (cosine {gap.cos:.6f} >= {tol.min_cosine}, "
            f"relative error {gap.grad_rel:.2e} <= {tol.max_grad_rel_error}, update error {gap.upd_rel:.2e} <= "
            f"{tol.max_update_rel_error} required); no known cause matched")
    return causes


def _mean_of_means(levers: LeversSection, run_section: RunSection, run: Run, ref, init, ds, gap: _Gap) -> list[str]:
    """The mis-normalised accumulation cause, when it fits: all ranks' micro-batches rebuilt, the configured
    gradient is a mean of per-micro-batch means rather than the big-batch gradient."""
    task, world = run.task, run.strategy.world_size
    model = copy.deepcopy(ref)
    with torch.no_grad():
        for p, a in zip(model.parameters(), init):
            p.copy_(a)
    mbs = [task.collate([ds[i] for i in mb])
           for r in range(world)
           for mb in rank_micro_batches(0, micro_batch=levers.micro_batch, accumulation=levers.accumulation, rank=r,
                                        world_size=world, dataset_size=len(ds), seed=run_section.seed)]
    mom = flat(mean_of_means_grads(model, task, mbs))
    per_mb = flat(reference_grads(model, task, mbs))  # correct normalisation, split the same way
    err_mom = rel_error(gap.g, mom)
    # Only a hypothesis when it differs from the correct split (equal counts make them equal).
    if err_mom < gap.grad_rel / 3 and rel_error(mom, per_mb) > gap.tol.max_grad_rel_error:
        return [(f"mis-normalised accumulation: the gradient matches a mean of per-micro-batch means (relative "
                 f"error {err_mom:.2e}) rather than the big-batch gradient ({gap.grad_rel:.2e}); micro-batches hold "
                 "different numbers of loss tokens (padding), so each micro-batch's loss sum must be divided by the "
                 "whole window's token count, not averaged per micro-batch")]
    return []
