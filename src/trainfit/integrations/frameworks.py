"""Verify another tool's accumulation: run THAT tool's optimizer step on uneven micro-batches.

Most users accumulate gradients with the Hugging Face ``Trainer``, an Accelerate loop or Lightning,
not with trainfit. ``trainfit verify --framework T`` runs the tool's own accumulation mechanics on K
micro-batches that hold clearly different numbers of loss tokens, captures the gradient the tool hands
its optimizer (before the step, clipping off), and compares it with trainfit's fp32 big-batch reference
(``sum(loss) / sum(tokens)`` over the whole window, :mod:`trainfit.probes.verify`).

The micro-batches: the window's samples (the run's own first global batch) sorted by loss tokens, longest
first, and cut into K micro-batches -- so the counts differ several-fold, as they do when a length-grouped
sampler or packing meets padding. The big-batch gradient does not depend on that order.

Each tool runs as its users write it:
  * ``accelerate``: ``Accelerator(gradient_accumulation_steps=K)``; ``with accelerator.accumulate(model):``
    ``accelerator.backward(loss)``. ``--framework-loss default``: ``loss`` is the micro-batch's mean (what a
    transformers model returns); ``token-weighted``: the micro-batch's loss sum over the window's token count
    (gathered across ranks), times K x ranks because ``backward`` divides by K and DDP averages over ranks.
  * ``lightning``: ``Trainer(accumulate_grad_batches=K, max_steps=1)``; ``training_step`` returns the mean
    (``default``) or the sum over the window's token count times K (``token-weighted``; Lightning divides by K).
  * ``hf-trainer``: a real ``transformers.Trainer`` (``gradient_accumulation_steps=K, max_steps=1``) on the
    rows as a dataset, sequential sampler, the model computing its own loss from ``labels`` -- whatever
    the installed transformers does with ``num_items_in_batch`` is what is measured.

The tools are optional extras, imported in :func:`_tool` only; a missing one is a ConfigError naming the extra.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainfit.config import RunConfig
from trainfit.data import global_indices
from trainfit.errors import ConfigError, TrainfitError
from trainfit.probes.verify import _mean_of_means_grads, _reference_grads, cosine, flat, rel_error
from trainfit.run import task_of
from trainfit.tasks.synthetic import IGNORE_INDEX, PAD_ID
from trainfit.vocabulary import Tolerance, precision_facts

FRAMEWORKS = ("hf-trainer", "accelerate", "lightning")
"""Tools whose accumulation ``verify --framework`` runs."""
LOSSES = ("default", "token-weighted")
"""How the loop normalises each micro-batch's loss: the tool's default (the micro-batch mean) or the fix."""
EXTRAS = {"hf-trainer": "hf", "accelerate": "accelerate", "lightning": "lightning"}
"""The pip extra that installs each tool: ``pip install 'trainfit[EXTRA]'``."""

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
    "hf-trainer": "let the model compute its loss with num_items_in_batch (a transformers model, or a "
                  "compute_loss_func that sums and divides by num_items_in_batch); a custom compute_loss that "
                  "returns a per-micro-batch mean reintroduces the mean of means",
}

FIX_COUNT = ("have the data collator also return shift_labels (labels shifted left by one, -100 last): the Trainer "
             "counts those as they are and the model's ForCausalLMLoss uses them directly, so the count is "
             "the window's prediction targets")


@dataclass(frozen=True, kw_only=True)
class FrameworkVerifyReport:
    """One tool's accumulated gradient against the fp32 big-batch reference."""

    framework: str
    loss: str
    """default | token-weighted: how the loop normalised each micro-batch (see the module docstring)."""
    model: str
    micro_batch: int
    accumulation: int
    loss_tokens: tuple[int, ...]
    """Loss tokens in each micro-batch of the window, in the order the tool saw them."""
    path: str
    """What the tool actually did (e.g. whether the Trainer passed num_items_in_batch to the model)."""
    grad_cosine: float
    grad_rel_error: float
    """``||g - g_ref|| / ||g_ref||`` for the gradient the tool hands its optimizer."""
    grad_norm_ratio: float
    mean_of_means_rel_error: float
    """How far the tool's gradient is from the mean-of-means gradient (small: that is what it computed)."""
    tolerance: Tolerance
    passed: bool
    causes: tuple[str, ...] = ()
    fix: str = ""

    def __post_init__(self) -> None:
        if self.framework not in FRAMEWORKS:
            raise ConfigError("framework", self.framework, FRAMEWORKS)
        if self.loss not in LOSSES:
            raise ConfigError("framework_loss", self.loss, LOSSES)

    def to_dict(self) -> dict[str, Any]:
        t = self.tolerance
        return {"framework": self.framework, "loss": self.loss, "model": self.model, "micro_batch": self.micro_batch,
                "accumulation": self.accumulation, "loss_tokens": list(self.loss_tokens), "path": self.path,
                "grad_cosine": self.grad_cosine, "grad_rel_error": self.grad_rel_error,
                "grad_norm_ratio": self.grad_norm_ratio, "mean_of_means_rel_error": self.mean_of_means_rel_error,
                "tolerance": {"min_cosine": t.min_cosine, "max_grad_rel_error": t.max_grad_rel_error},
                "passed": self.passed, "causes": list(self.causes), "fix": self.fix}


@dataclass
class Window:
    """K micro-batches of one accumulation window, plus what the loops need to run and score them."""

    micro_batches: list
    samples: list[list]
    """The samples of each micro-batch (the Trainer re-collates them in its own row format)."""
    task: Any
    """The run's Task: its loss ``(loss_sum, n_tokens)``, count and model factory."""
    counts: list[int]

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
        return self.task.loss(model, batch)

    def build_model(self) -> nn.Module:
        """The task's model (same seed, same weights each call) with every ``nn.Dropout`` at p=0: the tools
        call ``model.train()``, and a random mask would hide the accumulation error in noise."""
        model = self.task.build_model()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return model

    @property
    def tokens(self) -> int:
        return sum(self.counts)


@dataclass
class Captured:
    grads: list[torch.Tensor] = field(default_factory=list)
    path: str = ""
    num_items: int | None = None
    """The Trainer's ``num_items_in_batch`` for the window (hf-trainer only)."""


# ----------------------------------------------------------------- the one lazy import

def _tool(framework: str):
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
    acc_mod = _tool("accelerate")
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
    pl = _tool("lightning")
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


def _hf_rows(samples: list) -> list[dict[str, torch.Tensor]]:
    """trainfit's pre-shifted rows (input x[:-1], labels x[1:]) as transformers rows: input = labels = x.
    The model shifts internally, so it scores exactly the same n next-token predictions."""
    rows = []
    for s in samples:
        full = torch.cat([s["input_ids"][:1], s["labels"]])
        rows.append({"input_ids": full, "labels": full.clone()})
    return rows


def _hf_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row (causal attention never reads the padding); padded labels -100."""
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), t), PAD_ID, dtype=torch.long)
    labels = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = r["input_ids"]
        labels[i, :len(r["labels"])] = r["labels"]
    return {"input_ids": ids, "labels": labels}


def step_hf_trainer(w: Window, *, loss: str, micro_batch: int, lr: float = 1e-3, seed: int = 0) -> Captured:
    """A real ``transformers.Trainer`` for one optimizer step; the gradient in ``on_pre_optimizer_step``."""
    tf = _tool("hf-trainer")
    if loss != "default":
        raise ConfigError("framework_loss", loss, "default with --framework hf-trainer",
                          "the Trainer's own loss path is what is verified; token-weighting is its job")
    model = w.build_model()
    if not isinstance(model, tf.PreTrainedModel) or not type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        raise ConfigError("model", getattr(w.task, "name", type(model).__name__),
                          "an hf: causal LM with --framework hf-trainer",
                          "the Trainer trains transformers models: e.g. --model hf:LlamaForCausalLM --model-config "
                          "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
                          "num_key_value_heads=4,vocab_size=256")
    out = Captured()
    seen: dict[str, Any] = {}

    class Capture(tf.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            out.grads = _grads(model)

    original_forward = model.forward

    def observed_forward(*args, **kwargs):  # records what the Trainer passes the model's loss
        seen.setdefault("num_items_in_batch", []).append(kwargs.get("num_items_in_batch"))
        return original_forward(*args, **kwargs)

    rows = [r for s in w.samples for r in _hf_rows(s)]
    with tempfile.TemporaryDirectory() as tmp:
        args = tf.TrainingArguments(output_dir=tmp, per_device_train_batch_size=micro_batch,
                                    gradient_accumulation_steps=len(w.micro_batches), max_steps=1, learning_rate=lr,
                                    report_to=[], use_cpu=True, max_grad_norm=0.0,  # clipping off: the raw gradient
                                    train_sampling_strategy="sequential", save_strategy="no", logging_strategy="no",
                                    disable_tqdm=True, lr_scheduler_type="constant", seed=seed,
                                    remove_unused_columns=False)
        trainer = tf.Trainer(model=model, args=args, train_dataset=rows, data_collator=_hf_collate,
                             callbacks=[Capture()])
        model.forward = observed_forward
        try:
            trainer.train()
        finally:
            model.forward = original_forward
    items = [int(x) if x is not None else None for x in seen.get("num_items_in_batch", [])]
    if items and all(x is not None for x in items):
        out.num_items = items[0]
        out.path = (f"transformers {tf.__version__} Trainer passed num_items_in_batch={items[0]} (the window's "
                    f"loss tokens: {w.tokens}) to {type(model).__name__}'s loss on each of {len(items)} micro-batches")
    else:
        out.path = (f"transformers {tf.__version__} Trainer did not pass num_items_in_batch to "
                    f"{type(model).__name__}: each micro-batch's mean loss divided by gradient_accumulation_steps")
    return out


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
    return Window(micro_batches=mbs, samples=groups, task=task, counts=[task.count(b) for b in mbs])


def verify_framework(cfg: RunConfig, *, framework: str, loss: str = "default") -> FrameworkVerifyReport:
    """Run ``framework``'s accumulation on an uneven window and compare with the fp32 big-batch gradient.

    Raises:
        ConfigError: unknown framework/loss, a tool not installed, micro_batch="auto", a model the tool
            cannot train (hf-trainer needs an hf: causal LM).
        TrainfitError: the model does not build the same initial weights twice.
    """
    if framework not in FRAMEWORKS:
        raise ConfigError("framework", framework, FRAMEWORKS)
    if loss not in LOSSES:
        raise ConfigError("framework_loss", loss, LOSSES)
    if cfg.micro_batch == "auto":
        raise ConfigError("micro_batch", "auto", "an integer", "verify checks one concrete split; pass --micro-batch N")
    if cfg.precision != "fp32":
        raise ConfigError("precision", cfg.precision, "fp32 with --framework",
                          "--framework checks the tool's accumulation, in fp32; drop --precision")
    _tool(framework)  # a missing tool is refused before any model is built
    w = uneven_window(cfg)
    ref = w.build_model().float()
    init = [p.detach().clone() for p in ref.parameters()]
    ref_grads = flat(_reference_grads(ref, w.task, w.micro_batches))  # sum(loss) / sum(tokens) over the window
    mom = flat(_mean_of_means_grads(ref, w.task, w.micro_batches))
    with _quiet():
        if framework == "accelerate":
            got = step_accelerate(w, loss=loss, lr=cfg.lr)
        elif framework == "lightning":
            got = step_lightning(w, loss=loss, lr=cfg.lr)
        else:
            got = step_hf_trainer(w, loss=loss, micro_batch=cfg.micro_batch, lr=cfg.lr, seed=cfg.seed)
    if not got.grads:
        raise TrainfitError(f"verify --framework {framework}: the tool never reached its optimizer step")
    if len(got.grads) != len(init):
        raise TrainfitError(f"verify --framework {framework}: {len(got.grads)} gradients for {len(init)} parameters")
    g = flat(got.grads)
    tol = precision_facts("fp32").tolerance
    cos, err = cosine(g, ref_grads), rel_error(g, ref_grads)
    ratio = float(g.norm()) / max(float(ref_grads.norm()), 1e-300)
    err_mom = rel_error(g, mom)
    ok = cos >= tol.min_cosine and err <= tol.max_grad_rel_error
    causes: list[str] = []
    if not ok:
        if got.num_items is not None and got.num_items != w.tokens:
            causes.append(f"the Trainer's num_items_in_batch is {got.num_items} but the window has {w.tokens} "
                          f"prediction targets (norm ratio {ratio:.4g}, {w.tokens}/{got.num_items} = "
                          f"{w.tokens / got.num_items:.4g}): it counted every label, including each row's first, "
                          "which a causal LM's shifted loss never predicts (the model's loss_type is not one the "
                          "Trainer maps to ForCausalLMLoss, so it counts labels, not labels[..., 1:])")
        elif err_mom < err / 3:
            causes.append(f"{CAUSE_MEAN_OF_MEANS} (the gradient matches the mean of means to {err_mom:.2e}; "
                          f"loss tokens per micro-batch {'/'.join(map(str, w.counts))})")
        else:
            causes.append(f"gradient off the big-batch reference (relative error {err:.2e}, norm ratio {ratio:.4g}); "
                          "no known cause matched")
    return FrameworkVerifyReport(framework=framework, loss=loss, model=cfg.model, micro_batch=cfg.micro_batch,
                                 accumulation=cfg.accumulation, loss_tokens=tuple(w.counts), path=got.path,
                                 grad_cosine=cos, grad_rel_error=err, grad_norm_ratio=ratio,
                                 mean_of_means_rel_error=err_mom, tolerance=tol, passed=ok, causes=tuple(causes),
                                 fix="" if ok else (FIX_COUNT if got.num_items not in (None, w.tokens)
                                                    else FIXES[framework]))
