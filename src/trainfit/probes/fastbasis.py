"""The planner's basis for any model the estimator can trace, in seconds, cached on disk.

A :class:`~trainfit.plan.cost.Basis` is fitted from four windows of the step -- one micro-batch at 2 and
at 4 samples, and accumulation 2 at each (``plan.basis.basis_from_reports``). The full path
(``--basis estimate``) gets them from four memory estimates, each tracing 3 and 4 blocks of the model
with its own warm-up: 8 traces per (precision, checkpointing) pair. This one gets the same four windows
from two traces (``probes.estimate.window_reports``: warm-up, then the steps [2, 4] and [4, 2] with each
window's segments kept apart), extrapolated in depth exactly as the estimator's block shortcut is; FLOPs
are counted by ``FlopCounterMode`` on the same fake warm-up steps and extrapolated alike (they are linear
in the blocks).

Why not also short sequences: a fake-tensor trace costs the same at any size (nothing is computed or
allocated), so the traces run at the plan's own sequence length and micro-batches, and nothing is
extrapolated in the sequence -- no quadratic attention term to fit, no error from it.

Cache: each basis is a JSON file under ``$TRAINFIT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/trainfit`` or
``~/.cache/trainfit``), keyed by everything that changes the trace: the job's model, config, sequence,
precision, checkpointing, optimizer, what trains, the data's tokenizer, the target device's kernels,
the files those name (size and modification time), and the versions of torch, transformers and
trainfit's own source. A second plan of the same job reads it back in milliseconds.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from trainfit.config import DataSection, ModelSection, RunConfig, make_config
from trainfit.errors import ConfigError, TrainfitError, one_line
from trainfit.meters.devices import DeviceRow, calibrate_cpu, find_device
from trainfit.plan import comm
from trainfit.plan.basis import BASIS_BATCHES, analytic_basis, basis_from_reports
from trainfit.plan.cost import Basis, Links
from trainfit.plan.shapes import shape_of
from trainfit.progress import Stage, logger, say, stage
from trainfit.vocabulary import PRECISIONS, PrecisionName, StrategyName, precision_facts

log = logger("plan")

BASIS_VERSION = 1
"""Bumped when the way a basis is traced or fitted changes (old cache entries are then not read)."""

KEY_FIELDS = ("model", "model_config", "seq_len", "precision", "checkpointing", "optimizer", "lora", "freeze",
              "data", "text_field", "tokenizer", "packing", "compile", "compile_mode", "compile_scope", "offload")
"""The RunConfig fields a basis depends on (the rest -- lr, steps, run_dir, ... -- change no tensor)."""


def cache_dir() -> Path:
    root = os.environ.get("TRAINFIT_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainfit"


@functools.cache
def _source_digest() -> str:
    """sha256 over trainfit's own source: a changed estimator never reads a basis the old one wrote."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _file_stamps(model: ModelSection, data: DataSection) -> list:
    """(path, size, mtime_ns) of every file or directory the job's model and data sections name: a local
    checkpoint, a JSON config, a user's model module, the data, a tokenizer."""
    names = [model.model.removeprefix("hf:"),
             model.model.removeprefix("module:").split(":")[0].replace(".", "/") + ".py",
             model.model_config.split(",")[0], data.data, data.tokenizer]
    out = []
    for name in names:
        p = Path(name) if name else None
        try:
            if p is None or not p.exists():
                continue
        except OSError:  # not a path at all (a key=value spec longer than a file name may be): nothing to stamp
            continue
        files = sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
        out.extend((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files[:200])
    return out


def _version(dist: str) -> str | None:
    """The installed distribution's version, read from its metadata (importing transformers costs seconds)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cache_key(cfg: RunConfig, *, target: str) -> str:
    hf = _version("transformers")
    d = cfg.to_dict()
    files = _file_stamps(cfg.section("model"), cfg.section("data"))
    values = {"fields": {k: d[k] for k in KEY_FIELDS}, "target": target, "files": files,
              "torch": _version("torch"), "transformers": hf, "trainfit": _source_digest(),
              "version": BASIS_VERSION, "batches": BASIS_BATCHES}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:32]


def read_record(kind: str, key: str) -> dict | None:
    """The JSON object cached under ``kind``/``key``, or None (absent, unreadable, not an object)."""
    try:
        value = json.loads((cache_dir() / kind / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_record(kind: str, key: str, value: dict) -> Path | None:
    """Written atomically (a killed plan leaves no half file); None when the cache directory is not writable."""
    folder = cache_dir() / kind
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, folder / f"{key}.json")
        return folder / f"{key}.json"
    except OSError:
        return None


def read_cached(key: str) -> Basis | None:
    record = read_record("basis", key)
    try:
        return None if record is None else Basis(**record)
    except TypeError:  # from another layout: trace again
        return None


def write_cached(key: str, basis: Basis) -> Path | None:
    return write_record("basis", key, dataclasses.asdict(basis))


TRACED_AS = {PrecisionName.FP16_MIXED: PrecisionName.BF16_MIXED, PrecisionName.FP16_TRUE: PrecisionName.BF16_TRUE}
"""Precisions whose trace is another's: fp16 and bf16 have the same element size and the same autocast op
lists, so every tensor of the step has the same bytes; the fp16 policies add the loss scaler's fp32 scale
(4 bytes), added here. ``tests/plan/test_fast_basis.py`` holds the traces of both equal but for those bytes."""
SCALER_BYTES = 4


def _as_traced(basis: Basis, precision: str) -> Basis:
    """The basis of ``precision`` from the trace of ``TRACED_AS[precision]``."""
    acc = basis.acc_extra_fixed_bytes
    return dataclasses.replace(
        basis, precision=precision, temp_fixed_bytes=basis.temp_fixed_bytes + SCALER_BYTES,
        acc_extra_fixed_bytes=None if acc is None else acc + SCALER_BYTES,
        source=f"{basis.source}; {precision} from the {basis.precision} trace (the same bytes, plus the loss "
               f"scaler's {SCALER_BYTES}-byte scale)")


def _as_cached(basis: Basis) -> Basis:
    return dataclasses.replace(basis, source=basis.source.replace("traced in", "cached; first traced in"))


def _pair_cfg(base_cfg: RunConfig, precision: str, checkpointing: str) -> RunConfig:
    return make_config({"precision": precision, "checkpointing": checkpointing, "micro_batch": 1, "accumulation": 1,
                        "strategy": StrategyName.SINGLE, "devices": 1, "global_batch": 0}, base=base_cfg)


def _model_flops(base_cfg: RunConfig, precision: str, target: str, use_cache: bool) -> float:
    """FLOPs of one sample without recompute: those of a pair without checkpointing (the same in every
    precision: FLOPs count shapes), read from the cache where any precision has one, else traced."""
    if use_cache:
        for p in PRECISIONS:
            cached = read_cached(cache_key(_pair_cfg(base_cfg, p, "none"), target=target))
            if cached is not None:
                return cached.hardware_flops_per_sample
    return fast_basis(base_cfg, precision, "none", target=target, use_cache=use_cache).hardware_flops_per_sample


def _estimator():
    """``trainfit.probes.estimate`` -- the traces, the model built on the meta device, the task -- imported on
    first use."""
    # lazy: the estimator imports torch and builds runs (torch.distributed.tensor, a model's library); a plan
    # whose bases are all cached needs none of it (seconds of imports on a small machine)
    import trainfit.probes.estimate as estimate

    return estimate


def check_task(cfg: RunConfig) -> None:
    """Build ``cfg``'s task as ``trainfit train`` would (its token rules, ``transformers``' validation, the
    user's callable), for the refusals it raises."""
    _estimator().task_of(cfg)


def _model_units(base_cfg: RunConfig) -> tuple[int, int, float]:
    """``probes.estimate.model_units`` of the job: the same config for every pair (precision and checkpointing
    change no parameter), so one meta build serves them all, and the forked workers inherit it."""
    return _estimator().model_units(_pair_cfg(base_cfg, base_cfg.precision, base_cfg.checkpointing.spec))


def fast_basis(base_cfg: RunConfig, precision: str, checkpointing: str, *, target: str = "cpu",
               use_cache: bool = True) -> Basis:
    """The basis of ``base_cfg``'s model for one (precision, checkpointing) pair: from the cache, or traced."""
    if precision in TRACED_AS:
        return _as_traced(fast_basis(base_cfg, TRACED_AS[precision], checkpointing, target=target,
                                     use_cache=use_cache), precision)
    cfg = _pair_cfg(base_cfg, precision, checkpointing)
    key = cache_key(cfg, target=target)
    if use_cache:
        cached = read_cached(key)
        if cached is not None:
            return _as_cached(cached)
    t0 = time.perf_counter()
    say(log, "plan: tracing the basis of %s/%s (%s) ...", precision, checkpointing, base_cfg.model)
    windows = _estimator().window_reports(cfg, target=target)
    (r1, r2, q1, q2), how, hw_flops = windows.reports, windows.how, windows.hardware_flops_per_sample
    # Model FLOPs leave checkpointing's recompute out: those of the same step without checkpointing.
    model_flops = hw_flops if checkpointing == "none" else _model_flops(base_cfg, precision, target, use_cache)
    n_blocks, n_tensors, max_unit = _model_units(base_cfg)
    basis = basis_from_reports(r1, r2, model_flops_per_sample=model_flops, hardware_flops_per_sample=hw_flops,
                               n_blocks=n_blocks, acc_reports=(q1, q2), n_param_tensors=n_tensors,
                               max_unit_params=max_unit)
    basis = dataclasses.replace(basis, full_recompute_flops_per_sample=windows.full_recompute_flops_per_sample,
                                source=f"fast trace ({how}; micro-batches {BASIS_BATCHES[0]} and "
                                       f"{BASIS_BATCHES[1]}, accumulation 1 and 2; traced in "
                                       f"{time.perf_counter() - t0:.1f} s); kernels of {target}: "
                                       + "; ".join(windows.kernel_lines))
    if use_cache:
        write_cached(key, basis)
    return basis


def _traced(args: tuple) -> dict:
    """In a forked worker: one pair's basis as plain values (one torch thread: the workers share the CPUs)."""
    import torch  # the worker's own setting (this module does not import torch: a cached plan never needs it)

    base_cfg, precision, checkpointing, target = args
    torch.set_num_threads(1)
    try:
        return {"basis": dataclasses.asdict(fast_basis(base_cfg, precision, checkpointing, target=target))}
    except TrainfitError as e:  # a refusal: sent back as plain values (ConfigError does not unpickle)
        return {"refused": _plain_error(e)}
    except Exception as e:  # noqa: BLE001 - anything else: named in one line in the parent, never a dead pool
        return {"failed": f"{type(e).__name__}: {one_line(str(e), 400)}"}


def _plain_error(e: TrainfitError) -> tuple[type, str, dict]:
    """(class, message, attributes) of a refusal, its attributes kept where they pickle (a user's value may not):
    a ConfigError pickles but cannot unpickle (its __init__ takes four arguments), which broke the worker pool."""
    attrs = {}
    for k, v in vars(e).items():
        try:
            pickle.dumps(v)
            attrs[k] = v
        except Exception:  # noqa: BLE001 - whatever pickling raises, the value is shown instead
            attrs[k] = repr(v)[:200]
    return type(e), str(e), attrs


def _raise_refusal(cls: type, message: str, attrs: dict) -> None:
    """Raise in the parent the refusal a worker met: the same class and one-line message."""
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(attrs)
    raise err


def prefetch(base_cfg: RunConfig, pairs, *, target: str = "cpu", workers: int | None = None,
             progress: Callable[[str], None] | None = None) -> dict:
    """Trace every (precision, checkpointing) pair not in the cache yet, in parallel, and return them all.

    The pairs go to ``workers`` forked processes (default: the CPUs, at most 4), which start with the model's
    library and the estimator imported here; the pairs without checkpointing go first, since the checkpointed
    ones read their model FLOPs from them (cached). With fewer such pairs than workers, or one process, the
    first pair is traced here before the rest. Where forking is not available the pairs are traced one after
    another. (Tracing the first pair alone first, as before, left one of two CPUs idle for a sixth of a
    cold plan: hf GPT-2 small's six pairs took 25.4 s that way, 21.7 s now, on this 2-core machine.)

    Progress: ``progress`` (a callable given a line) says where the pairs go; without one that line goes to the
    ``trainfit.plan`` logger. Each traced pair is said there as it ends, ``plan: traced pair 3/8 (bf16-mixed, full,
    at 4.1 s)`` (a :func:`trainfit.progress.stage`), and the pairs read from the cache in one debug line."""
    wanted = list(dict.fromkeys(pairs))
    out, missing = _read_cached_pairs(base_cfg, list(dict.fromkeys((TRACED_AS.get(p, p), ck) for p, ck in wanted)),
                                      target=target)
    if not missing:
        return _with_aliases(out, wanted)
    tell = progress or (lambda msg: log.info("plan: " + msg))
    # Pairs without checkpointing first: the others' model FLOPs are theirs (any precision's: FLOPs count shapes),
    # read from the cache, so a checkpointed pair waits for one of them -- here or in a worker that took it first.
    missing.sort(key=lambda pair: pair[1] != "none")
    t0 = time.perf_counter()
    workers = min(workers or os.cpu_count() or 1, 4, len(missing))
    parallel = workers > 1 and "fork" in multiprocessing.get_all_start_methods()
    first_here = not parallel or missing[0][1] != "none" or len([m for m in missing if m[1] == "none"]) < workers
    with stage("plan", len(missing), verb="traced pair", log=log) as pairs_done:
        if first_here:  # (without enough pairs free of checkpointing, one is traced here before the workers start)
            workers = _trace_first_here(base_cfg, missing, out, target=target, workers=workers, tell=tell,
                                        pairs_done=pairs_done, t0=t0)
        else:
            # the model's library and the estimator imported, and the model's units counted, once here: the forked
            # workers start with them
            _model_units(base_cfg)
            tell(f"tracing the basis of {len(missing)} (precision, checkpointing) pairs on {workers} processes, "
                 f"cached in {cache_dir()} ...")
        if parallel and workers > 1:
            _trace_forked(base_cfg, missing, out, target=target, workers=workers, pairs_done=pairs_done, t0=t0)
        else:
            for pair in missing:
                out[pair] = fast_basis(base_cfg, *pair, target=target)
                _said_traced(pairs_done, pair, t0)
    return _with_aliases(out, wanted)


def _read_cached_pairs(base_cfg: RunConfig, pairs: list, *, target: str) -> tuple[dict, list]:
    """(the bases of ``pairs`` already in the cache, by pair; the pairs that are not, in order), the cached
    ones said in one debug line."""
    out = {}
    missing = []
    for p, ck in pairs:
        cached = read_cached(cache_key(_pair_cfg(base_cfg, p, ck), target=target))
        if cached is not None:
            out[(p, ck)] = _as_cached(cached)
        else:
            missing.append((p, ck))
    if out:
        log.debug("plan: %d of %d (precision, checkpointing) pairs read from the cache %s", len(out), len(pairs),
                  cache_dir())
    return out, missing


def _said_traced(pairs_done: Stage, pair: tuple[str, str], t0: float) -> None:
    """One more pair traced, said on ``pairs_done`` with the seconds since ``t0``."""
    pairs_done.step(f"{pair[0]}, {pair[1]}, at {time.perf_counter() - t0:.1f} s")


def _trace_first_here(base_cfg: RunConfig, missing: list, out: dict, *, target: str, workers: int,
                      tell: Callable[[str], None], pairs_done: Stage, t0: float) -> int:
    """Trace the first of ``missing`` in this process (taken off it, its basis put in ``out``) and say where the
    rest go; returns the workers left for them (no more than the pairs)."""
    first = missing.pop(0)
    # nothing said at INFO before it: a model that cannot be traced is refused here in one line
    log.debug("plan: tracing the basis of %s/%s first, here; %d more pairs after it", *first, len(missing))
    out[first] = fast_basis(base_cfg, *first, target=target)  # a model that cannot be traced fails here
    _said_traced(pairs_done, first, t0)
    workers = min(workers, len(missing))
    if missing:
        tell(f"traced the basis of {first[0]}/{first[1]} in {time.perf_counter() - t0:.1f} s; "
             f"{len(missing)} more (precision, checkpointing) pairs on {max(workers, 1)} "
             f"processes, cached in {cache_dir()} ...")
    return workers


def _trace_forked(base_cfg: RunConfig, missing: list, out: dict, *, target: str, workers: int,
                  pairs_done: Stage, t0: float) -> None:
    """Trace ``missing`` on ``workers`` forked processes, each basis put in ``out`` and said as it comes back."""
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        started = {pool.submit(_traced, (base_cfg, *pair, target)): pair for pair in missing}
        for done in concurrent.futures.as_completed(started):  # said as each worker finishes one
            pair = started[done]
            out[pair] = Basis(**_worker_result(done, base_cfg.model, pair))
            _said_traced(pairs_done, pair, t0)


def _worker_result(done: concurrent.futures.Future, model: str, pair: tuple[str, str]) -> dict:
    """The basis a worker traced, or its failure as one line naming the model and the pair (a refusal keeps its
    class); a worker that died (killed, out of memory) is named too, never a BrokenProcessPool traceback."""
    what = f"tracing the basis of {model} ({pair[0]}, checkpointing {pair[1]}) in a worker process"
    try:
        got = done.result()
    except concurrent.futures.process.BrokenProcessPool:
        raise TrainfitError(f"plan: {what} ended abruptly (killed, or out of host memory?); "
                            "pass --precisions and --checkpointings to trace fewer pairs at once") from None
    if "refused" in got:
        _raise_refusal(*got["refused"])
    if "failed" in got:
        raise TrainfitError(f"plan: {what} failed: {got['failed']}")
    return got["basis"]


def _with_aliases(traced: dict, wanted: list) -> dict:
    return {(p, ck): traced[(p, ck)] if p not in TRACED_AS else _as_traced(traced[(TRACED_AS[p], ck)], p)
            for p, ck in wanted}


# -- where the planner's numbers come from (``probes.calibrate`` adds the measured ones) ---------------------
BASIS_SOURCES = ("auto", "analytic", "fast", "estimate", "measure")
"""Where a basis comes from: auto (analytic where the model has a shape, else fast), analytic (the shape's
formulas, ``plan.basis``), fast (two traces per pair, cached: ``probes.fastbasis``), estimate (four full
memory estimates per pair), measure (four measured steps per pair, on this machine)."""


def basis_provider(base_cfg: RunConfig, *, source: str = "auto",
                   target: str = "cpu") -> tuple[Callable[[str, str], Basis], str]:
    """``basis(precision, checkpointing)`` for the run in ``base_cfg`` and the source used; ``target``: the
    device whose kernels a traced basis follows (a ``meters.devices.DEVICES`` name)."""
    if source not in BASIS_SOURCES:
        raise ConfigError("basis", source, BASIS_SOURCES)
    shape = shape_of(base_cfg.model, base_cfg.model_config, seq_len=base_cfg.seq_len)
    if source == "analytic" or (source == "auto" and shape is not None):
        if shape is None:
            raise ConfigError("basis", "analytic", "estimate or measure for this model",
                              f"{base_cfg.model} has no analytic shape (built-in GPTs, llama-*, hf:LlamaForCausalLM)")
        return (lambda p, ck: analytic_basis(shape, precision=p, checkpointing=ck, seq_len=base_cfg.seq_len,
                                             optimizer=base_cfg.optimizer)), "analytic"
    chosen = "fast" if source == "auto" else source
    if chosen == "fast":
        return (lambda p, ck: fast_basis(base_cfg, p, ck, target=target)), chosen
    # lazy: the full paths (four estimates or measured steps per pair) build runs; the cached and analytic ones
    # answer `trainfit plan` without importing the run (torch.distributed.tensor) or a model's library
    from trainfit.probes.fullbasis import report_basis

    return (lambda p, ck: report_basis(base_cfg, p, ck, source=chosen)), chosen


def links_provider(row: DeviceRow, *, nodes: int, devices: int, intra: float | None, inter: float | None,
                   latency_s: float = 0.0, overhead_s: float = 0.0,
                   host_bytes_per_s: float | None = None) -> Callable[[str], Links]:
    """``links(precision)``: achievable FLOP/s for its dtype, the ring's slowest hop and the host link
    (``host_bytes_per_s``, default the row's datasheet link; None on a CPU row: offload not priced)."""
    host = host_bytes_per_s or row.host_bytes_per_s
    intra = intra or row.intra_bytes_per_s
    inter = inter or row.inter_bytes_per_s
    bw = comm.ring_bandwidth(intra=intra, inter=inter, nodes=nodes, per_node=max(1, devices // max(1, nodes)),
                             channel_per_nic=row.arch is not None)
    if devices > 1 and not bw:
        flag = "--bandwidth-inter" if nodes > 1 else "--bandwidth-intra"
        raise ConfigError(flag.lstrip("-"), None, "a bandwidth such as 10GB/s",
                          f"device {row.name} has no link bandwidth in the table; pass {flag}")
    cache: dict[str, float] = {}

    def rate(dtype: str) -> float:
        if dtype not in cache:
            if row.peak_row is None:
                cache[dtype] = calibrate_cpu(dtype).flops_per_s * row.achievable_frac
            else:
                peak = find_device(row.peak_row).peak_tflops[dtype] * 1e12
                cache[dtype] = peak * row.achievable_frac
        return cache[dtype]

    def links(p: str, ck: str = "none") -> Links:
        return Links(flops_per_s=rate(precision_facts(p).compute), bandwidth_bytes_per_s=bw or 1.0, latency_s=latency_s,
                     overlap=row.overlap, overhead_per_micro_batch_s=overhead_s, host_bytes_per_s=host)

    return links
