"""Verify another tool's accumulation: run THAT tool's optimizer step with accumulation, and without.

Most users accumulate gradients with the Hugging Face ``Trainer``, an Accelerate loop or Lightning, not with
trainfit. ``trainfit verify --framework T`` runs the tool's own step three ways and keeps two questions apart:

* **accumulation error**: the tool's gradient at K micro-batches of M against the same tool at one micro-batch
  of K x M (same rows, same weights). Only this is a failure (exit 1): accumulating changed the gradient.
* **normalisation difference**: the tool's gradient at 1 x KM against the fp32 big-batch reference in plain
  PyTorch, the token mean (``sum of per-target losses / all prediction targets``). A tool may define its loss
  otherwise (the Trainer counts a causal LM's first label of each row, label smoothing); that is reported with
  its size and cause, and passes.

The micro-batches hold clearly different numbers of prediction targets (rows sorted longest first, cut in K),
as they do when a length-grouped sampler or packing meets padding; the reference does not depend on the order.

Each tool runs as its users write it:
  * ``accelerate``: ``Accelerator(gradient_accumulation_steps=K)``; ``with accelerator.accumulate(model):``
    ``accelerator.backward(loss)``. ``--framework-loss default``: ``loss`` is the micro-batch's mean (what a
    transformers model returns); ``token-weighted``: the micro-batch's loss sum over the window's token count
    (gathered across ranks), times K x ranks because ``backward`` divides by K and DDP averages over ranks.
  * ``lightning``: ``Trainer(accumulate_grad_batches=K, max_steps=1)``; ``training_step`` returns the mean
    (``default``) or the sum over the window's token count times K (``token-weighted``; Lightning divides by K).
  * ``hf-trainer``: a real ``transformers.Trainer`` with the user's own model (``hf:DIR`` or ``hf:<Class>``, any
    head of :data:`trainfit.integrations.hf_window.HEADS`) and their TrainingArguments (``--from FILE``), the
    model computing its own loss from ``labels`` -- whatever the installed transformers does with
    ``num_items_in_batch`` is what is measured.

The tools are optional extras, imported in :func:`tool` only; a missing one is a ConfigError naming the extra.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import trainfit.logs as logs
from trainfit.config import LeversSection, RunConfig
from trainfit.data import global_indices
from trainfit.errors import ConfigError, TrainfitError
from trainfit.integrations.hf_window import (
    HEADS,
    HFRows,
    blamed,
    hf_model,
    hf_rows,
    import_spec,
    replaced,
    training_arguments,
)
from trainfit.probes.verify import cosine, flat, mean_of_means_grads, reference_grads, rel_error
from trainfit.progress import logger
from trainfit.progress import say as progress_say
from trainfit.run import task_of
from trainfit.vocabulary import Dtype, Tolerance, precision_facts

log = logger("verify")
"""``trainfit.verify``: what the check runs, at INFO (the CLI says it on stderr; ``--quiet`` silences it)."""

FRAMEWORKS = ("hf-trainer", "accelerate", "lightning")
"""Tools whose accumulation ``verify --framework`` runs."""
LOSSES = ("default", "token-weighted")
"""How the loop normalises each micro-batch's loss: the tool's default (the micro-batch mean) or the fix."""
EXTRAS = {"hf-trainer": "hf", "accelerate": "accelerate", "lightning": "lightning"}
"""The pip extra that installs each tool: ``pip install 'trainfit[EXTRA]'``."""
FROM_FORMATS = {"hf-trainer": "transformers", "accelerate": "accelerate", "lightning": "lightning"}
"""The ``--from`` file format each tool reads (``integrations.read_config`` tells them apart)."""

CAUSE_MEAN_OF_MEANS = ("each micro-batch's mean loss divided by K (a mean of means): micro-batches with few "
                       "loss tokens weigh as much as long ones")
FIXES = {
    "accelerate": "sum the per-token losses and divide by the window's token count (gather it across ranks: "
                  "accelerator.gather(n_tokens).sum()) before accelerator.backward; multiply by "
                  "gradient_accumulation_steps x num_processes, which backward and DDP divide out "
                  "(verify --framework accelerate --framework-loss token-weighted)",
    "lightning": "return the loss sum divided by the window's token count (precompute it per window, summed "
                 "across ranks) times accumulate_grad_batches from training_step, instead of the micro-batch "
                 "mean (verify --framework lightning --framework-loss token-weighted)",
    "hf-trainer": "pass Trainer(compute_loss_func=...) a loss that sums the per-target losses and divides by "
                  "num_items_in_batch (the Trainer then counts the window and skips its own division by "
                  "gradient_accumulation_steps), or override compute_loss to do the same",
}
FIX_IGNORED = ("pass Trainer(compute_loss_func=lambda outputs, labels, num_items_in_batch: "
               "F.cross_entropy(<logits, labels flattened>, ignore_index=-100, reduction='sum') / num_items_in_batch)"
               " -- exact for any counts; or set model.accepts_loss_kwargs = False before building the Trainer "
               "(model_accepts_loss_kwargs becomes False and the Trainer divides each micro-batch mean by "
               "gradient_accumulation_steps: exact only when every micro-batch holds the same number of targets)")
FIX_COMPUTE_LOSS = ("in compute_loss, sum the per-target losses (reduction='sum', ignore_index=-100) and divide by "
                    "num_items_in_batch, the window's target count the Trainer passes it; or set "
                    "self.loss_is_scaled_for_ga = False so the Trainer divides each micro-batch mean by "
                    "gradient_accumulation_steps (exact only when micro-batches hold equal targets)")
FIX_COUNT = ("set model.loss_type = 'ForCausalLM' before building the Trainer (it then counts labels[..., 1:], the "
             "targets the shifted loss predicts), or have the data collator also return shift_labels (labels "
             "shifted left by one, -100 last), which the Trainer counts as they are")


@dataclass(frozen=True, kw_only=True)
class Difference:
    """One gradient against another: the size of one of the two things verify reports, and why."""

    rel_error: float
    """``||g - g_other|| / ||g_other||``."""
    cosine: float
    norm_ratio: float
    """``||g|| / ||g_other||``."""
    found: bool
    """Beyond the fp32 tolerance."""
    cause: str = ""
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"rel_error": self.rel_error, "cosine": self.cosine, "norm_ratio": self.norm_ratio,
                "found": self.found, "cause": self.cause, "fix": self.fix}


def difference(g: torch.Tensor, other: torch.Tensor, tol: Tolerance) -> Difference:
    cos, err = cosine(g, other), rel_error(g, other)
    ratio = float(g.norm()) / max(float(other.norm()), 1e-300)
    return Difference(rel_error=err, cosine=cos, norm_ratio=ratio,
                      found=not (cos >= tol.min_cosine and err <= tol.max_grad_rel_error))


@dataclass(frozen=True, kw_only=True)
class FrameworkVerifyReport:
    """One tool's gradient with accumulation, without, and the fp32 token-mean reference."""

    framework: str
    loss: str
    """default | token-weighted: how the loop normalised each micro-batch (see the module docstring)."""
    model: str
    head: str
    """What one prediction target is: a head of ``hf_window.HEADS``, or the task's unit (tokens, samples)."""
    micro_batch: int
    accumulation: int
    loss_tokens: tuple[int, ...]
    """Prediction targets in each micro-batch of the window, in the order the tool saw them."""
    path: str
    """What the tool actually did (e.g. whether the Trainer passed num_items_in_batch to the model)."""
    accumulation_error: Difference
    """The tool at K x M against the same tool at 1 x KM: a failure when found."""
    normalisation: Difference
    """The tool at 1 x KM against the token mean: reported, never a failure."""
    grad_rel_error: float
    """The tool at K x M against the token mean (both differences together)."""
    mean_of_means_rel_error: float
    """How far the tool's K x M gradient is from the mean-of-means gradient (small: that is what it computed)."""
    tolerance: Tolerance
    settings: tuple[str, ...] = ()
    """What the check read from ``--from`` and what it replaced (said, never silent)."""

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ConfigError("framework", self.framework, FRAMEWORKS)
        if self.loss not in LOSSES:
            raise ConfigError("framework_loss", self.loss, LOSSES)

    @property
    def passed(self) -> bool:
        return not self.accumulation_error.found

    def to_dict(self) -> dict[str, Any]:
        t = self.tolerance
        return {"framework": self.framework, "loss": self.loss, "model": self.model, "head": self.head,
                "micro_batch": self.micro_batch, "accumulation": self.accumulation,
                "loss_tokens": list(self.loss_tokens), "path": self.path,
                "accumulation_error": self.accumulation_error.to_dict(),
                "normalisation": self.normalisation.to_dict(), "grad_rel_error": self.grad_rel_error,
                "mean_of_means_rel_error": self.mean_of_means_rel_error,
                "tolerance": {"min_cosine": t.min_cosine, "max_grad_rel_error": t.max_grad_rel_error},
                "settings": list(self.settings), "passed": self.passed}


@dataclass
class Window:
    """K micro-batches of one accumulation window, plus what the loops need to run and score them."""

    micro_batches: list
    samples: list[list]
    """The samples of each micro-batch."""
    task: Any
    """The run's Task: its loss ``(loss_sum, n_tokens)``, count and model factory."""
    counts: list[int]
    model_spec: str = ""
    """``--model`` as given: what an exception in the model's forward is said to come from."""

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
        with self.model_code():
            return self.task.loss(model, batch)

    def model_code(self) -> contextlib.AbstractContextManager:
        """Where the user's model runs: an exception there is one line naming it (``--model``)."""
        return blamed("model", self.model_spec, "a model whose forward and loss run on the task's batches",
                      f"{self.model_spec}'s forward")

    def build_model(self) -> nn.Module:
        """The task's model (same seed, same weights each call) with every ``nn.Dropout`` at p=0: the tools
        call ``model.train()``, and a random mask would hide the accumulation error in noise."""
        model = self.task.build_model()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return model

    def merged(self) -> Window:
        """The same samples as one micro-batch (accumulation 1)."""
        every = [s for g in self.samples for s in g]
        batch = self.task.collate(every)
        return Window(micro_batches=[batch], samples=[every], task=self.task, counts=[self.task.count(batch)],
                      model_spec=self.model_spec)

    @property
    def tokens(self) -> int:
        return sum(self.counts)


@dataclass
class Captured:
    grads: list[torch.Tensor] = field(default_factory=list)
    path: str = ""
    num_items: int | None = None
    """The Trainer's ``num_items_in_batch`` for the window (hf-trainer only; None: not passed)."""
    accepts_loss_kwargs: bool | None = None
    """The Trainer's ``model_accepts_loss_kwargs`` (hf-trainer only)."""
    counted: int | None = None
    """The ``num_items_in_batch`` the Trainer gave ``compute_loss`` (hf-trainer only)."""
    custom_loss: bool = False
    """The user's Trainer subclass overrides ``compute_loss`` (hf-trainer only)."""
    trainer_name: str = "Trainer"
    """The Trainer class that ran (hf-trainer only)."""


# ----------------------------------------------------------------- the one lazy import

def tool(framework: str):
    """The tool's modules, imported only when its check runs. Raises ConfigError naming the pip extra."""
    try:
        if framework == "accelerate":
            import accelerate
            import accelerate.state

            return accelerate
        if framework == "lightning":
            import lightning.pytorch

            return lightning.pytorch
        import transformers

        return transformers
    except ImportError as e:
        raise ConfigError("framework", framework, "an installed tool",
                          f"{e.name or framework} is not installed: pip install 'trainfit[{EXTRAS[framework]}]'") from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The tools' banners and warnings go to stderr/nowhere, so ``--json`` stays one object on stdout."""
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers",
                                               "accelerate")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
            for p in model.parameters()]


# ----------------------------------------------------------------- each tool's loop

def _reset_accelerate(acc_mod) -> None:
    """Accelerate keeps process-wide singletons (state, gradient state); a second check must start clean."""
    acc_mod.state.AcceleratorState._reset_state(True)
    acc_mod.state.GradientState._reset_state()


def step_accelerate(w: Window, *, loss: str, lr: float = 1e-3) -> Captured:
    """The Accelerate loop users write, on the window; the gradient at the sync step, before ``optimizer.step``."""
    acc_mod = tool("accelerate")
    k = len(w.micro_batches)
    out = Captured()
    _reset_accelerate(acc_mod)
    try:
        acc = acc_mod.Accelerator(gradient_accumulation_steps=k, cpu=True)
        model = w.build_model()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        model, opt = acc.prepare(model, opt)
        # The fix: the window's token count, summed over ranks (one all-gather; a host sync on GPU).
        window = acc.gather(torch.tensor([w.tokens], device=acc.device)).sum()
        for mb in w.micro_batches:
            with acc.accumulate(model):
                loss_sum, n = w.loss(model, mb)
                if loss == "default":
                    value = loss_sum / n  # what model(**batch).loss is: this micro-batch's mean
                else:
                    value = loss_sum / window * (k * acc.num_processes)  # backward / K and DDP's mean undo these
                acc.backward(value)
                if acc.sync_gradients:
                    out.grads = _grads(model)
                opt.step()
                opt.zero_grad()
    finally:
        _reset_accelerate(acc_mod)
    out.path = (f"Accelerator(gradient_accumulation_steps={k}).accumulate + backward of "
                + ("the micro-batch mean (backward divides by K)" if loss == "default" else
                   "loss_sum / window tokens x K (backward divides by K)"))
    return out


def step_lightning(w: Window, *, loss: str, lr: float = 1e-3) -> Captured:
    """A LightningModule whose ``training_step`` returns the loss; ``on_before_optimizer_step`` captures."""
    pl = tool("lightning")
    k = len(w.micro_batches)
    out = Captured()
    inner = w.build_model()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = inner

        def training_step(self, batch, batch_idx):
            loss_sum, n = w.loss(self.model, batch)
            return loss_sum / n if loss == "default" else loss_sum / w.tokens * k  # Lightning divides by K

        def on_before_optimizer_step(self, optimizer) -> None:
            out.grads = _grads(self.model)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    loader = torch.utils.data.DataLoader(w.micro_batches, batch_size=None, shuffle=False)  # one item = one micro-batch
    trainer = pl.Trainer(accumulate_grad_batches=k, max_steps=1, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(Module(), train_dataloaders=loader)
    out.path = (f"lightning Trainer(accumulate_grad_batches={k}), training_step returns "
                + ("the micro-batch mean (Lightning divides by K)" if loss == "default" else
                   "loss_sum / window tokens x K (Lightning divides by K)"))
    return out


def step_hf_trainer(rows: HFRows, *, micro_batch: int, accumulation: int, user_args: Mapping[str, Any] | None = None,
                    lr: float = 1e-3, seed: int = 0, trainer_cls: type | None = None,
                    trainer_spec: str = "") -> Captured:
    """A real ``transformers.Trainer`` (or the user's subclass ``trainer_cls``) for one optimizer step over ``rows``
    cut into ``accumulation`` micro-batches of ``micro_batch``; the gradient in ``on_pre_optimizer_step``
    (clipping off). Its ``data_collator`` pads the rows, which the user's collator (if any) made once.

    Raises:
        ConfigError: the user's model, Trainer subclass (``trainer_spec``) or its compute_loss raised, or
            compute_loss returned no scalar loss: one line naming which."""
    tf = tool("hf-trainer")
    cls = trainer_cls or tf.Trainer
    model = rows.model.build()
    out = Captured()
    seen: list[Any] = []
    counted: list[Any] = []
    original_forward = model.forward

    def observed_forward(*args, **kwargs):  # records what the Trainer passes the model's loss
        seen.append(kwargs.get("num_items_in_batch"))
        with rows.model_code("forward"):
            return original_forward(*args, **kwargs)

    with tempfile.TemporaryDirectory() as tmp:
        args = training_arguments(tf, {"learning_rate": lr, **(user_args or {})}, output_dir=tmp,
                                  micro_batch=micro_batch, accumulation=accumulation, seed=seed)
        with _trainer_code(cls, trainer_spec, "__init__"):
            trainer = _observed_trainer(tf, cls, model, args, rows, out, counted, trainer_spec)
        model.forward = observed_forward
        try:
            with _trainer_code(cls, trainer_spec, "train"):
                trainer.train()
        finally:
            model.forward = original_forward
    items = [int(x) if x is not None else None for x in seen]
    out.counted = int(counted[0]) if counted and counted[0] is not None else None
    out.custom_loss = cls.compute_loss is not tf.Trainer.compute_loss
    out.trainer_name = cls.__name__
    if items and all(x is not None for x in items):
        out.num_items = items[0]
    out.path = _trainer_path(tf, cls, trainer, out, rows, items, type(model).__name__, micro_batch, accumulation)
    return out


def _observed_trainer(tf, cls: type, model: nn.Module, args: Any, rows: HFRows, out: Captured,
                      counted: list[Any], trainer_spec: str = "") -> Any:
    """``cls`` over ``rows`` with the gradient captured into ``out.grads`` before its optimizer step, whether the
    model accepts loss kwargs in ``out``, and each ``num_items_in_batch`` its ``compute_loss`` is given appended to
    ``counted``; its printer callback removed."""
    class Capture(tf.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            out.grads = _grads(model)

    trainer = cls(model=model, args=args, train_dataset=rows.rows, data_collator=rows.collate,
                  callbacks=[Capture()])
    trainer.remove_callback(tf.PrinterCallback)  # its end-of-training dict is the Trainer's, not the check's
    out.accepts_loss_kwargs = bool(getattr(trainer, "model_accepts_loss_kwargs", False))
    original_compute_loss = trainer.compute_loss

    def observed_compute_loss(model_, inputs, *args_, num_items_in_batch=None, **kwargs):  # what it counted
        counted.append(num_items_in_batch)
        with _trainer_code(cls, trainer_spec, "compute_loss") if trainer_spec else rows.model_code("loss"):
            got = original_compute_loss(model_, inputs, *args_, num_items_in_batch=num_items_in_batch, **kwargs)
        _check_loss(got, cls, trainer_spec, rows)
        return got

    trainer.compute_loss = observed_compute_loss
    return trainer


def _trainer_code(cls: type, spec: str, method: str):
    """Where the user's Trainer subclass runs (its ``method``): an exception there is one line naming it. The
    Trainer itself (no ``--trainer``) is not the user's: what it raises passes unchanged."""
    if not spec:
        return contextlib.nullcontext()
    return blamed("trainer", spec, f"a transformers.Trainer subclass whose {method} runs on the rows",
                  f"{cls.__name__}.{method}")


def _check_loss(got: Any, cls: type, spec: str, rows: HFRows) -> None:
    """What ``compute_loss`` returned must be one differentiable number (or ``(loss, outputs)``): the Trainer
    backpropagates it. Anything else is one line naming the Trainer subclass (or the model, whose loss it is)."""
    loss = got[0] if isinstance(got, tuple) and got else got
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point() and loss.requires_grad:
        return
    held = (f"a tensor of shape {tuple(loss.shape)}, dtype {loss.dtype}"
            + ("" if loss.requires_grad else ", not requiring grad") if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}")
    field, value, who = (("trainer", spec, f"{cls.__name__}.compute_loss") if spec else
                         ("model", rows.model.spec, f"{rows.model.cls.__name__}'s loss"))
    raise ConfigError(field, value, "a compute_loss returning one differentiable number (a 0-d float tensor "
                      "with grad), or (loss, outputs)", f"{who} returned {held}")


def _trainer_path(tf, cls: type, trainer: Any, out: Captured, rows: HFRows, items: list[int | None], name: str,
                  micro_batch: int, k: int) -> str:
    """What the Trainer did with the loss at ``micro_batch`` x ``k``: the user's compute_loss and whether it was
    divided by the accumulation, or whether ``num_items_in_batch`` reached the model ``name``."""
    if out.custom_loss:
        scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (out.accepts_loss_kwargs and out.counted is not None) or trainer.compute_loss_func is not None
        return (f"transformers {tf.__version__} {cls.__name__}(Trainer) at {micro_batch} x {k}: its own "
                f"compute_loss, given num_items_in_batch={out.counted} (the window's prediction targets: "
                f"{sum(rows.counts)}); the Trainer " + ("did not divide its loss by gradient_accumulation_steps"
                                                        if scaled else f"divided its loss by "
                                                        f"gradient_accumulation_steps={k}"))
    if items and all(x is not None for x in items):
        return (f"transformers {tf.__version__} Trainer at {micro_batch} x {k}: passed num_items_in_batch="
                f"{items[0]} (the window's prediction targets: {sum(rows.counts)}) to {name} on each of "
                f"{len(items)} micro-batches and did not divide by gradient_accumulation_steps")
    why = ("its forward takes no **kwargs (model_accepts_loss_kwargs=False)" if not out.accepts_loss_kwargs
           else "no labels were counted")
    return (f"transformers {tf.__version__} Trainer at {micro_batch} x {k}: did not pass num_items_in_batch "
            f"to {name} ({why}): each micro-batch's loss divided by gradient_accumulation_steps={k}")


def loss_ignores_num_items(rows: HFRows) -> bool:
    """Whether the model's own loss is unchanged when ``num_items_in_batch`` changes (it never reads it)."""
    model = rows.model.build()
    batch = rows.collate(rows.groups[0])
    with torch.no_grad(), rows.model_code("forward"):
        a = model(**batch, num_items_in_batch=torch.tensor(max(rows.counts[0], 1))).loss
        b = model(**batch, num_items_in_batch=torch.tensor(4 * max(rows.counts[0], 1))).loss
    return bool(torch.allclose(a, b, rtol=1e-6, atol=0.0))


# ----------------------------------------------------------------- the check

def uneven_window(cfg: RunConfig) -> Window:
    """The run's first global batch, sorted by loss tokens (longest first) and cut into K micro-batches."""
    task = task_of(cfg)
    ds = task.dataset()
    n = cfg.micro_batch * cfg.accumulation
    idx = global_indices(0, n, len(ds), cfg.seed)
    samples = [ds[i] for i in idx]
    samples.sort(key=lambda s: -task.count(task.collate([s])))
    groups = [samples[i * cfg.micro_batch:(i + 1) * cfg.micro_batch] for i in range(cfg.accumulation)]
    mbs = [task.collate(g) for g in groups]
    return Window(micro_batches=mbs, samples=groups, task=task, counts=[task.count(b) for b in mbs],
                  model_spec=cfg.model)


def _check_args(levers: LeversSection, framework: str, loss: str) -> None:
    """Refuse, in one line, a framework, loss or split the check cannot run (it needs a concrete fp32 split
    with accumulation)."""
    if framework not in FRAMEWORKS:
        raise ConfigError("framework", framework, FRAMEWORKS)
    if loss not in LOSSES:
        raise ConfigError("framework_loss", loss, LOSSES)
    if levers.micro_batch == "auto":
        raise ConfigError("micro_batch", "auto", "an integer", "verify checks one concrete split; pass --micro-batch N")
    if precision_facts(levers.precision).compute != Dtype.FP32:  # the fp32 row: what the reference computes in
        raise ConfigError("precision", levers.precision, "fp32 with --framework",
                          "--framework checks the tool's accumulation, in fp32; drop --precision")
    if levers.accumulation < 2:
        raise ConfigError("accumulation", levers.accumulation, "an integer >= 2 with --framework",
                          "the check compares the tool with and without accumulation")
    if framework == "hf-trainer" and loss != "default":
        raise ConfigError("framework_loss", loss, "default with --framework hf-trainer",
                          "the Trainer's own loss path is what is verified; token-weighting is its job")


def verify_framework(cfg: RunConfig, *, framework: str, loss: str = "default",
                     user_args: Mapping[str, Any] | None = None, settings: tuple[str, ...] = (),
                     collator: str = "", trainer: str = "",
                     say: Callable[[str], None] | None = None) -> FrameworkVerifyReport:
    """Run ``framework``'s step at K x M and at 1 x KM and compare with the fp32 token-mean reference.

    Args:
        user_args: hf-trainer: the user's TrainingArguments as a mapping (``--from``), kept where the check
            does not need its own value (``hf_window.FORCED``).
        settings: lines saying what was read from ``--from`` (carried into the report).
        collator: hf-trainer: ``module:callable``, the user's data collator (a collator, its class, or a function of
            ``tokenizer`` returning one); each row goes through it once, seeded (``hf_window.collate_rows``).
        trainer: hf-trainer: ``module:callable``, the user's ``transformers.Trainer`` subclass (its own
            ``compute_loss``) run in place of the Trainer.
        say: progress, one line per run of the tool; default: INFO on the ``trainfit.verify`` logger.

    Raises:
        ConfigError: unknown framework/loss, a tool not installed, micro_batch="auto", accumulation 1, a model
            the tool cannot train (hf-trainer needs an hf: model with a head of ``HEADS``); the user's collator,
            model or Trainer raising or returning what the next step cannot take (``hf_window.check_rows``,
            ``hf_window.blamed``): one line naming which.
        TrainfitError: the model does not build the same initial weights twice.
    """
    _check_args(cfg.section("levers"), framework, loss)
    for key, value in (("collator", collator), ("trainer", trainer)):
        if value and framework != "hf-trainer":
            raise ConfigError(key, value, "a setting of --framework hf-trainer",
                              f"the {framework} check runs trainfit's task with its own loop; drop it")
    tf = tool(framework)  # a missing tool is refused before any model is built
    trainer_cls = load_trainer_class(tf, trainer) if trainer else None
    tol = precision_facts("fp32").tolerance
    say = say or (lambda line: progress_say(log, line))
    if framework == "hf-trainer":
        return _verify_trainer(cfg, tol, user_args=user_args, settings=settings, say=say, collator=collator,
                               trainer_cls=trainer_cls, trainer_spec=trainer)
    return _verify_loop(cfg, framework, loss, tol, settings=settings, say=say)


def _verify_loop(cfg: RunConfig, framework: str, loss: str, tol: Tolerance, *, settings: tuple[str, ...],
                 say: Callable[[str], None]) -> FrameworkVerifyReport:
    """accelerate or lightning: trainfit's task in the tool's loop at K x M and at 1 x KM, against the token mean
    and the mean of means computed here."""
    w = uneven_window(cfg)
    ref = w.build_model().float()
    init = [p.detach().clone() for p in ref.parameters()]
    with w.model_code():
        g_ref = flat(reference_grads(ref, w.task, w.micro_batches))  # sum(loss) / sum(tokens) over the window
        mom = flat(mean_of_means_grads(ref, w.task, w.micro_batches))
    logs.accept()  # the user's model has run: progress flows from here, each run said as it starts
    step = step_accelerate if framework == "accelerate" else step_lightning
    runs = []
    for window in (w, w.merged()):
        say(f"verify --framework {framework}: one step at {len(window.micro_batches)} micro-batch(es)")
        with _quiet():
            runs.append(step(window, loss=loss, lr=cfg.lr))
    g_k, g_1 = (_checked(framework, r, len(init)) for r in runs)
    acc = difference(g_k, g_1, tol)
    if acc.found:
        err_mom = rel_error(g_k, mom)
        cause = (f"{CAUSE_MEAN_OF_MEANS} (the gradient matches the mean of means to {err_mom:.2e}; loss tokens "
                 f"per micro-batch {'/'.join(map(str, w.counts))})" if err_mom < acc.rel_error / 3 else
                 f"the gradient at {cfg.accumulation} micro-batches differs from one micro-batch of all the samples "
                 f"(norm ratio {acc.norm_ratio:.4g}); no known cause matched")
        acc = _explained(acc, cause, FIXES[framework])
    norm = difference(g_1, g_ref, tol)
    if norm.found:
        norm = _explained(norm, f"the loop's loss over one micro-batch of every sample is not the token mean "
                                f"(norm ratio {norm.norm_ratio:.4g})", "")
    return FrameworkVerifyReport(
        framework=framework, loss=loss, model=cfg.model, head=w.task.unit, micro_batch=cfg.micro_batch,
        accumulation=cfg.accumulation, loss_tokens=tuple(w.counts), path=runs[0].path, accumulation_error=acc,
        normalisation=norm, grad_rel_error=rel_error(g_k, g_ref), mean_of_means_rel_error=rel_error(g_k, mom),
        tolerance=tol, settings=settings)


def _checked(framework: str, got: Captured, n_params: int) -> torch.Tensor:
    if not got.grads:
        raise TrainfitError(f"verify --framework {framework}: the tool never reached its optimizer step")
    if len(got.grads) != n_params:
        raise TrainfitError(f"verify --framework {framework}: {len(got.grads)} gradients for {n_params} parameters")
    return flat(got.grads)


def _explained(d: Difference, cause: str, fix: str) -> Difference:
    return Difference(rel_error=d.rel_error, cosine=d.cosine, norm_ratio=d.norm_ratio, found=d.found, cause=cause,
                      fix=fix)


def load_trainer_class(tf, spec: str) -> type:
    """``module:callable`` naming a ``transformers.Trainer`` subclass (or a function returning one).

    Raises:
        ConfigError: not importable, or not a Trainer subclass (one line naming the spec).
    """
    obj = import_spec(spec, "trainer", "a transformers.Trainer subclass")
    if not isinstance(obj, type) and callable(obj):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - one line naming the spec
            raise ConfigError("trainer", spec, "a transformers.Trainer subclass, or a function returning one",
                              f"calling it raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                              ) from None
    if not (isinstance(obj, type) and issubclass(obj, tf.Trainer)):
        raise ConfigError("trainer", spec, "a transformers.Trainer subclass (its own compute_loss or training_step)",
                          f"it is {obj!r}"[:120])
    return obj


def _verify_trainer(cfg: RunConfig, tol: Tolerance, *, user_args: Mapping[str, Any] | None,
                    settings: tuple[str, ...], say: Callable[[str], None], collator: str = "",
                    trainer_cls: type | None = None, trainer_spec: str = "") -> FrameworkVerifyReport:
    """hf-trainer: the user's model, data, collator, Trainer and TrainingArguments; the reference per row in
    plain PyTorch, from the logits of the rows the collator made. The job is accepted (held stderr printed,
    ``logs.accept``) once the Trainer's first run has run every object of the user's -- a fault in one is one
    line alone -- and the two runs after it are said as they start."""
    model = hf_model(cfg.section("model"), cfg.section("run"))
    say(f"verify --framework hf-trainer: reading the rows of {cfg.data or 'generated data'} for a "
        f"{HEADS[model.head]}" + (f", collated by {collator}" if collator else ""))
    rows = hf_rows(cfg, model, collator=collator)
    if replaced(user_args):
        settings = (*settings, "replaced for the check: " + ", ".join(replaced(user_args)))
    ref = rows.model.build()
    init = [p.detach().clone() for p in ref.parameters()]
    again = [p.detach() for p in rows.model.build().parameters()]
    if len(again) != len(init) or any(not torch.equal(a, b) for a, b in zip(again, init)):
        raise TrainfitError(f"verify: model {cfg.model!r} does not build the same initial weights twice from seed "
                            f"{cfg.seed}; its weights must come from the checkpoint or the seed")
    step = functools.partial(step_hf_trainer, rows, user_args=user_args, lr=cfg.lr, seed=cfg.seed,
                             trainer_cls=trainer_cls, trainer_spec=trainer_spec)
    m, k, said = cfg.micro_batch, cfg.accumulation, "verify --framework hf-trainer:"
    say(f"{said} one Trainer step at {m} x {k}")
    with _quiet():
        runs = [step(micro_batch=m, accumulation=k)]
    logs.accept()  # every object of the user's has run once (collator, model, Trainer): progress flows from here
    say(f"{said} the plain-PyTorch reference, {len(rows.rows)} rows one at a time")
    g_ref, mom = flat(rows.grads(ref)), flat(rows.grads(ref, mean_of_means=True))
    say(f"{said} one Trainer step at {m * k} x 1")
    with _quiet():
        runs.append(step(micro_batch=m * k, accumulation=1))
    g_k, g_1 = (_checked("hf-trainer", r, len(init)) for r in runs)
    acc = difference(g_k, g_1, tol)
    if acc.found:
        k_mom = mom * len(rows.groups)  # what summing K micro-batch means gives
        acc = _trainer_accumulation_cause(acc, runs[0], rows, rel_error(g_k, mom), rel_error(g_k, k_mom))
    norm = difference(g_1, g_ref, tol)
    if norm.found:
        norm = _trainer_normalisation_cause(norm, runs[1], rows, user_args)
    return FrameworkVerifyReport(
        framework="hf-trainer", loss="default", model=cfg.model,
        head=f"{HEADS[rows.head]} ({rows.model.cls.__name__})", micro_batch=cfg.micro_batch,
        accumulation=cfg.accumulation, loss_tokens=tuple(rows.counts), path=runs[0].path, accumulation_error=acc,
        normalisation=norm, grad_rel_error=rel_error(g_k, g_ref), mean_of_means_rel_error=rel_error(g_k, mom),
        tolerance=tol, settings=(*settings, *([f"rows: {rows.source}"] if rows.source else ())))


def _trainer_accumulation_cause(acc: Difference, run: Captured, rows: HFRows, err_mom: float,
                                err_k_mom: float) -> Difference:
    name, k = rows.model.cls.__name__, len(rows.groups)
    counts = "/".join(map(str, rows.counts))
    if run.custom_loss:
        who = run.trainer_name
        if err_k_mom < acc.rel_error / 3:
            return _explained(acc, (
                f"{who}.compute_loss returns each micro-batch's own mean (divided by that micro-batch's targets, "
                f"not by num_items_in_batch={run.counted}), and the Trainer does not divide it by "
                f"gradient_accumulation_steps={k}: it sums {k} micro-batch means (the gradient is {k} x the mean "
                f"of means to {err_k_mom:.2e}; norm ratio {acc.norm_ratio:.4g}; targets per micro-batch {counts})"),
                FIX_COMPUTE_LOSS)
        if err_mom < acc.rel_error / 3:
            return _explained(acc, f"{who}.compute_loss: {CAUSE_MEAN_OF_MEANS} (matches the mean of means to "
                                   f"{err_mom:.2e}; targets per micro-batch {counts})", FIX_COMPUTE_LOSS)
        return _explained(acc, f"{who}.compute_loss: the gradient at {k} micro-batches differs from one micro-batch "
                               f"of the same rows (norm ratio {acc.norm_ratio:.4g}); no known cause matched",
                          FIX_COMPUTE_LOSS)
    if run.num_items is not None and loss_ignores_num_items(rows):
        return _explained(acc, (
            f"{name}.forward takes **kwargs, so the Trainer (model_accepts_loss_kwargs=True) passes "
            f"num_items_in_batch and skips its division by gradient_accumulation_steps={k}, but {name}'s loss "
            f"never reads num_items_in_batch: it is each micro-batch's mean, and the Trainer sums {k} of them "
            f"(the gradient is {k} x the mean of means to {err_k_mom:.2e}; norm ratio {acc.norm_ratio:.4g}; "
            f"targets per micro-batch {counts})"), FIX_IGNORED)
    if not run.accepts_loss_kwargs and err_mom < acc.rel_error / 3:
        return _explained(acc, (
            f"{name}.forward takes no **kwargs, so the Trainer (model_accepts_loss_kwargs=False) cannot pass "
            f"num_items_in_batch: {CAUSE_MEAN_OF_MEANS} (matches the mean of means to {err_mom:.2e}; targets per "
            f"micro-batch {counts})"), FIXES["hf-trainer"])
    if err_mom < acc.rel_error / 3:
        return _explained(acc, f"{CAUSE_MEAN_OF_MEANS} (matches the mean of means to {err_mom:.2e}; a custom "
                               f"compute_loss returning a per-micro-batch mean?)", FIXES["hf-trainer"])
    return _explained(acc, f"the Trainer's gradient at {k} micro-batches differs from one micro-batch of the same rows "
                           f"(norm ratio {acc.norm_ratio:.4g}); no known cause matched", FIXES["hf-trainer"])


def _trainer_normalisation_cause(norm: Difference, run: Captured, rows: HFRows,
                                 user_args: Mapping[str, Any] | None) -> Difference:
    targets = sum(rows.counts)
    smoothing = float((user_args or {}).get("label_smoothing_factor") or 0.0)
    if run.custom_loss:
        who = run.trainer_name
        return _explained(norm, f"{who}.compute_loss over one micro-batch of every row is not the token mean of "
                                f"{HEADS[rows.head]} (given num_items_in_batch={run.counted}, the window's targets "
                                f"{targets}; norm ratio {norm.norm_ratio:.4g}): by design, or a count to check", "")
    if run.num_items is not None and run.num_items != targets:
        first = rows.head == "causal" and run.num_items == targets + sum(int(r["labels"][0] != -100) for r in rows.rows)
        why = (f": it counted every label, including each row's first, which the shifted causal loss never "
               f"predicts ({rows.model.cls.__name__}'s loss_type is not one the Trainer maps to ForCausalLMLoss)"
               if first else "")
        return _explained(norm, (f"the Trainer's num_items_in_batch is {run.num_items} but the window has {targets} "
                                 f"prediction targets{why}; the gradient is scaled by {targets}/{run.num_items} = "
                                 f"{targets / run.num_items:.4g} (norm ratio {norm.norm_ratio:.4g})"),
                          FIX_COUNT if first else "")
    if smoothing:
        return _explained(norm, f"label_smoothing_factor={smoothing} (from TrainingArguments): the Trainer's loss is "
                                "the smoothed cross-entropy, by design not the token mean", "")
    return _explained(norm, f"the Trainer's loss over one micro-batch of every row is not the token mean of "
                            f"{HEADS[rows.head]} (norm ratio {norm.norm_ratio:.4g})", "")
