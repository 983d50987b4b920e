"""``--compile``: run the model's forward (and, through AOTAutograd, its backward) as ``torch.compile`` graphs.

Pure core: :func:`plan_compile` decides *what* is compiled from the scope and the task's block names --
each repeated block on its own (torchtitan's pattern: the blocks share one code object, so one graph is
traced and reused by every block, and compile time is one block's), or the whole model as one graph. A
model without blocks under ``blocks`` compiles the whole model and the decision says so (``note``).

Thin torch shell: :func:`apply_compile` replaces each chosen module's ``forward`` with a compiled one (an
instance attribute, as :mod:`trainfit.levers.checkpointing` does). So the module tree and state-dict keys
are unchanged (no ``_orig_mod.`` prefix; checkpoints load with or without compile), and ``nn.Module.__call__``
with its hooks -- FSDP2's all-gather and reshard, DDP's -- stays eager around the graph. Order in
``run.build_run``: checkpointing (its ``checkpoint`` call is traced as one higher-order op inside the graph),
precision, then compile, then ``strategy.wrap`` (torchtitan: AC -> compile -> fully_shard).

Shapes: batches are padded per micro-batch (the sequence length varies) and a window's last micro-batch
may be shorter, so graphs are compiled with symbolic shapes from the first call (``dynamic=True``): one
compile covers every batch size and length >= 2. Size 1 is specialised by torch (a micro-batch of one
sample, or ``model.eval()`` / ``no_grad`` for evaluation) and compiles one more graph, once.
:meth:`CompileInfo.graphs` counts the graphs compiled since the lever was applied, so a run can prove
it did not recompile after warm-up.

Backend: ``inductor`` (torch's default). On CPU it builds C++ with the system compiler
(``torch._inductor.config.cpp.cxx``); when none is on ``PATH`` :func:`check_backend` refuses with one
line. ``TRAINFIT_COMPILE_BACKEND`` (read here only; tests set it to ``aot_eager``: dynamo + AOTAutograd,
no C++ build) chooses another registered backend -- a testing escape, not a user setting.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainfit.errors import ConfigError
from trainfit.vocabulary import CompileMode, CompileScope

BACKEND_ENV = "TRAINFIT_COMPILE_BACKEND"
"""Environment variable naming a ``torch.compile`` backend other than inductor (tests: ``aot_eager``)."""

DEFAULT_BACKEND = "inductor"


# ----------------------------------------------------------------- pure core

@dataclass(frozen=True, kw_only=True)
class CompilePlan:
    """What is compiled, decided before touching the model."""

    scope: CompileScope
    """The scope that was applied (``model`` when ``blocks`` found none)."""
    targets: tuple[str, ...]
    """Qualified module names whose ``forward`` is compiled ("" is the root model)."""
    note: str = ""
    """Why the applied scope differs from the one asked for ("" when it does not)."""

    def __post_init__(self) -> None:
        if not self.targets:
            raise ValueError("CompilePlan.targets: at least one module is compiled")


def plan_compile(scope: CompileScope, block_names: Sequence[str]) -> CompilePlan:
    """Decide what to compile (pure).

    Args:
        scope: ``blocks`` (each repeated block) or ``model`` (the root as one graph).
        block_names: the task's repeated blocks, outermost, in order.
    Returns:
        The plan; under ``blocks`` with no blocks, the whole model with a note saying so.
    """
    scope = CompileScope(scope)
    if scope == CompileScope.MODEL:
        return CompilePlan(scope=scope, targets=("",))
    # Outermost only: a compiled parent already traces its children.
    outer = [b for b in block_names if not any(b != p and b.startswith(p + ".") for p in block_names)]
    if not outer:
        return CompilePlan(scope=CompileScope.MODEL, targets=("",),
                           note="compile_scope=blocks: the model has no repeated blocks; compiled the whole model")
    return CompilePlan(scope=scope, targets=tuple(outer))


def backend_name() -> str:
    """The ``torch.compile`` backend: inductor, or the one ``TRAINFIT_COMPILE_BACKEND`` names (tests)."""
    return os.environ.get(BACKEND_ENV, "").strip() or DEFAULT_BACKEND


def cpp_compilers() -> tuple[str, ...]:
    """The C++ compilers inductor's CPU backend looks for (``torch._inductor.config.cpp.cxx``; ``None``
    entries mean "fetch one with conda", which needs a network and is not counted here)."""
    from torch._inductor import config as inductor_config  # noqa: PLC0415 -- torch's own module, not trainfit

    cxx = inductor_config.cpp.cxx
    names = cxx if isinstance(cxx, (list, tuple)) else (cxx,)
    return tuple(n for n in names if n)


def check_backend(backend: str, device_type: str, *, which=None) -> None:
    """Refuse, in one line, a compile that cannot build its kernels here.

    Only inductor on CPU builds C++; other backends and CUDA (Triton) need no system compiler.

    Raises:
        ConfigError: inductor on CPU and none of its C++ compilers is on ``PATH``.
    """
    if backend != "inductor" or device_type != "cpu":
        return
    which = which or shutil.which  # looked up at call time (tests replace it)
    names = cpp_compilers()
    if not any(which(n) for n in names):
        looked = ", ".join(names) or "none configured"
        raise ConfigError("compile", "on", f"a C++ compiler for inductor's CPU backend (looked for: {looked})",
                          "install one (e.g. apt-get install g++), point CXX at it, or run without --compile")


def check_mode(mode: CompileMode, device_type: str) -> None:
    """CUDA graphs (reduce-overhead, max-autotune) exist on CUDA only: refuse them elsewhere rather than
    let torch quietly skip them.

    Raises:
        ConfigError: a CUDA-graph mode on a device that has none.
    """
    if mode in (CompileMode.REDUCE_OVERHEAD, CompileMode.MAX_AUTOTUNE) and device_type != "cuda":
        raise ConfigError("compile_mode", mode, "default or max-autotune-no-cudagraphs on " + device_type,
                          f"{mode} records CUDA graphs, which only CUDA devices have")


# ----------------------------------------------------------------- counting

def graphs_compiled_total() -> int:
    """Graphs dynamo compiled in this process so far (its ``unique_graphs`` counter; a recompile is one
    more). Process-wide: :class:`CompileInfo` keeps the value at apply time and reports the difference."""
    from torch._dynamo.utils import counters  # noqa: PLC0415 -- torch's own module, imported on use: dynamo is heavy

    return int(counters["stats"]["unique_graphs"])


def graph_breaks_total() -> int:
    """Graph breaks dynamo met in this process so far (each splits a compiled region in two)."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    return int(sum(counters["graph_break"].values()))


@dataclass(frozen=True, kw_only=True)
class CompileInfo:
    """What ``--compile`` did to a run, and how many graphs it has compiled since."""

    plan: CompilePlan
    backend: str
    mode: CompileMode
    dynamic: bool = True
    """Symbolic shapes from the first call (see the module docstring)."""
    graphs_at_start: int = 0
    breaks_at_start: int = 0

    def graphs(self) -> int:
        """Graphs compiled since the lever was applied (process-wide counter: another compiled run stepped in
        between would count too). Steady after warm-up: any increase is a recompilation."""
        return graphs_compiled_total() - self.graphs_at_start

    def graph_breaks(self) -> int:
        """Graph breaks met since the lever was applied (0 for the built-in models)."""
        return graph_breaks_total() - self.breaks_at_start

    def to_dict(self) -> dict:
        return {"scope": str(self.plan.scope), "targets": list(self.plan.targets), "note": self.plan.note,
                "backend": self.backend, "mode": str(self.mode), "dynamic": self.dynamic,
                "graphs": self.graphs(), "graph_breaks": self.graph_breaks()}


# ----------------------------------------------------------------- torch shell

def apply_compile(model: nn.Module, *, scope: CompileScope, mode: CompileMode, block_names: Sequence[str],
                  device_type: str, backend=None, dynamic: bool = True, memory_cap: int = 0) -> CompileInfo:
    """Compile ``model`` in place (lazily: tracing happens at the first forward); returns what was done.

    Call after activation checkpointing and ``precision.prepare`` and before ``strategy.wrap``.

    Args:
        backend: a registered backend name or a backend callable (probes/compile.py's); default
            :func:`backend_name`.
        dynamic: symbolic shapes from the first call (the run's); a probe of one shape passes False.
        memory_cap: the run's ``--memory-cap`` (refused with compile, see Raises).

    Raises:
        ConfigError: no C++ compiler for inductor on CPU; a CUDA-graph mode off CUDA; ``--memory-cap``
            (its tracker steps every step under a TorchDispatchMode, and dynamo does not compile a frame while
            one is active: the run would quietly be eager -- measured: 0 graphs).
    """
    if memory_cap:
        raise ConfigError("compile", "on", "off with --memory-cap",
                          "the cap tracks every step under a TorchDispatchMode, under which dynamo compiles nothing "
                          "(the steps would run eagerly); drop --memory-cap or --compile")
    backend = backend or backend_name()
    check_backend(backend, device_type)
    check_mode(CompileMode(mode), device_type)
    plan = plan_compile(scope, block_names)
    modules = dict(model.named_modules())
    # inductor takes ``mode``; other backends (aot_eager) take none.
    kw = {"mode": str(mode)} if backend == "inductor" and mode != CompileMode.DEFAULT else {}
    label = backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")
    info = CompileInfo(plan=plan, backend=label, mode=CompileMode(mode), dynamic=dynamic,
                       graphs_at_start=graphs_compiled_total(), breaks_at_start=graph_breaks_total())
    for name in plan.targets:
        mod = modules[name]
        if getattr(mod, "_trainfit_compiled", False):
            continue
        # The bound (maybe checkpointed) forward, compiled: every block's forward shares Block.forward's code,
        # so dynamo reuses one graph for all of them (parameters are graph inputs, not constants).
        mod.forward = torch.compile(mod.forward, backend=backend, dynamic=dynamic, **kw)
        mod._trainfit_compiled = True
    return info


__all__ = ["BACKEND_ENV", "CompileInfo", "CompilePlan", "apply_compile", "backend_name", "check_backend",
           "check_mode", "cpp_compilers", "graph_breaks_total", "graphs_compiled_total", "plan_compile"]
