"""trainfit's measurement inside a Hugging Face ``Trainer`` run: ``TrainfitCallback``.

    from trainfit.integrations.hf_callback import TrainfitCallback
    Trainer(model, args, train_dataset=ds, callbacks=[TrainfitCallback(measure_step=1)]).train()

Writes ``metrics.jsonl`` (one line per optimizer step), ``memory.json`` (the memory parts of the measured
step) and ``report.html`` into ``args.output_dir`` (or ``output_dir``). Hooks used: ``on_step_begin`` ..
``on_pre_optimizer_step`` (forward + backward; forward timed by hooks on the model, which also read the
batch's shape), ``on_optimizer_step`` (optimizer), ``on_step_end``; ``on_log`` adds loss/grad_norm/lr.
The Trainer has no backward hook: ``backward_s`` is the rest of the window before the optimizer hook
(it includes gradient clipping). The training itself is not changed.
"""

from __future__ import annotations

from typing import Any

from trainfit.errors import ConfigError
from trainfit.integrations.measure import MeasureOptions, StepMeter
from trainfit.vocabulary import PrecisionName


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("transformers", "not installed", "the transformers package",
                          "pip install 'trainfit[hf]'") from None
    return transformers


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
        self.meter = StepMeter(self.options, tool=f"transformers.Trainer {_transformers().__version__}",
                               precision=_precision(args))
        if state.is_world_process_zero:
            self.meter.open(args.output_dir)
        self._hooks = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                       model.register_forward_hook(self._post)]

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

    def _post(self, module, args, out):
        if self.meter is not None and self.meter._open_window:
            self.meter.forward_end()

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
        self.meter.optimizer_begin(getattr(optimizer, "scaler", None))

    def on_optimizer_step(self, args, state, control, **kw):
        self.meter.optimizer_end()

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):
        skipped = getattr(optimizer, "step_was_skipped", None)  # Accelerate's own flag (fp16 overflow)
        lr = lr_scheduler.get_last_lr()[0] if lr_scheduler is not None else None
        self.meter.step_end(state.global_step, scaler=getattr(optimizer, "scaler", None), skipped=skipped,
                            lr=lr, split_backward=True)

    def on_log(self, args, state, control, logs=None, **kw):
        if self.meter is not None and logs:
            self.meter.log(state.global_step, logs)
