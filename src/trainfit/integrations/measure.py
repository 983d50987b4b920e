"""The measuring core that the Trainer and Lightning callbacks share (no transformers, no lightning here).

A :class:`StepMeter` is driven by a tool's hooks: ``step_begin`` .. ``step_end`` bracket one optimizer step
(a window of micro-batches). Every step gets cheap bookkeeping only (``perf_counter`` calls, a shape read
for the token count) and one ``metrics.jsonl`` line with the keys ``trainfit train`` writes where they apply.
ONE chosen step (``measure_step``: that many optimizer steps done before it, so the optimizer state exists,
as ``trainfit memory --measure`` measures its second step) runs under trainfit's
:class:`~trainfit.meters.tracker.MemoryTracker` (params / grads / optimizer / activations / temporaries)
and :class:`WatchingFlopCounter` (the FLOPs per token for MFU). Both are dispatch modes that only watch: each op
runs as it would without them, so the step's numbers are bitwise the same (torch's ``FlopCounterMode`` does not
promise that: it replaces an op it has no formula for by the op's decomposition -- ``silu_backward`` among them --
whose float ops round differently, which moved a Llama's weights by 1e-9). At the end, ``memory.json`` (a
:class:`MemoryReport`) and ``report.html`` are written beside ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

from trainfit.errors import ConfigError
from trainfit.meters.devices import calibrate_cpu, compute_dtype, peak_flops
from trainfit.meters.flops import CPU_ATTENTION_FLOPS
from trainfit.meters.tracker import MemoryTracker
from trainfit.outputs import dumps_json
from trainfit.report import write_report
from trainfit.report.data import write_text_atomic
from trainfit.results import MemoryReport, fold_modules, precision_notes
from trainfit.vocabulary import PrecisionName, StrategyName

METRICS = "metrics.jsonl"
MEMORY = "memory.json"


@dataclass(frozen=True, kw_only=True)
class MeasureOptions:
    """What the user chose when constructing a callback (validated here, at construction)."""

    measure_step: int = 1
    """Optimizer steps completed before the measured one (>= 1: the optimizer state must exist; 1 is the
    second step, the one ``trainfit memory --measure`` measures)."""
    output_dir: str | None = None
    """Where metrics.jsonl, memory.json and report.html go; None: the tool's own output/log directory."""

    def __post_init__(self) -> None:
        m = self.measure_step
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError("measure_step", m, "an integer >= 1 (optimizer steps before the measured one)",
                              "pass measure_step=1 to measure the second step (optimizer state exists then)")
        if self.output_dir is not None and (not isinstance(self.output_dir, (str, Path)) or not str(self.output_dir)):
            raise ConfigError("output_dir", self.output_dir, "a directory path or None (the tool's output dir)")
        if self.output_dir is not None and Path(self.output_dir).exists() and not Path(self.output_dir).is_dir():
            raise ConfigError("output_dir", str(self.output_dir), "a directory (this path is a file)")


FLOP_FORMULAS = {**flop_registry, **{op: shape_wrapper(f) for op, f in CPU_ATTENTION_FLOPS.items()}}
"""torch's FLOP formula of each op it has one for (matmuls, convolutions, attention), and the CPU's fused attention."""


class WatchingFlopCounter(TorchDispatchMode):
    """The FLOPs of the ops that run inside it, counted with torch's own formulas (``flop_registry``, plus the
    CPU's fused attention) -- and each op run exactly as called.

    Not ``FlopCounterMode``: for an op without a formula it runs the op's decomposition instead of the op
    (``silu_backward`` becomes ``sigmoid``, ``mul``, ``add`` ...), which rounds differently, so a SiLU model
    (Llama, Mistral, Qwen) trained with the callback ended with other weights than without it. An op here
    is only ever called as it is; one without a formula counts 0 FLOPs, as the elementwise ops do there."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = FLOP_FORMULAS.get(getattr(func, "_overloadpacket", None))
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out

    def get_total_flops(self) -> int:
        return self.total


def items_in(batch: Any) -> tuple[int, str]:
    """(count, unit) of a batch from shapes only (no host sync): ``input_ids`` (or the first integer tensor)
    -> its elements as tokens; otherwise the first tensor's leading dimension as samples."""
    if isinstance(batch, Mapping):  # a dict, or the UserDict transformers' collators return (BatchEncoding)
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"].numel(), "tokens"
        batch = dict(batch)
    leaves = [x for x in torch.utils._pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    for t in leaves:
        if not t.is_floating_point() and t.dim() >= 2:
            return t.numel(), "tokens"
    return (int(leaves[0].shape[0]) if leaves and leaves[0].dim() else 0), "samples"


def unwrap_optimizer(opt: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a tool's wrapper (Accelerate's AcceleratedOptimizer -- itself an Optimizer
    subclass -- and LightningOptimizer): the innermost object that is one."""
    found = None
    for _ in range(4):
        if isinstance(opt, torch.optim.Optimizer):
            found = opt
        inner = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    return found


def device_peak(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s, where it comes from) for MFU: the datasheet table on CUDA, a measured matmul rate on CPU."""
    cuda = device.type == "cuda"
    dtype = compute_dtype(precision, tf32_enabled=cuda and torch.backends.cuda.matmul.allow_tf32)
    if cuda:
        name = torch.cuda.get_device_name(device)
        peak = peak_flops(name, dtype)
        return peak, f"datasheet {name} {dtype}" if peak else f"{name} is not in trainfit's peak table"
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):  # its random matrices must not move the run's own RNG stream
            cal = calibrate_cpu(dtype, seconds=0.1)  # once per run, after the measured step
        return cal.flops_per_s, f"CPU {dtype}: {cal.source} ({cal.threads} threads)"
    return None, f"no peak known for device type {device.type}"


class StepMeter:
    """One training run's per-step bookkeeping and its one measured step (see the module docstring).

    Args:
        options: the validated :class:`MeasureOptions`.
        tool: the tool's name and version, recorded in memory.json and metrics.jsonl.
        precision: trainfit's name for the tool's precision (fp32, bf16-mixed, fp16-mixed, ...).
        strategy, world_size: what the tool runs (trainfit's strategy name; processes), for memory.json.
    """

    def __init__(self, options: MeasureOptions, *, tool: str, precision: str = PrecisionName.FP32,
                 strategy: str = StrategyName.SINGLE, world_size: int = 1) -> None:
        self.options, self.tool, self.precision = options, tool, precision
        self.strategy, self.world_size = strategy, world_size
        self.out: Path | None = None
        self._file: TextIO | None = None
        self._pending: dict[str, Any] | None = None
        self._open_window = False
        self.skipped_steps = 0
        self.flops_per_item: float | None = None
        self.peak_flops_per_s: float | None = None
        self.peak_source = ""
        self.memory: MemoryReport | None = None
        self._tracker: MemoryTracker | None = None
        self._flops: WatchingFlopCounter | None = None
        self._model: nn.Module | None = None
        self._in_backward_seen = False

    # ---- run begin / end ---------------------------------------------------------------------------------
    def open(self, out_dir: str | Path, *, start: int = 0) -> None:
        """Start metrics.jsonl; a run resumed after optimizer step ``start`` keeps the lines of steps up to it
        (lines of later steps, from the interrupted run, are replaced by the steps this run logs again) and
        appends. memory.json of an earlier run is removed: this run measures its own step."""
        self.out = Path(self.options.output_dir or out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        kept = _lines_up_to(self.out / METRICS, start) if start > 0 else []
        (self.out / MEMORY).unlink(missing_ok=True)
        self._file = open(self.out / METRICS, "w")
        self._file.writelines(kept)
        self._file.flush()

    def close(self) -> Path | None:
        """Flush the last line, close the log, write report.html; returns its path (None if never opened)."""
        self._stop_measuring()
        self._flush()
        if self._file is None:
            return None
        self._file.close()
        self._file = None
        return write_report(self.out)

    # ---- one optimizer step ------------------------------------------------------------------------------
    def step_begin(self, index: int, model: nn.Module, optimizer: Any) -> None:
        """The window of optimizer step ``index`` (0-based: steps done before it) begins."""
        self._flush()
        self._open_window = True
        self.index, self.items, self.unit, self.micro = index, 0, "tokens", 0
        self.forward_s = self.backward_s = self.optimizer_s = 0.0
        self._t_fwd = self._t_bwd = self._t_opt = None
        self.scale_before = None
        self._loss_sum, self._loss_count = None, 0
        self.t0 = time.perf_counter()
        if index >= self.options.measure_step and self.memory is None:  # a resumed run measures its first step
            self._start_measuring(model, unwrap_optimizer(optimizer))

    def micro_batch(self, batch: Any) -> None:
        """A micro-batch of the window starts (its items counted from shapes)."""
        n, self.unit = items_in(batch)
        self.items += n
        self.micro += 1

    def add_loss(self, loss_sum: torch.Tensor, count: Any) -> None:
        """A micro-batch's loss summed over its ``count`` loss items (kept on the device: no host sync)."""
        loss_sum = loss_sum.detach().double()
        self._loss_sum = loss_sum if self._loss_sum is None else self._loss_sum + loss_sum
        self._loss_count = self._loss_count + count

    def window_loss(self) -> torch.Tensor | None:
        """The window's loss: its loss sum over its loss items, over all ranks (``trainfit train``'s definition)."""
        if self._loss_sum is None:
            return None
        both = torch.stack([self._loss_sum, torch.as_tensor(self._loss_count, dtype=torch.float64,
                                                            device=self._loss_sum.device)])
        if self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(both)  # every rank ends the window: the sum and count of all of them
        return both[0] / both[1].clamp(min=1)

    def forward_begin(self) -> None:
        self._t_fwd = time.perf_counter()
        if self._tracker is not None:
            self._in_backward_seen = False
            self._tracker.set_phase("forward")

    def forward_end(self) -> None:
        if self._t_fwd is not None:
            self.forward_s += time.perf_counter() - self._t_fwd
            self._t_fwd = None

    def backward_begin(self) -> None:
        self._t_bwd = time.perf_counter()
        if self._tracker is not None:
            self._tracker.set_phase("backward")

    def backward_end(self) -> None:
        if self._t_bwd is not None:
            self.backward_s += time.perf_counter() - self._t_bwd
            self._t_bwd = None

    def optimizer_begin(self, scaler: Any = None) -> None:
        self._t_opt = time.perf_counter()
        if scaler is not None and scaler.is_enabled():
            self.scale_before = scaler.get_scale()  # host-device sync (fp16 only: a scaler exists)
        if self._tracker is not None:
            self._tracker.set_phase("optimizer")

    def optimizer_end(self) -> None:
        if self._t_opt is not None:
            self.optimizer_s += time.perf_counter() - self._t_opt
            self._t_opt = None

    def step_end(self, step: int, *, scaler: Any = None, skipped: bool | None = None, lr: float | None = None,
                 loss: Any = None, grad_norm: Any = None, split_backward: bool = False) -> None:
        """The window ends after optimizer step number ``step`` (1-based, as trainfit train counts).

        ``loss``: None for the window's own (:meth:`add_loss`); ``lr``: the rate this step's update used.
        ``split_backward``: the tool has no backward hooks (HF Trainer), so backward_s is the window's time
        before the optimizer hook minus forward_s (it includes gradient clipping)."""
        if not self._open_window:
            return
        self._open_window = False
        if loss is None:
            loss = self.window_loss()
        t = time.perf_counter()
        step_s = t - self.t0
        self.optimizer_end()
        if split_backward:
            self.backward_s = max(step_s - self.forward_s - self.optimizer_s, 0.0)
        measured = self._tracker is not None
        self._stop_measuring()
        scale = None
        if scaler is not None and scaler.is_enabled():
            scale = scaler.get_scale()  # host-device sync (fp16 only)
            if skipped is None and self.scale_before is not None:
                skipped = scale < self.scale_before  # GradScaler lowers the scale only on a skipped step
        skipped = bool(skipped)
        self.skipped_steps += skipped
        rate = self.items / max(step_s, 1e-9)
        rec: dict[str, Any] = {
            "step": step, "loss": loss, "count": self.items, "stepped": not skipped,
            "skipped_steps": self.skipped_steps, "lr": lr, "loss_scale": scale if scale is not None else 1.0,
            "grad_norm": grad_norm, "step_s": step_s, f"{self.unit}_per_s": rate,
            "forward_s": self.forward_s, "backward_s": self.backward_s, "optimizer_s": self.optimizer_s,
        }
        if measured and self._model is not None:
            self._finish_measurement()
        if self.flops_per_item and self.peak_flops_per_s:
            rec["mfu"] = self.flops_per_item * rate / self.peak_flops_per_s
        if measured:
            rec["measured"] = True
        self._pending = rec

    def log(self, step: int, values: dict[str, Any]) -> None:
        """The pre-clip gradient norm the tool logged for ``step`` (HF on_log) fills a step whose norm the
        callback could not see (clipped before its hook). The tool's logged loss and learning rate are not
        used: they average over ``logging_steps`` steps, and the rate is read after the scheduler stepped."""
        if self._pending is not None and self._pending["step"] == step and self._pending["grad_norm"] is None:
            if isinstance(values.get("grad_norm"), (int, float)):
                self._pending["grad_norm"] = float(values["grad_norm"])
                self._pending.pop("grad_clipped", None)

    # ---- internals ---------------------------------------------------------------------------------------
    def _flush(self) -> None:
        rec, self._pending = self._pending, None
        if rec is None or self._file is None:
            return
        for key in ("loss", "grad_norm"):
            if isinstance(rec[key], torch.Tensor):
                rec[key] = float(rec[key])  # a step later than it was computed: that step is done by now
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()

    def _watch(self, tracker: MemoryTracker) -> None:
        """HF has no backward hook: label the phase backward from the first op autograd runs."""
        if torch._C._current_graph_task_id() != -1 and tracker.phase == "forward":
            tracker.set_phase("backward")

    def _start_measuring(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._model, self._optimizer = model, optimizer
        self._t_measure = time.perf_counter()
        self._flops = WatchingFlopCounter()
        self._flops.__enter__()  # outer: the tracker (inner) sees each op first and passes it on
        tracker = MemoryTracker()
        tracker.register_run(model, optimizer)
        tracker.listeners.append(self._watch)
        self._tracker = tracker
        tracker.__enter__()
        tracker.set_phase("forward")

    def _stop_measuring(self) -> None:
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)
            self._done_tracker = tracker
        if self._flops is not None:
            flops, self._flops = self._flops, None
            flops.__exit__(None, None, None)
            self._done_flops = flops

    def _finish_measurement(self) -> None:
        model, tracker = self._model, self._done_tracker
        total_flops = int(self._done_flops.get_total_flops())
        self.flops_per_item = total_flops / max(self.items, 1)
        device = next(model.parameters()).device
        self.peak_flops_per_s, self.peak_source = device_peak(device, self.precision)
        seen: set[int] = set()
        n_params = sum(p.numel() for p in model.parameters() if id(p) not in seen and not seen.add(id(p)))
        pm = tracker.part_max
        micro = max(self.micro, 1)
        per_micro = self.items // micro
        self.memory = MemoryReport(
            method="measured", model=type(model).__name__, precision=self.precision,
            checkpointing=checkpointing_of(model),
            optimizer=type(self._optimizer).__name__.lower() if self._optimizer is not None else "none",
            batch=self._batch_size, seq_len=per_micro // max(self._batch_size, 1) if self.unit == "tokens" else 0,
            accumulation=micro, n_params=n_params, params_bytes=pm["params"], grads_bytes=pm["grads"],
            optimizer_bytes=pm["optimizer"], master_weights_bytes=0, activations_bytes=pm["activations"],
            temporaries_bytes=tracker.peak_parts["temporaries"], peak_bytes=tracker.peak_bytes,
            peak_phase=tracker.peak_phase, peak_parts=dict(tracker.peak_parts),
            phases={k: dict(v) for k, v in tracker.phase_peaks.items() if k != "setup"},
            top_modules=fold_modules(tracker.module_activation_bytes, []),
            notes=(f"measured inside {self.tool} by trainfit's TrainfitCallback ({self.strategy}, "
                   f"{self.world_size} process(es))", *precision_notes(self.precision, n_params, pm["params"], 0)),
            wall_s=time.perf_counter() - self._t_measure, strategy=self.strategy, world_size=self.world_size,
            details={"tool": self.tool, "measured_step": self.index + 1, "flops_per_step": total_flops,
                     f"flops_per_{self.unit[:-1]}": self.flops_per_item, "peak_flops_per_s": self.peak_flops_per_s,
                     "peak_source": self.peak_source})
        if self.out is not None:  # rank 0 only (the others measure their own step but write nothing)
            write_text_atomic(self.out / MEMORY, dumps_json(self.memory.to_dict(), indent=1))
        self._done_tracker = self._done_flops = None

    _batch_size = 0

    def batch_size(self, batch: Any) -> None:
        """Samples in a micro-batch (its first tensor's leading dimension), for memory.json."""
        leaves = [x for x in torch.utils._pytree.tree_leaves(batch) if isinstance(x, torch.Tensor) and x.dim()]
        if leaves:
            self._batch_size = int(leaves[0].shape[0])


def _lines_up_to(path: Path, step: int) -> list[str]:
    """The metrics.jsonl lines of steps up to ``step`` (a resumed run keeps them); unreadable lines dropped."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    return kept


def checkpointing_of(model: nn.Module) -> str:
    """Activation checkpointing as it is switched on in the model (transformers' ``gradient_checkpointing``
    flag on each layer): none, full (every layer) or every:K (layers 0, K, 2K, ...), else "N of M layers"."""
    marked = [m for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
    inner = {id(c) for m in marked for c in m.modules() if c is not m}  # the layers, not the stack holding them
    flags = [bool(m.gradient_checkpointing) for m in marked if not any(id(c) in inner and c is not m
                                                                       for c in m.modules() if c in marked)]
    on = [i for i, f in enumerate(flags) if f]
    if not on:
        return "none"
    if len(on) == len(flags):
        return "full"
    k = on[1] - on[0] if len(on) > 1 else len(flags)
    if on == list(range(0, len(flags), k)):
        return f"every:{k}"
    return f"{len(on)} of {len(flags)} layers"
