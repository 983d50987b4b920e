"""The memory report (pure): the four parts plus temporaries, the peak, and what to do about it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainfit.units import fmt_bytes
from trainfit.vocabulary import PART_LABELS, PARTS, PrecisionName, precision_facts

# Which lever targets which part (one table; the planner has the full compatibility rules).
LEVERS: dict[str, str] = {
    "params": "store weights in half precision (--precision bf16-true) or shard them (--strategy zero3)",
    "grads": "shard gradients (--strategy zero2/zero3) or use half-precision weights (bf16-true)",
    "optimizer": "shard optimizer state (--strategy zero1/zero2/zero3) or use a stateless optimizer (sgd)",
    "activations": "activation checkpointing (--checkpointing full) or a smaller micro-batch with accumulation",
    "temporaries": "a smaller micro-batch (temporaries scale with it) or a shorter sequence",
}



@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """What fills memory during one optimizer step (the second, so optimizer state exists).

    The part fields are each part's *largest* live bytes during the step; ``peak_parts``
    splits ``peak_bytes`` at the moment of the peak (its values sum to ``peak_bytes``).
    """

    method: str
    """"measured" (real tensors) or "estimated" (fake tensors, nothing allocated)."""
    model: str
    precision: str
    checkpointing: str
    optimizer: str
    batch: int
    """Samples in the micro-batch."""
    seq_len: int
    accumulation: int
    n_params: int
    """Parameters of the model (shared ones once)."""
    params_bytes: int
    """Parameters and buffers, as stored (fp32 under bf16-mixed; half under bf16-true)."""
    grads_bytes: int
    """Gradients, including the fp32 gradients of master weights."""
    optimizer_bytes: int
    """Optimizer state (e.g. Adam's two moments) plus fp32 master weights where the precision keeps them."""
    master_weights_bytes: int
    """The fp32 master copy alone (part of optimizer_bytes; 0 unless bf16-true/fp16-true)."""
    activations_bytes: int
    """Tensors saved for backward, at their largest (end of forward, usually)."""
    temporaries_bytes: int
    """Everything else live at the peak: op outputs not saved, the batch, the loss, scratch."""
    peak_bytes: int
    peak_phase: str
    """forward, backward or optimizer."""
    peak_parts: Mapping[str, int]
    """The split of peak_bytes by part at the moment of the peak."""
    phases: Mapping[str, Mapping[str, int]]
    """Per phase: its peak ("peak") and the split by part at that moment."""
    top_modules: tuple[tuple[str, int], ...]
    """Modules by activation bytes saved in their own forward (repeated blocks folded to ``*``)."""
    notes: tuple[str, ...] = ()
    device_max_allocated_bytes: int | None = None
    """torch.cuda.max_memory_allocated over the measured step (None off GPU or when estimated)."""
    device_max_reserved_bytes: int | None = None
    wall_s: float = 0.0
    """Seconds to produce this report."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """How the numbers were obtained (e.g. the block shortcut: traced layer counts)."""

    def __post_init__(self) -> None:
        for name in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                     "temporaries_bytes", "peak_bytes", "n_params", "master_weights_bytes"):
            assert getattr(self, name) >= 0, (name, getattr(self, name))

    @property
    def parts(self) -> dict[str, int]:
        return {p: getattr(self, f"{p}_bytes") for p in PARTS}

    @property
    def dominant_part(self) -> str:
        """The part holding the most bytes at the peak."""
        return max(PARTS, key=lambda p: self.peak_parts.get(p, 0))

    @property
    def lever_line(self) -> str:
        part = self.dominant_part
        share = self.peak_parts.get(part, 0) / max(self.peak_bytes, 1)
        return f"largest part at the peak: {PART_LABELS[part]} ({share:.0%}); lever: {LEVERS[part]}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["peak_parts"] = dict(self.peak_parts)
        d["phases"] = {k: dict(v) for k, v in self.phases.items()}
        d["top_modules"] = [{"module": n, "activations_bytes": b} for n, b in self.top_modules]
        d["notes"] = list(self.notes)
        d["dominant_part"] = self.dominant_part
        d["lever"] = LEVERS[self.dominant_part]
        return d


def precision_notes(precision: str, n_params: int, params_bytes: int, master_bytes: int) -> tuple[str, ...]:
    """Say in words what the precision did to parameter memory (measured, not assumed)."""
    if n_params == 0:
        return ()
    per = params_bytes / n_params
    facts = precision_facts(precision)
    if facts.autocast:
        return (f"{precision}: weights stay fp32 under autocast ({per:.2f} B/param), so parameter memory is "
                f"NOT halved; only activations shrink. Use {PrecisionName.BF16_TRUE} to halve weights.",)
    if facts.master_copy:
        return (f"{precision}: weights stored in half precision ({per:.2f} B/param, parameter memory halved), "
                f"but the fp32 master copy adds {fmt_bytes(master_bytes)} "
                f"({master_bytes / n_params:.2f} B/param) to optimizer state.",)
    return ()


def fold_block_name(name: str, block_names: list[str]) -> str:
    """``layers.3.mlp`` -> ``layers.*.mlp`` when ``layers.3`` is a repeated block."""
    for b in block_names:
        if name == b or name.startswith(b + "."):
            head, _, idx = b.rpartition(".")
            if idx.isdigit():
                return (head + "." if head else "") + "*" + name[len(b):]
    return name


def fold_modules(per_module: Mapping[str, int], block_names: list[str], top: int = 10) -> tuple[tuple[str, int], ...]:
    folded: dict[str, int] = {}
    for name, b in per_module.items():
        key = fold_block_name(name, block_names)
        folded[key] = folded.get(key, 0) + b
    ranked = sorted(folded.items(), key=lambda kv: (-kv[1], kv[0]))
    return tuple(ranked[:top])
