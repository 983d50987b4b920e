"""trainfit's measurement inside a Hugging Face ``Trainer`` run: ``TrainfitCallback``.

    from trainfit.integrations.hf_callback import TrainfitCallback
    Trainer(model, args, train_dataset=ds, callbacks=[TrainfitCallback(measure_step=1)]).train()

Writes ``metrics.jsonl`` (one line per optimizer step, whatever ``logging_steps`` is), ``memory.json`` (the
memory parts of the measured step) and ``report.html`` into ``args.output_dir`` (or ``output_dir``). Hooks
used: ``on_step_begin`` .. ``on_pre_optimizer_step`` (forward + backward; forward timed by hooks on the model,
which also read the batch's shape and the loss it returns), ``on_pre_optimizer_step`` (the learning rate this
update uses, the gradient norm), ``on_optimizer_step`` (optimizer), ``on_step_end``.

* loss: the window's loss sum over its loss tokens, all micro-batches and ranks (``trainfit train``'s
  definition): each micro-batch's sum is the model's loss times the ``num_items_in_batch`` the Trainer passed
  (the model divided by it), or its mean loss times its label count when the model takes no loss kwargs; the
  count is of the labels the loss predicts (labels != -100; ``labels[..., 1:]`` for a causal LM), which can
  differ from the Trainer's own ``num_items_in_batch`` (see ``trainfit verify --framework hf-trainer``).
* grad_norm: of the gradients the optimizer steps with, before clipping. The Trainer clips before any hook, so
  a clipped step's pre-clip norm is the Trainer's own logged one where it logs that step, else null with
  ``grad_clipped: true``.
* The callback computes nothing the training reads and draws no random numbers, and its measured step runs
  each op as called (``measure.WatchingFlopCounter``: no op replaced by its decomposition): a run with and
  without it ends with the same weights bit for bit, for any model family (Llama's SiLU included). A resumed
  run appends to metrics.jsonl and measures again.

The Trainer has no backward hook: ``backward_s`` is the rest of the window before the optimizer hook
(it includes gradient clipping).
"""

from __future__ import annotations

from typing import Any

import torch

from trainfit.errors import ConfigError
from trainfit.integrations.measure import MeasureOptions, StepMeter
from trainfit.vocabulary import PrecisionName, StrategyName


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("transformers", "not installed", "the transformers package",
                          "pip install 'trainfit[hf]'") from None
    return transformers


def _strategy() -> tuple[str, int]:
    """(trainfit's strategy name, processes) of what Accelerate runs inside the Trainer."""
    from accelerate.state import AcceleratorState  # the Trainer's own dependency, started by now

    state = AcceleratorState()
    kind = state.distributed_type.value
    if kind == "FSDP":
        plugin = state.fsdp_plugin
        reshard = getattr(plugin, "reshard_after_forward", True)
        full = reshard is True or getattr(reshard, "name", "") == "FULL_SHARD"
        return (StrategyName.ZERO3 if full else StrategyName.ZERO2), state.num_processes
    return (StrategyName.SINGLE if kind == "NO" else StrategyName.DDP), state.num_processes


def _label_count(batch: dict, shifts: bool):
    """Loss tokens of a micro-batch: the labels its loss predicts."""
    labels = batch.get("shift_labels")
    if labels is None:
        labels = batch.get("labels")
        if labels is None:
            return None
        labels = labels[..., 1:] if shifts else labels
    return labels.ne(-100).sum()


def _shifts_labels(model) -> bool:
    """The model's loss is transformers' causal-LM loss (not encoder-decoder): it predicts ``labels[..., 1:]``.
    Asked of the function the model runs (``loss_function``), not of ``config.loss_type``, which the Trainer
    reads: with ``loss_type=None`` the Trainer counts one label per row that is never predicted."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return False
    config = getattr(model, "config", None)
    return getattr(model, "loss_function", None) is ForCausalLMLoss and \
        not getattr(config, "is_encoder_decoder", False)


def _precision(args) -> str:
    if getattr(args, "bf16", False):
        return PrecisionName.BF16_MIXED
    if getattr(args, "fp16", False):
        return PrecisionName.FP16_MIXED
    return PrecisionName.FP32


class TrainfitCallback(_transformers().TrainerCallback):
    """Measure one optimizer step of a ``transformers.Trainer`` run and log every step the trainfit way.

    Args:
        measure_step: optimizer steps done before the measured one (>= 1; 1 = the second step).
        output_dir: where the files go (default ``TrainingArguments.output_dir``).

    Raises:
        ConfigError: a bad ``measure_step`` or ``output_dir``.
    """

    def __init__(self, measure_step: int = 1, output_dir: str | None = None) -> None:
        self.options = MeasureOptions(measure_step=measure_step, output_dir=output_dir)
        self.meter: StepMeter | None = None
        self._hooks: list[Any] = []

    # ---- run ---------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kw):
        strategy, world = _strategy()
        self.meter = StepMeter(self.options, tool=f"transformers.Trainer {_transformers().__version__}",
                               precision=_precision(args), strategy=strategy, world_size=world)
        if state.is_world_process_zero:
            self.meter.open(args.output_dir, start=state.global_step)  # a resume appends
        self._shifts = _shifts_labels(model)
        self._batch = None
        self._hooks = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                       model.register_forward_hook(self._post, with_kwargs=True)]

    def on_train_end(self, args, state, control, **kw):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.meter is not None:
            self.report_path = self.meter.close()

    # ---- one optimizer step ------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.meter.step_begin(state.global_step, model, optimizer)

    def _pre(self, module, args, kwargs):
        m = self.meter
        if m is not None and m._open_window:  # evaluation runs between windows, so it is not counted
            batch = kwargs if "input_ids" in kwargs or not args else args[0]
            m.micro_batch(batch)
            m.batch_size(batch)
            m.forward_begin()

    def _post(self, module, args, kwargs, out):
        m = self.meter
        if m is None or not m._open_window:
            return
        m.forward_end()
        loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            return
        count = _label_count(kwargs, self._shifts)
        n = kwargs.get("num_items_in_batch")
        if count is not None:  # the model returned sum / n (the Trainer passed n), else its mean over count
            m.add_loss(loss.detach() * (n if n is not None else count), count)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        self._lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None  # this update's rate
        norm = _grad_norm(model)
        self._clipped = bool(args.max_grad_norm and args.max_grad_norm > 0 and norm is not None
                             and float(norm) >= args.max_grad_norm * (1 - 1e-4))
        self._norm = None if self._clipped else norm
        self.meter.optimizer_begin(getattr(optimizer, "scaler", None))

    def on_optimizer_step(self, args, state, control, **kw):
        self.meter.optimizer_end()

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        skipped = getattr(optimizer, "step_was_skipped", None)  # Accelerate's own flag (fp16 overflow)
        self.meter.step_end(state.global_step, scaler=getattr(optimizer, "scaler", None), skipped=skipped,
                            lr=self._lr, grad_norm=self._norm, split_backward=True)
        if self._clipped and self.meter._pending is not None:
            self.meter._pending["grad_clipped"] = True

    def on_log(self, args, state, control, logs=None, **kw):
        if self.meter is not None and logs:
            self.meter.log(state.global_step, logs)


def _grad_norm(model) -> torch.Tensor | None:
    """The 2-norm of the model's gradients as the optimizer sees them (reduced; sharded ones gathered)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None] if model is not None else []
    if not grads:
        return None
    with torch.no_grad():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
