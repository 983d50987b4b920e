"""The memory tracker: a dispatch mode that follows every live tensor *storage*.

Every aten op passes through :meth:`MemoryTracker.__torch_dispatch__`; each storage it sees
(input or output) is recorded once, keyed by the storage itself (views and shared weights
share one storage, so they count once), with its size and the part it belongs to:

- ``params``       parameters and buffers of the model
- ``grads``        ``.grad`` of the parameters and of the optimizer's tensors (fp32 master grads)
- ``optimizer``    optimizer state and fp32 master weights
- ``activations``  tensors saved for backward (tagged by a ``saved_tensors_hooks`` pack hook)
- ``temporaries``  everything else (op outputs not saved, the batch, loss, scratch)

Each storage is also on the **device** or on the **host**: host when a lever marked the tensor
(:func:`mark_host`; e.g. the offload lever's fp32 copies and gradient buffers), when it is the
gradient or optimizer state of a host tensor, when a lever packed it for backward on the host
(:func:`note_saved`), or when it is a CPU tensor while the run's parameters are on an accelerator.
Marking, not the tensor's device alone, decides: on a CPU-only machine both sides are "cpu", and the
split must still follow the lever's placement. ``host_part_max`` / ``device_part_max`` and
``device_peak_bytes`` / ``host_peak_bytes`` (with their ``*_peak_parts``) give the split.

A storage is dropped once it is freed; the tracker notices on the next op (it holds a
weak reference to the storage, which does not keep its memory alive). Works with real,
fake (``FakeTensorMode``) and meta tensors, and counts a DTensor by its local shard, so
per-rank bytes are right under sharding.

Cost: one Python call per aten op plus a sweep over the non-persistent storages per op
(``exact=True``); the cap-only mode sweeps only when the running upper bound crosses the
cap, so it is cheap enough to leave on during training.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from itertools import compress
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from trainfit.vocabulary import PARTS

PHASES = ("setup", "forward", "backward", "optimizer")
_PERSISTENT = ("params", "optimizer")  # rarely freed: swept at phase changes only
_aten = torch.ops.aten
HOST_ATTR = "_trainfit_host"
"""Attribute a lever sets on a tensor it keeps in host memory (:func:`mark_host`)."""


def mark_host(tensors: Iterable[torch.Tensor]) -> None:
    """Mark tensors (and, for a DTensor, its local shard) as living in host memory, for the tracker.

    Their ``.grad`` and the optimizer state of a marked parameter count as host too.
    """
    for t in tensors:
        setattr(t, HOST_ATTR, True)
        inner = getattr(t, "_local_tensor", None)
        if isinstance(inner, torch.Tensor):
            setattr(inner, HOST_ATTR, True)


def _active() -> list[MemoryTracker]:
    return [m for m in _get_current_dispatch_mode_stack() if isinstance(m, MemoryTracker)]


@contextlib.contextmanager
def host_scope() -> Iterator[None]:
    """Storages that ops create inside count as host memory (a lever's host-side work: the optimizer step it runs on
    the host, the copies it packs for backward). On a GPU they are CPU tensors anyway; on a CPU-only
    machine this is what tells them apart."""
    trackers = _active()
    for tr in trackers:
        tr._host_depth += 1
    try:
        yield
    finally:
        for tr in trackers:
            tr._host_depth -= 1


def note_saved(t: torch.Tensor, *, host: bool) -> None:
    """Tell each active tracker that ``t`` was saved for backward.

    A lever whose ``saved_tensors_hooks`` replace the tracker's own (the innermost hooks win; e.g. the
    activation offload packs to the host) calls this from its pack hook, so activations stay counted,
    on the side the lever put them."""
    for tr in _active():
        if tr.classify:
            tr._pack(t, host=host)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory on this rank: a DTensor's local shard, else ``t``."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


_expired = torch.UntypedStorage._expired  # the check StorageWeakRef.expired() wraps, minus a call
_storage_of = torch.UntypedStorage._new_with_weak_ptr  # a live storage from its weakly held cdata


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """Tensors in op arguments/outputs (flat lists and tuples; cheaper than a pytree walk)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                yield y
            elif isinstance(y, (list, tuple)):
                yield from _tensors(y)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return local_tensor(t).untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Entry:
    __slots__ = ("ref", "nbytes", "part", "host")

    def __init__(self, ref: StorageWeakRef, nbytes: int, part: str, host: bool) -> None:
        self.ref, self.nbytes, self.part, self.host = ref, nbytes, part, host


def _scalar_stub(t: torch.Tensor) -> Any:
    """A value for ``.item()`` on a fake tensor: the healthy path (finite loss, no overflow)."""
    if t.dtype == torch.bool:
        return False  # "any NaN?", "any sample rejected?" -> no (loops such as trunc_normal_'s end)
    if t.is_floating_point():
        return 0.0  # loss / overflow flag / norm: finite and "no inf found"
    return 1  # counts


def _item(func, args, kwargs) -> Any:
    """``.item()`` (``_local_scalar_dense``) under fake tensors: the value where the fake tensor knows it."""
    try:  # a fake tensor that knows its value (a constant, e.g. Adam's step count)
        return func(*args, **kwargs)
    except Exception:  # data-dependent: the value is unknowable without running
        return _scalar_stub(args[0])


class ScalarStubs(TorchDispatchMode):
    """Answers ``.item()`` on a fake tensor with the healthy path's value (:func:`_scalar_stub`) where the value
    is unknowable, and counts nothing: for the fake steps whose memory is not measured (a model's init, the
    estimator's warm-up), at a fraction of a tracker's cost per op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            return _item(func, args, kwargs)
        return func(*args, **kwargs)


class MemoryTracker(TorchDispatchMode):
    """Counts live tensor bytes per part and phase; optionally raises above a cap.

    Args:
        cap_bytes: when > 0, raise ``torch.OutOfMemoryError`` as soon as the live tracked
            *device* bytes exceed it (a CPU stand-in for a device limit; used by auto-fit). Host
            storages (offload) do not count against it.
        exact: sweep freed storages after every op (exact peak and parts). With False,
            sweep only when the running upper bound crosses the peak or the cap.
        classify: tag activations (saved for backward) and attribute them to modules.
        stub_scalars: answer ``.item()`` with a stub value (needed under fake tensors).
    """

    def __init__(self, *, cap_bytes: int = 0, exact: bool = True, classify: bool = True,
                 stub_scalars: bool = False) -> None:
        super().__init__()
        self.cap_bytes = cap_bytes
        self.exact = exact
        self.classify = classify
        self.stub_scalars = stub_scalars
        self._entries: dict[int, _Entry] = {}
        self._volatile: set[int] = set()
        self.totals = dict.fromkeys(PARTS, 0)
        self.live_bytes = 0
        self.phase = "setup"
        self.peak_bytes = 0
        self.peak_phase = "setup"
        self.peak_parts = dict(self.totals)
        self.part_max = dict(self.totals)
        self.phase_peaks: dict[str, dict[str, int]] = {}
        self.module_activation_bytes: dict[str, int] = {}
        self._module_names: dict[int, str] = {}
        self._module_stack: list[str] = []
        self._grad_holders: list[torch.Tensor] = []
        self._grads_seen: list[weakref.ref | None] = []  # per holder: the .grad last classified
        self._stack = contextlib.ExitStack()
        self.listeners: list[Any] = []  # callables(tracker) after each op (e.g. segment labels)
        self.track_resizes = False
        """Re-read sizes on every sweep; switched on by register_run for models with DTensor (FSDP2) params."""
        self.device_type: str | None = None
        """The run's device type (from its unmarked parameters); a CPU tensor is host when it is not "cpu"."""
        self.host_totals = dict.fromkeys(PARTS, 0)
        self.host_live_bytes = 0
        self.host_part_max = dict(self.totals)
        """Each part's largest live bytes in host memory."""
        self.device_part_max = dict(self.totals)
        """Each part's largest live bytes on the device (kept once a host storage was seen; else part_max)."""
        self.device_peak_bytes = 0
        """Largest live device bytes (equals peak_bytes when nothing is on the host)."""
        self.device_peak_parts = dict(self.totals)
        self.host_peak_bytes = 0
        self.host_peak_parts = dict(self.totals)
        self._host_seen = False
        self._host_depth = 0  # > 0 inside host_scope()
        self._cpu_is_host = False  # the run is on an accelerator: a CPU tensor is host memory

    # ---- registration -------------------------------------------------------------
    def register(self, tensors: Iterable[torch.Tensor | None], part: str) -> None:
        """Classify existing tensors (re-classifies a storage already seen)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t, part, force=True)

    def register_run(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                     optimizer_params: Iterable[torch.Tensor] = ()) -> None:
        """Classify a model's parameters/buffers/grads and the optimizer's state and masters."""
        params = list(model.parameters())
        ids = {id(p) for p in params}
        extra = [t for t in optimizer_params if id(t) not in ids]  # fp32 master copies
        buffers = list(model.buffers())
        self.device_type = next((local_tensor(t).device.type for t in params + buffers
                                 if not getattr(t, HOST_ATTR, False)), None)
        self._cpu_is_host = self.device_type not in (None, "cpu")
        self.register(params, "params")
        self.register(buffers, "params")
        self.register(extra, "optimizer")
        if optimizer is not None:
            for p, st in optimizer.state.items():  # the state lives where its parameter does
                host = self._on_host(p) if isinstance(p, torch.Tensor) else None
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        self._add(v, "optimizer", force=True, host=host or None)
        self._grad_holders = params + extra
        self._grads_seen = [None] * len(self._grad_holders)
        self.track_resizes = any(local_tensor(p) is not p for p in params)  # FSDP2 shards: DTensors
        for t in self._grad_holders:
            if t.grad is not None:
                self._add(t.grad, "grads", force=True, host=self._grad_host(t))
        self._module_names = {id(m): n for n, m in model.named_modules()}

    def _on_host(self, t: torch.Tensor) -> bool:
        if getattr(t, HOST_ATTR, False):
            return True
        lt = local_tensor(t)
        if lt is not t and getattr(lt, HOST_ATTR, False):
            return True
        return self._cpu_is_host and lt.device.type == "cpu"

    def _see_host(self) -> None:
        if not self._host_seen:  # everything so far was on the device
            self._host_seen = True
            self.device_part_max = dict(self.part_max)
            self.device_peak_bytes, self.device_peak_parts = self.peak_bytes, dict(self.peak_parts)

    def _grad_host(self, holder: torch.Tensor) -> bool | None:
        """A gradient is host when its parameter is (True), else decided by the gradient itself (None)."""
        return True if self._on_host(holder) else None

    def _add(self, t: torch.Tensor, part: str, *, force: bool = False, host: bool | None = None) -> _Entry | None:
        key = _storage_key(t)
        if key is None:
            return None
        e = self._entries.get(key)
        if e is None:
            storage = local_tensor(t).untyped_storage()
            on_host = self._on_host(t) if host is None else host
            # The weak reference keeps the key (the StorageImpl address) from being reused while tracked.
            e = self._entries[key] = _Entry(StorageWeakRef(storage), storage.nbytes(), part, on_host)
            self.totals[part] += e.nbytes
            self.live_bytes += e.nbytes
            if on_host:
                self._see_host()
                self.host_totals[part] += e.nbytes
                self.host_live_bytes += e.nbytes
        else:
            if force and e.part != part:
                self._move(e, part)
            if host and not e.host:  # first seen as an op's output, then marked by a lever
                self._see_host()
                e.host = True
                self.host_totals[e.part] += e.nbytes
                self.host_live_bytes += e.nbytes
        if e.part in _PERSISTENT:
            self._volatile.discard(key)
        else:
            self._volatile.add(key)
        return e

    def _move(self, e: _Entry, part: str) -> None:
        self.totals[e.part] -= e.nbytes
        self.totals[part] += e.nbytes
        if e.host:
            self.host_totals[e.part] -= e.nbytes
            self.host_totals[part] += e.nbytes
        e.part = part

    def _grow(self, e: _Entry, n: int) -> None:
        """The storage of ``e`` now holds ``n`` bytes (resized in place)."""
        self.totals[e.part] += n - e.nbytes
        self.live_bytes += n - e.nbytes
        if e.host:
            self.host_totals[e.part] += n - e.nbytes
            self.host_live_bytes += n - e.nbytes
        e.nbytes = n

    def _sweep(self, keys: Iterable[int]) -> None:
        # key: the storage's cdata, held weakly; the expired ones found in one pass without a Python loop (it runs
        # after every op, and most ops free nothing)
        for key in list(compress(keys, map(_expired, keys))):
            e = self._entries.pop(key)
            self._volatile.discard(key)
            self.totals[e.part] -= e.nbytes
            self.live_bytes -= e.nbytes
            if e.host:
                self.host_totals[e.part] -= e.nbytes
                self.host_live_bytes -= e.nbytes
        if self.track_resizes:
            self._refresh_sizes(keys)

    def _refresh_sizes(self, keys: Iterable[int]) -> None:
        """Re-read storage sizes. FSDP2 frees and regrows gathered parameters with
        ``untyped_storage().resize_()``, which no dispatch mode sees; costs ~0.4 us per storage."""
        for key in list(keys):
            e = self._entries[key]
            n = _storage_of(key).nbytes()
            if n != e.nbytes:
                self._grow(e, n)

    def sweep_all(self) -> None:
        self._sweep(self._entries)

    def _refresh_grads(self) -> None:
        """Classify each holder's ``.grad`` as grads (an assigned gradient, e.g. an fp32 master's, is seen by no
        hook). A holder whose ``.grad`` is the very tensor already classified is skipped: the check runs after
        every optimizer-phase op, and re-reading every storage made it most of that phase's cost."""
        entries, seen = self._entries, self._grads_seen
        with torch._C.DisableTorchFunction():  # .grad is a torch function: no mode needs to see these reads
            for i, t in enumerate(self._grad_holders):
                g = t.grad
                if g is None:
                    continue
                ref = seen[i]
                if ref is not None and ref() is g:
                    continue
                e = entries.get(_storage_key(g))
                if e is None or e.part != "grads":
                    e = self._add(g, "grads", host=self._grad_host(t))
                    if e is not None and e.part != "grads":
                        self._move(e, "grads")
                seen[i] = weakref.ref(g) if e is not None else None  # weak: a dropped gradient is freed

    # ---- phases and peaks ---------------------------------------------------------
    def set_phase(self, phase: str) -> None:
        assert phase in PHASES, phase
        if phase != self.phase:
            self.phase = phase
            self.sweep_all()
            self._refresh_grads()
            self._record()

    def _current_phase(self) -> str:
        # Inside autograd's engine (backward, incl. checkpoint recompute) the graph task id is set.
        return "backward" if torch._C._current_graph_task_id() != -1 else self.phase

    def _record(self) -> None:
        live = self.live_bytes
        phase = self._current_phase()
        for p in PARTS:
            if self.totals[p] > self.part_max[p]:
                self.part_max[p] = self.totals[p]
        pk = self.phase_peaks.get(phase)
        if pk is None or live > pk["peak"]:
            self.phase_peaks[phase] = {"peak": live, **self.totals}
        if live > self.peak_bytes:
            self.peak_bytes, self.peak_phase, self.peak_parts = live, phase, dict(self.totals)
        if self._host_seen:
            self._record_split(live)

    def _record_split(self, live: int) -> None:
        host, totals, host_totals = self.host_live_bytes, self.totals, self.host_totals
        for p in PARTS:
            if host_totals[p] > self.host_part_max[p]:
                self.host_part_max[p] = host_totals[p]
            if totals[p] - host_totals[p] > self.device_part_max[p]:
                self.device_part_max[p] = totals[p] - host_totals[p]
        if live - host > self.device_peak_bytes:
            self.device_peak_bytes = live - host
            self.device_peak_parts = {p: totals[p] - host_totals[p] for p in PARTS}
        if host > self.host_peak_bytes:
            self.host_peak_bytes, self.host_peak_parts = host, dict(host_totals)

    def host_split(self) -> dict[str, Any]:
        """Device vs host, as :class:`~trainfit.results.MemoryReport`'s fields: ``{}`` when nothing was on the host.

        ``host_bytes`` / ``device_bytes``: each part's largest live bytes on that side; ``device_peak_bytes``:
        the largest live device bytes (the split at that moment: ``device_peak_parts``; the host side's
        peak: ``host_peak_bytes`` / ``host_peak_parts``). ``MemoryReport(..., **tracker.host_split())``.
        """
        if not self._host_seen:
            return {}
        return {"host_bytes": dict(self.host_part_max), "device_bytes": dict(self.device_part_max),
                "device_peak_bytes": self.device_peak_bytes}

    # ---- the dispatch mode --------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and self.stub_scalars:
            return _item(func, args, kwargs)
        out = func(*args, **kwargs)
        entries = self._entries
        for t in _tensors(args):
            if _storage_key(t) not in entries:
                self._add(t, "temporaries")  # created before tracking began (e.g. the batch)
        for t in _tensors(tuple(kwargs.values())):
            if _storage_key(t) not in entries:
                self._add(t, "temporaries")
        if "resize" in func.__name__:  # storage resized in place (FSDP2 frees/regrows params this way)
            self._resize(args[0])
        for t in _tensors(out):  # new storages: never marked yet, so only the scope and the device decide
            if _storage_key(t) not in entries:
                host = bool(self._host_depth) or (self._cpu_is_host and t.device.type == "cpu")
                self._add(t, "temporaries", host=host)
        self._after_op()
        return out

    def _resize(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        e = self._entries.get(_storage_key(t))
        if e is not None:
            self._grow(e, local_tensor(t).untyped_storage().nbytes())

    def _after_op(self) -> None:
        if self.classify and self.phase == "optimizer":
            self._refresh_grads()  # fp32 master grads are assigned (not accumulated) here
        if self.exact:
            self._sweep(self._volatile)
            self._record()
        elif self.live_bytes > self.peak_bytes or (self.cap_bytes and self.live_bytes - self.host_live_bytes
                                                   > self.cap_bytes):
            self.sweep_all()
            self._record()
        for fn in self.listeners:
            fn(self)
        if self.cap_bytes and self.live_bytes - self.host_live_bytes > self.cap_bytes:
            live = self.live_bytes - self.host_live_bytes
            raise torch.OutOfMemoryError(
                f"trainfit memory cap: {live:,} live bytes exceed memory_cap={self.cap_bytes:,} "
                f"(in {self._current_phase()}); lower micro_batch or enable checkpointing")

    # ---- activation tagging -------------------------------------------------------
    def _pack(self, t: torch.Tensor, host: bool | None = None) -> torch.Tensor:
        e = self._add(t, "temporaries", host=host or None)
        if e is not None and e.part == "temporaries":
            self._move(e, "activations")
            self._volatile.add(e.ref.cdata)
            name = self._module_stack[-1] if self._module_stack else "<outside modules>"
            self.module_activation_bytes[name] = self.module_activation_bytes.get(name, 0) + e.nbytes
        return t

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        name = self._module_names.get(id(module))
        if name is not None:
            self._module_stack.append(name)

    def _post_hook(self, module: nn.Module, args: Any, out: Any) -> None:
        name = self._module_names.get(id(module))
        if name is not None and self._module_stack and self._module_stack[-1] == name:
            self._module_stack.pop()

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            e = self._add(p.grad, "grads", host=self._grad_host(p))
            if e is not None and e.part != "grads":
                self._move(e, "grads")
            if e is not None:
                self._volatile.add(e.ref.cdata)
            if self.exact:  # the part maxima changed (the last grad may come after the last op)
                self._sweep(self._volatile)  # frees since the last op, so no stale bytes are recorded
                self._record()

    # ---- context ------------------------------------------------------------------
    def __enter__(self) -> MemoryTracker:
        st = self._stack
        if self.classify:
            st.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t))
            h1 = nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
            h2 = nn.modules.module.register_module_forward_hook(self._post_hook, always_call=True)
            st.callback(h1.remove)
            st.callback(h2.remove)
            for t in self._grad_holders:
                if t.requires_grad and t.is_leaf:
                    st.callback(t.register_post_accumulate_grad_hook(self._on_grad).remove)
        super().__enter__()
        self._record()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._stack.close()
            self._module_stack.clear()


@contextlib.contextmanager
def memory_cap(cap_bytes: int, *, model: nn.Module | None = None, optimizer=None,
               optimizer_params: Iterable[torch.Tensor] = ()) -> Iterator[MemoryTracker]:
    """Raise ``torch.OutOfMemoryError`` when live tracked bytes exceed ``cap_bytes``.

    Cheap mode (no classification, lazy sweeps). Pass the model and optimizer so their
    resident bytes count from the start.
    """
    tracker = MemoryTracker(cap_bytes=cap_bytes, exact=False, classify=False)
    if model is not None:
        tracker.register_run(model, optimizer, optimizer_params)
    with tracker:
        yield tracker
