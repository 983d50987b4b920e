"""trainfit's measurement inside a Lightning run: ``TrainfitCallback`` (``lightning.pytorch.Callback``).

    from trainfit.integrations.lightning_callback import TrainfitCallback
    lightning.Trainer(max_steps=100, callbacks=[TrainfitCallback(measure_step=1)]).fit(module, loader)

Writes ``metrics.jsonl`` (one line per optimizer step), ``memory.json`` (the memory parts of the measured
step) and ``report.html`` into the trainer's log directory (or ``output_dir``). Hooks used:
``on_train_batch_start`` .. ``on_before_backward`` (forward, incl. ``training_step``), ``on_before_backward`` ..
``on_after_backward`` (backward), ``on_before_optimizer_step`` .. ``on_train_batch_end`` (optimizer step and
zero_grad). With ``accumulate_grad_batches`` the window spans the batches up to the optimizer step.

* loss: the mean of the window's micro-batch losses as ``training_step`` returned them (Lightning divides each
  by ``accumulate_grad_batches`` before backward; that division is undone), averaged over ranks -- trainfit's
  token mean when the micro-batches hold equal numbers of loss tokens.
* lr: the rate this step's update uses; grad_norm: of the gradients the optimizer steps with (Lightning
  clips after ``on_before_optimizer_step``, so this is the pre-clip norm).
* tokens: ``input_ids`` of dict and ``BatchEncoding`` batches, else the first integer matrix.
* The callback computes nothing the training reads and draws no random numbers, and its measured step runs
  each op as called (``measure.WatchingFlopCounter``: no op replaced by its decomposition): a run with and
  without it ends with the same weights bit for bit, for any model family (Llama's SiLU included). A resumed
  run appends to metrics.jsonl and measures again.
"""

from __future__ import annotations

import torch

from trainfit.errors import ConfigError
from trainfit.integrations.measure import MeasureOptions, StepMeter
from trainfit.vocabulary import StrategyName, canonical_precision


def _lightning():
    try:
        import lightning.pytorch as pl
    except ImportError:
        raise ConfigError("lightning", "not installed", "the lightning package",
                          "pip install 'trainfit[lightning]'") from None
    return pl


def _strategy(trainer) -> str:
    """trainfit's name for the strategy Lightning runs."""
    name = type(trainer.strategy).__name__
    if "FSDP" in name:
        sharding = getattr(getattr(trainer.strategy, "sharding_strategy", None), "name", "FULL_SHARD")
        return StrategyName.ZERO2 if sharding == "SHARD_GRAD_OP" else StrategyName.ZERO3
    return StrategyName.SINGLE if trainer.world_size == 1 else StrategyName.DDP


class TrainfitCallback(_lightning().Callback):
    """Measure one optimizer step of a Lightning run and log every step the trainfit way.

    Args:
        measure_step: optimizer steps done before the measured one (>= 1; 1 = the second step).
        output_dir: where the files go (default ``trainer.log_dir``, else ``trainer.default_root_dir``).

    Raises:
        ConfigError: a bad ``measure_step`` or ``output_dir``.
    """

    def __init__(self, measure_step: int = 1, output_dir: str | None = None) -> None:
        self.options = MeasureOptions(measure_step=measure_step, output_dir=output_dir)
        self.meter: StepMeter | None = None
        self.report_path = None

    def on_train_start(self, trainer, pl_module):
        self.meter = StepMeter(self.options, tool=f"lightning {_lightning().__version__}",
                               precision=canonical_precision(str(trainer.precision)), strategy=_strategy(trainer),
                               world_size=trainer.world_size)
        if trainer.is_global_zero:
            self.meter.open(trainer.log_dir or trainer.default_root_dir, start=trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        if self.meter is not None:
            self.report_path = self.meter.close()

    def _scaler(self, trainer):
        return getattr(trainer.precision_plugin, "scaler", None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        m = self.meter
        if not m._open_window:
            opt = trainer.optimizers[0] if trainer.optimizers else None
            m.step_begin(trainer.global_step, pl_module, opt)
            self._lr = opt.param_groups[0]["lr"] if opt is not None else None
        m.micro_batch(batch)
        m.batch_size(batch)
        m.forward_begin()

    def on_before_backward(self, trainer, pl_module, loss):
        self.meter.forward_end()
        self.meter.backward_begin()

    def on_after_backward(self, trainer, pl_module):
        self.meter.backward_end()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        with torch.no_grad():
            norm = torch.nn.utils.get_total_norm(grads, 2.0) if grads else None
        self._norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.meter.optimizer_begin(self._scaler(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = self.meter
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):  # Lightning divided it by accumulate_grad_batches: undone
            m.add_loss(loss.detach() * trainer.accumulate_grad_batches, 1)
        if m._open_window and m._t_opt is not None:  # the optimizer stepped in this batch: the window ends
            m.step_end(trainer.global_step, scaler=self._scaler(trainer), lr=self._lr, grad_norm=self._norm)
