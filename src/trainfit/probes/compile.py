"""Measure what ``--compile`` changes: the bytes a compiled step saves for backward, and its speed.

**Saved bytes** (:func:`compiled_saved_bytes`). The fake-tensor estimator cannot run compiled code, so this
probe measures on CPU. AOTAutograd's compiled function saves its tensors through ``ctx.save_for_backward``,
so ``torch.autograd.graph.saved_tensors_hooks`` sees them as it sees eager autograd's: the probe counts the
unique storages packed during one micro-batch's forward + loss (parameters apart), eager vs compiled.

The compiled run here uses a probe backend: dynamo + AOTAutograd with **inductor's partitioner**
(``min_cut_rematerialization_partition``, which decides what is saved and what the backward recomputes)
and no code generation, so what it saves is what inductor would save, with no C++ build. The same backend
records, per compiled graph, the tensors the partitioner hands to the backward (the backward graph's inputs
other than tangents, sizes from their fake tensors, traced at compile time) -- the **estimate**: those bytes
x the number of calls of each graph. Compared with the measured bytes *inside* the compiled regions (the
packs that happen while a compiled graph runs), the gap is reported, not hidden (``gap_frac``).

**Speed** (:func:`measure_compile_speedup`): eager and compiled runs of the same config stepped interleaved
(eager, compiled, eager, ...) on the same micro-batches, so machine load hits both alike; compile time apart.
The planner's ``--calibrate`` calls it for the compile speed-up it prices.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import torch

from trainfit.config import RunConfig
from trainfit.levers.compile import apply_compile
from trainfit.run import Run, build_run
from trainfit.strategies import unwrap
from trainfit.tasks.base import to_device


# ----------------------------------------------------------------- the probe backend

@dataclass
class _GraphRecord:
    saved_bytes: int = 0
    """Partitioner-saved tensors of one call of this graph, parameters excluded (bytes, from fake tensors)."""
    saved_param_bytes: int = 0
    calls: int = 0


@dataclass
class _Capture:
    graphs: list[_GraphRecord] = field(default_factory=list)
    inside: int = 0
    """> 0 while a compiled graph runs (its packs are the compiled region's)."""

    def backend(self, gm, example_inputs):
        """A ``torch.compile`` backend: AOTAutograd + min-cut partitioner, graphs run as traced (no codegen)."""
        from functorch.compile import make_boxed_func  # noqa: PLC0415 -- torch's, imported when compiling
        from torch._functorch.aot_autograd import aot_module_simplified  # noqa: PLC0415
        from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: PLC0415

        rec = _GraphRecord()
        self.graphs.append(rec)
        is_param = [isinstance(x, torch.nn.Parameter) for x in example_inputs]

        def partition(joint, joint_inputs, **kw):
            fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
            fw_nodes = {n.name: n for n in fw.graph.nodes}
            bases: dict[str, int] = {}
            for node in bw.graph.nodes:
                val = node.meta.get("val")
                if node.op != "placeholder" or node.name.startswith("tangents") or not isinstance(val, torch.Tensor):
                    continue
                base = _view_base(fw_nodes.get(node.name))  # a saved view shares its base's storage
                name = base.name if base is not None else node.name
                bval = base.meta.get("val") if base is not None else val
                bval = bval if isinstance(bval, torch.Tensor) else val
                idx = int(name.split("_")[1]) - 1 if name.startswith("primals_") else -1
                if 0 <= idx < len(is_param) and is_param[idx]:
                    rec.saved_param_bytes += 0 if name in bases else int(bval.numel()) * bval.element_size()
                    bases[name] = 0
                elif name not in bases:
                    bases[name] = int(bval.numel()) * bval.element_size()
            rec.saved_bytes = sum(bases.values())
            return fw, bw

        def nop(g, _inputs):
            return make_boxed_func(g.forward)

        compiled = aot_module_simplified(gm, example_inputs, fw_compiler=nop, bw_compiler=nop, partition_fn=partition)

        def run(*args):
            rec.calls += 1
            self.inside += 1
            try:
                return compiled(*args)
            finally:
                self.inside -= 1

        return run


_VIEW_OPS = {"view", "_unsafe_view", "reshape", "transpose", "permute", "t", "expand", "slice", "select",
             "split", "split_with_sizes", "unbind", "as_strided", "alias", "squeeze", "unsqueeze", "detach"}
"""aten ops whose output shares its input's storage: a saved view of a saved tensor costs nothing more."""


def _view_base(node):
    """The fx node whose storage ``node`` views (itself when it is no view; None for an unknown name)."""
    def op(n) -> str:
        return getattr(n.target, "__name__", str(n.target)).split(".")[0] if n.op == "call_function" else ""

    while node is not None and node.args and hasattr(node.args[0], "op"):
        parent = node.args[0]
        # getitem of a split is a view; of a multi-output op (attention's out, logsumexp) its own storage
        if op(node) in _VIEW_OPS or (op(node) == "getitem" and op(parent) in ("split", "split_with_sizes", "unbind")):
            node = parent
        else:
            break
    return node


# ----------------------------------------------------------------- saved bytes

@dataclass(frozen=True, kw_only=True)
class CompiledSavedBytes:
    """Bytes saved for backward by one micro-batch's forward + loss, eager vs compiled (parameters apart)."""

    eager_bytes: int
    """Unique storages packed by eager autograd, parameters excluded."""
    compiled_bytes: int
    """The same for the compiled run (compiled regions + the eager code around them)."""
    compiled_region_bytes: int
    """Of ``compiled_bytes``: packed while a compiled graph ran (what AOTAutograd saved)."""
    estimated_region_bytes: int
    """The partitioner's saved tensors x calls, from fake tensors at trace time (no kernel run)."""
    gap_frac: float
    """``(estimated - measured) / measured`` for the compiled regions; views and dedup explain a gap."""
    graphs: int
    calls: int
    scope: str
    micro_batch_shape: tuple[int, ...]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _measure_saved(run: Run, mb, capture: _Capture | None) -> tuple[int, int]:
    """(all, inside compiled regions) unique non-parameter storage bytes packed during forward + loss."""
    params = {p.untyped_storage().data_ptr() for p in unwrap(run.model).parameters()}
    seen: dict[int, int] = {}
    inside: set[int] = set()

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params and ptr != 0:
            seen[ptr] = st.nbytes()
            if capture is not None and capture.inside:
                inside.add(ptr)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with run.precision.autocast(run.strategy.device.type):
            loss, _ = run.task.loss(run.model, mb)
    loss.backward()
    unwrap(run.model).zero_grad(set_to_none=True)
    return sum(seen.values()), sum(seen[p] for p in inside)


def compiled_saved_bytes(cfg: RunConfig) -> CompiledSavedBytes:
    """Measure (and estimate) what one micro-batch of ``cfg`` saves for backward, eager vs compiled.

    Builds ``cfg`` twice on this process's device (compile off, then on with the probe backend; shapes
    static: one micro-batch), warms the compiled one up on the micro-batch, then measures both.
    """
    eager = build_run(dataclasses.replace(cfg, compile=False))
    ds = eager.task.dataset()
    mb = to_device(eager.task.collate([ds[i] for i in range(int(cfg.micro_batch) if cfg.micro_batch != "auto" else 8)]),
                   eager.strategy.device)
    eager_bytes, _ = _measure_saved(eager, mb, None)

    compiled = build_run(dataclasses.replace(cfg, compile=False))
    capture = _Capture()
    info = apply_compile(unwrap(compiled.model), scope=cfg.compile_scope, mode=cfg.compile_mode,
                         block_names=compiled.task.block_names(unwrap(compiled.model)),
                         device_type=compiled.strategy.device.type, backend=capture.backend, dynamic=False)
    _measure_saved(compiled, mb, capture)  # warm-up: traces and partitions
    for g in capture.graphs:
        g.calls = 0
    total, region = _measure_saved(compiled, mb, capture)
    estimate = sum(g.saved_bytes * g.calls for g in capture.graphs)
    shape = tuple(next(v for v in mb.values() if isinstance(v, torch.Tensor)).shape) if isinstance(mb, dict) else ()
    return CompiledSavedBytes(eager_bytes=eager_bytes, compiled_bytes=total, compiled_region_bytes=region,
                              estimated_region_bytes=estimate, gap_frac=(estimate - region) / region if region else 0.0,
                              graphs=len(capture.graphs), calls=sum(g.calls for g in capture.graphs),
                              scope=str(info.plan.scope), micro_batch_shape=shape)


# ----------------------------------------------------------------- speed

def measure_compile_speedup(cfg: RunConfig, reps: int = 5) -> tuple[float, float, float]:
    """Median eager and compiled optimizer-step seconds, measured interleaved, and the compile seconds.

    Both runs step the same window (``cfg.accumulation`` micro-batches of ``cfg.micro_batch``) from the same
    initial weights; the compiled run's backend is the lever's (inductor, or ``TRAINFIT_COMPILE_BACKEND``).
    ``compile_s`` is the compiled run's first step less its median steady step. Single process.

    Returns:
        ``(eager_step_s, compiled_step_s, compile_s)``.
    Raises:
        ConfigError: as ``build_run`` (e.g. no C++ compiler for inductor on CPU).
    """
    if reps < 1:
        raise ValueError("measure_compile_speedup: reps >= 1")
    eager = build_run(dataclasses.replace(cfg, compile=False))
    compiled = build_run(dataclasses.replace(cfg, compile=True))
    ds = eager.task.dataset()
    m = int(cfg.micro_batch) if cfg.micro_batch != "auto" else 8
    window = [to_device(eager.task.collate([ds[(j * m + i) % len(ds)] for i in range(m)]), eager.strategy.device)
              for j in range(cfg.accumulation)]

    def timed(run: Run) -> float:
        _sync(run)
        t0 = time.perf_counter()
        run.step(window)
        _sync(run)
        return time.perf_counter() - t0

    timed(eager)  # warm-up: allocator, lazy init
    first = timed(compiled)  # traces and compiles every graph
    e, c = [], []
    for _ in range(reps):
        e.append(timed(eager))
        c.append(timed(compiled))
    eager_s, compiled_s = statistics.median(e), statistics.median(c)
    return eager_s, compiled_s, max(0.0, first - compiled_s)


def _sync(run: Run) -> None:
    if run.strategy.device.type == "cuda":
        torch.cuda.synchronize(run.strategy.device)  # host-device sync: the step's kernels are done


__all__ = ["CompiledSavedBytes", "compiled_saved_bytes", "measure_compile_speedup"]
