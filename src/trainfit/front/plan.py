"""``trainfit.front.plan``: the planner as a library call, typed request in, typed report out.

:func:`plan` takes a :class:`PlanRequest` (or its fields as keywords) and returns the
:class:`~trainfit.results.PlanReport` that ``trainfit plan --json`` prints. Every field is checked when the request
is built, with the same one-line refusals as the command's flags; nothing is searched, traced or written before.
``--write``, ``--write-for``, ``--explain`` and the table are reachable from Python through :func:`run_config`,
:func:`export_for`, :func:`format_explain` (of ``report.extra["explain"]``) and :func:`format_plan`.

``devices`` counts the devices of one node (as torchrun's ``--nproc_per_node`` and Lightning's ``devices``);
``nodes`` the nodes: the plan is for ``devices x nodes`` devices in all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import time
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

import trainfit.logs as logs
from trainfit.config import RunConfig, make_config
from trainfit.errors import ConfigError
from trainfit.front.plan_request import (
    FAST_DEFAULT_CHECKPOINTINGS,
    FILE_DATA_FLAGS,
    OFFLOAD_FLAG,
    PlanRequest,
    _calibrate,
    subsets,
)
from trainfit.front.plan_text import (
    _clock_lines,
    _offload_notes,
    _offload_source,
    _source_lines,
    explain_row,
    format_explain,
    format_plan,
    format_table,
)
from trainfit.integrations.export_plan import ToolConfig, export_plan
from trainfit.integrations.read_config import rank_note
from trainfit.meters.devices import (
    DeviceRow,
    clock_facts,
    dtypes_of,
    find_device,
    measure_host_copy,
    measure_loopback,
)
from trainfit.plan.basis import analytic_basis
from trainfit.plan.clock import DeviceClock, clocked_links
from trainfit.plan.offload import OFFLOAD_CHOICES
from trainfit.plan.rules import Context
from trainfit.plan.search import (
    CHECKPOINT_CHOICES,
    SearchSpace,
    needed_pairs,
    search,
    step_floor,
)
from trainfit.plan.shapes import PlannedModel, TransformerShape, parse_model_config, plan_model, run_spec
from trainfit.plan.trainable import trainable
from trainfit.presets import GPT_PRESETS
from trainfit.probes.fastbasis import (
    TRACED_AS,
    basis_provider,
    cache_dir,
    cache_key,
    check_task,
    links_provider,
    prefetch,
    read_record,
    write_record,
)
from trainfit.progress import logger, say
from trainfit.results import PlanReport, PlanRow
from trainfit.tasks.spec import DataSpec, check_model_fits
from trainfit.vocabulary import (
    Dtype,
    PrecisionName,
    parse_lora,
    strategy_facts,
)

if TYPE_CHECKING:
    from trainfit.tasks.files import TextData


# -- the planner, step by step --------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Run:
    """What the steps of one :func:`plan` call hand on to each other."""

    req: PlanRequest
    row: DeviceRow
    base: RunConfig | None = None
    planned: PlannedModel | None = None
    rows: int = 0
    """Tokens per row the activations are sized for: the longest row the data produces."""
    tuned: Any = None
    """What trains under --lora / --freeze (analytic shapes; the estimator reads the config itself)."""
    header: list[str] = dataclasses.field(default_factory=list)
    space: SearchSpace | None = None
    full_space: SearchSpace | None = None
    ctx: Context | None = None
    basis: Callable | None = None
    used: str = ""
    bases: dict = dataclasses.field(default_factory=dict)
    deferred: list = dataclasses.field(default_factory=list)
    basis_line: int = -1
    host_bw: float | None = None
    links: Callable | None = None
    dist_rows: tuple = ()
    t0: float = 0.0


def _progress(msg: str) -> None:
    """A progress line of the plan (``trainfit.plan`` at INFO: the CLI says it on stderr, ``--quiet`` drops it)."""
    say(logger("plan"), "plan: " + msg)


def _space(r: _Run) -> None:
    """The search's bounds: the batch, the devices, the memory and the levers to try."""
    req = r.req
    r.host_bw = r.row.host_bytes_per_s
    if r.host_bw is None and req.calibrate:
        r.host_bw = measure_host_copy()  # cpu: offload's copies are memcpys (~0.1 s to measure)
    offloads = req.searched_offloads(req.offloads if req.offloads is not None else
                                     (OFFLOAD_CHOICES if r.host_bw else ("",)))
    if req.write_for is not None:  # export_plan.unexpressed: what the tool's file cannot hold is not searched
        r.header.append(f"--write-for {req.write_for}: searched only rows its file holds as planned (no master-copy "
                        "precision, no optimizer offload outside zero2/zero3, no activation offload: DeepSpeed's, "
                        "which trainfit does not write)")
    subsets = {k: v for k, v in (("precisions", req.searched_precisions()), ("checkpointings", req.checkpointings),
                                 ("strategies", req.searched_strategies())) if v is not None}
    r.space = SearchSpace(global_batch=req.global_batch, devices=req.world_size, memory_bytes=req.device_memory,
                          headroom=req.headroom, compiles=(False,) if req.compile_speedup is None else (False, True),
                          offloads=offloads, **subsets)
    r.ctx = Context(devices=req.world_size, dtypes=dtypes_of(r.row))


def _job(r: _Run) -> None:
    """The model and data, read and refused as ``trainfit train`` would, and the base config of the plans."""
    req, seq = r.req, r.req.seq_len
    job = {"lora": req.lora, "freeze": req.freeze,
           **{k: getattr(req, k) for k in FILE_DATA_FLAGS if getattr(req, k) is not None}}
    spec = DataSpec.from_config(make_config({"seq_len": seq, **job}))  # None: the task's generated data
    text = _read_data(spec) if spec is not None else None  # read (and refused) as train reads it
    job_cfg = make_config({"model": req.model, "model_config": data_model_config(req.model, req.model_config, text),
                           "seq_len": seq, **job})
    r.planned = planned = checked_model(job_cfg)
    if text is not None and planned.shape is not None:  # train's own refusals (check_task may skip the task)
        check_model_fits(text, vocab_size=planned.shape.vocab_size, max_positions=None, seq_len=seq,
                         model=planned.model)
    r.base = base = make_config({"model": planned.model, "model_config": planned.model_config, "seq_len": seq,
                                 "optimizer": req.optimizer, **job})
    if planned.shape is not None and (base.lora or base.freeze):
        r.tuned = trainable(planned.shape, freeze=base.freeze, lora=parse_lora(base.lora))
        r.header.append(r.tuned.description)
    r.rows = seq
    if text is not None:
        r.rows = min(text.longest, seq)
        r.header.append(f"activations sized for rows of {r.rows:,} tokens: the longest this data produces"
                        + (" (packing: full seq_len)" if base.packing else f" (packing off: its longest document, "
                                                                            f"at most --seq {seq})"))


def _choose_basis(r: _Run) -> None:
    """Where the memory parts come from; a traced basis's default checkpointings and deferred choices."""
    req = r.req
    r.basis, r.used = basis_provider(r.base, source=req.basis, target=r.row.name)
    if r.used == "fast" and req.checkpointings is None:
        # every:K traces twice the blocks of the others (K x 3 and K x 4 blocks, the unit being K blocks) and
        # would take half the cold time; the traced default keeps none and full, and says so
        r.space = dataclasses.replace(r.space, checkpointings=FAST_DEFAULT_CHECKPOINTINGS)
        r.header.append(f"checkpointing searched: {', '.join(FAST_DEFAULT_CHECKPOINTINGS)} (every:2 traces twice "
                        "the blocks, so a traced basis leaves it out unless asked: --checkpointings none,every:2,full)")
    # A traced default plan on a GPU row searches without full checkpointing and fp32 first, and traces them
    # only where one of their rows could rank first (checked after the search: _Deferred).
    # (the bound reads datasheet rates: not where a CPU row's rate or a compile speed-up is measured per pair)
    r.deferred = [d for d in (_FULL, _FP32) if r.used == "fast" and getattr(req, d.flag) is None
                  and req.source is None and req.compile_speedup != "measure"
                  and d.value in getattr(r.space, d.flag) and d.applies(r.row)]
    r.full_space = r.space
    for d in r.deferred:
        r.space = d.narrow(r.space)
    r.t0 = time.perf_counter()
    if r.used == "fast":  # every pair the search will ask for, traced in parallel (or read from the cache)
        r.bases.update(prefetch(r.base, needed_pairs(r.space, r.ctx), target=r.row.name))
        bases = r.bases
        r.basis = lambda p, ck: bases[(p, ck)]  # noqa: E731 -- the search asks for these pairs only
        r.header.append("")  # the basis line, written once the deferred pairs are settled (_finish)
    r.basis_line = len(r.header) - 1
    if r.used == "analytic" and (r.tuned is not None or r.rows != req.seq_len):
        shape, rows, tuned, optimizer = r.planned.shape, r.rows, r.tuned, r.base.optimizer
        r.basis = (lambda p, ck: analytic_basis(shape, precision=p, checkpointing=ck, seq_len=rows,
                                                optimizer=optimizer, trainable=tuned))
    elif (r.base.lora or r.base.freeze) and r.planned.shape is None:
        r.header.append(f"--lora/--freeze: the {r.used} basis builds the model with them and counts what trains")


def _price_links(r: _Run) -> None:
    """The device's rates and links (clocked op by op where the model's shape is known) and their sources."""
    req, row, shape = r.req, r.row, r.planned.shape
    r.header.extend(_source_lines(r.basis, r.used, row, r.base, calibrate=req.calibrate,
                                  needed=needed_pairs(r.space, r.ctx),
                                  clocked=clock_facts(row) is not None and shape is not None))
    latency_s, intra = 0.0, req.bandwidth_intra
    if row.peak_row is None and req.calibrate and req.world_size > 1:
        # Per-collective-call latency on CPU: gloo's path between ranks on one host is TCP loopback;
        # its one-way latency is one ring step (as measure/scaleout.py uses it without a live group).
        loop_bw, latency_s = measure_loopback()
        intra = intra or loop_bw
    facts = clock_facts(row)
    if facts is not None and req.calibrate:  # CUDA: this device's GEMM shares, HBM and host link, measured now
        _progress("measuring this CUDA device's GEMM rates, memory and host-link bandwidth ...")
        facts, r.host_bw = _calibrate().calibrated_clock_facts(facts, _calibrate().measure_device_timings())
    r.links = links_provider(row, nodes=req.nodes, devices=req.world_size, intra=intra, inter=req.bandwidth_inter,
                             latency_s=latency_s, host_bytes_per_s=r.host_bw)
    if facts is not None and shape is not None:  # a GPU row and the model's shape: priced op by op
        r.links = clocked_links(r.links, DeviceClock(**facts), shape, seq_len=r.rows)
        r.header.extend(_clock_lines(facts, r.tuned is not None))
    r.header.append(_offload_source(r.space.offloads, r.host_bw, row))
    r.header.append(f"devices: {req.world_size} = {req.devices} per node x {req.nodes} node"
                    f"{'s' if req.nodes != 1 else ''} (--devices counts one node's, --nodes the nodes)")


def _calibrated(r: _Run, scope: contextlib.ExitStack) -> None:
    """``calibrate``: the step times fitted to steps measured here; on several devices, gloo's overhead too."""
    req = r.req
    if req.world_size > 1:
        # Ranks sharing this CPU run one torch thread each (torchrun sets OMP_NUM_THREADS=1 for
        # several processes per host): fit the compute at that. calibrated_links measures
        # lazily, during the search, so the setting holds until the search is done.
        scope.enter_context(_torch_threads(1))
    r.links = _calibrate().calibrated_links(r.base, r.links, r.basis, precisions=tuple(r.space.precisions),
                                            notes=r.header)
    if req.world_size > 1:
        # gloo ranks on one CPU pay more than link time: FSDP2's per-unit work, each collective's
        # wait for its peer. Measured on 2 processes here and fitted per (strategy, grad_sync).
        _progress("measuring the distributed overhead on 2 gloo processes (about a minute) ...")
        r.links, r.dist_rows = _calibrate().with_dist_overhead(r.links, r.base, r.basis, world=2,
                                                               strategies=req.searched_strategies())


def _search(r: _Run):
    """The search, after calibration and compile's pricing, then the deferred choices where they could win."""
    with contextlib.ExitStack() as scope:
        if r.req.calibrate and r.row.peak_row is None:  # cpu: steps measured here (a GPU row: _price_links)
            _calibrated(r, scope)
        if r.req.compile_speedup is not None:
            r.links, compile_note = _with_compile_speedup(r.links, r.base, r.req.compile_speedup)
            r.header.append(compile_note)
        result = search(r.space, ctx=r.ctx, basis=r.basis, links=r.links)
        for d in r.deferred:  # full checkpointing first (what often makes a large model fit), then fp32
            result = _deferred_round(r, d, result)
    return result


def _deferred_round(r: _Run, d: _Deferred, result):
    """Trace ``d`` and search again if one of its rows could rank first (or nothing fits); else say why not."""
    uncheckpointed = [b for (p, ck), b in r.bases.items() if ck == "none"]
    floor, fastest = step_floor(d.only(r.space), uncheckpointed, ctx=r.ctx, links=r.links)
    best = result.best
    if fastest is None:  # every one of its candidates breaks a rule: the search would drop them all
        r.header.append(f"{d.flag}: {d.value} not traced: none of its candidates is compatible here")
        return result
    if best is not None and floor > best.step_s:
        r.header.append(f"{d.flag}: {d.value} not traced: no {d.value} row can step faster than {floor:.4g} s "
                        f"here ({_floor_how(fastest, uncheckpointed[0])}), slower than the best plan's "
                        f"{best.step_s:.4g} s, so none can rank first (--{d.flag} "
                        f"{','.join(getattr(r.full_space, d.flag))} to price it anyway)")
        return result
    r.header.append(f"{d.flag}: {d.value} traced too, after the others: " + (
        "nothing fits without it" if best is None else
        f"its rows could step in {floor:.4g} s ({_floor_how(fastest, uncheckpointed[0])}), not slower "
        f"than the best plan without it ({best.step_s:.4g} s)"))
    r.space = d.widen(r.space, r.full_space)
    r.bases.update(prefetch(r.base, needed_pairs(r.space, r.ctx), target=r.row.name))
    return search(r.space, ctx=r.ctx, basis=r.basis, links=r.links)


def _finish_notes(r: _Run, result) -> None:
    """The header first (the job and its sources), then the search's notes and what they leave unsaid."""
    req, row = r.req, r.row
    if r.used == "fast":
        own = {(p, ck): b for (p, ck), b in r.bases.items() if p not in TRACED_AS}  # fp16 pairs reuse bf16's
        traced = sum("cached" not in b.source for b in own.values())
        r.header[r.basis_line] = (f"basis: fast fake-tensor traces of {r.base.model} ({traced} of {len(own)} traces "
                                  f"made now, the rest read from the cache {cache_dir()}; {len(r.bases) - len(own)} "
                                  f"fp16 pairs from their bf16 trace; {time.perf_counter() - r.t0:.1f} s)")
    result.notes[:0] = r.header  # first: the job these plans are for
    result.notes.extend(r.planned.notes)
    if result.entries and r.space.offloads == ("",):  # not searched: what it would free and cost, in words
        result.notes.extend(_offload_notes(result, r.basis, row, r.space, r.base))
    if r.dist_rows:
        fitted = ", ".join(f"{s}/{sync} {ps * 1e3:+.1f} ms/step {pm * 1e3:+.1f} ms/micro-batch"
                           for s, sync, ps, pm in r.dist_rows)
        result.notes.append(f"distributed overhead measured on 2 gloo processes of this machine and applied to "
                            f"{req.world_size} devices: {fitted}")
    if row.peak_row is None and not req.calibrate:
        result.notes.append("cpu step times assume the calibrated matmul rate, which a small model does not reach; "
                            "pass --calibrate to fit them to this model's measured steps")
    if req.source is not None:
        result.notes.append(rank_note(req.source, result.entries))


def plan(request: PlanRequest | None = None, /, **fields: Any) -> PlanReport:
    """Plan a job: the ranked configurations (``request.top`` of them) with their memory, step time and why.

    Args:
        request: the job; or none, and its fields as keywords (``plan(model="llama-7b", global_batch=512,
            device_memory="80GiB", devices=8, nodes=4)``); fields given beside a request replace its own.
    Returns:
        The report ``trainfit plan --json`` prints; ``report.best`` is None when nothing fits (its notes say why).
        ``report.devices`` counts every device (``devices x nodes``). ``extra`` holds ``explain`` (the
        ``explain`` row's step split into its parts) and ``from`` (what ``from_file`` set), when asked.
    Raises:
        ConfigError: a field that is not valid (one line naming it), or a model or data train would refuse.
    """
    req = _request(request, fields)
    r = _Run(req=req, row=req.row)
    _space(r)
    _job(r)
    logs.accept()  # the request, the model and the data are checked: what was held (the front door's) is said
    _choose_basis(r)
    _price_links(r)
    result = _search(r)
    _finish_notes(r, result)
    shown = result.entries[:req.top]
    _remember(req, r.base)
    extra: dict[str, Any] = {}
    if req.explain is not None:
        extra["explain"] = explain_row(shown, req.explain)
    if req.source is not None:
        extra["from"] = req.source.to_dict(req.overridden)
    return PlanReport(model=req.model, global_batch=req.global_batch, devices=req.world_size,
                      device_memory_bytes=req.device_memory, basis=r.used, candidates=result.candidates,
                      excluded=result.excluded, notes=tuple(result.notes),
                      plans=tuple(PlanRow.from_dict(e.to_dict()) for e in shown), extra=extra)


def _request(request: PlanRequest | None, fields: dict) -> PlanRequest:
    names = {f.name for f in dataclasses.fields(PlanRequest) if f.init}
    for key, value in fields.items():
        if key not in names:
            raise ConfigError(key, value, "a PlanRequest field: " + ", ".join(sorted(names)))
    if request is None:
        return PlanRequest(**fields)
    return dataclasses.replace(request, **fields) if fields else request


_JOBS: dict[PlanRequest, RunConfig] = {}
"""The job's base config of the last few requests planned (:func:`job_config` reads it instead of reading the
model and the data again)."""


def _remember(req: PlanRequest, base: RunConfig) -> None:
    _JOBS.pop(req, None)
    _JOBS[req] = base
    while len(_JOBS) > 8:
        del _JOBS[next(iter(_JOBS))]


def job_config(request: PlanRequest) -> RunConfig:
    """The job's own RunConfig (model, its config as train builds it, data, sequence, optimizer) that a plan
    row's levers are added to: remembered from :func:`plan`, else read and checked as :func:`plan` does."""
    base = _JOBS.get(request)
    if base is None:
        r = _Run(req=request, row=request.row)
        _job(r)
        base = r.base
    return base


# -- the model and the data -----------------------------------------------------------------------------------------
class _ConfigKeys(Collection):
    """The keys ``trainfit train`` takes for a ``transformers`` config class (as ``tasks.hf`` reads them:
    its fields, their aliases, and properties such as ``num_labels``)."""

    def __init__(self, config_class) -> None:
        self.default = config_class()
        self.names = sorted(set(self.default.to_dict()) | set(getattr(config_class, "attribute_map", {})))

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (key in self.names or hasattr(self.default, key))

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def hf_config_keys(spec: str) -> Collection[str] | None:
    """The config keys of ``hf:Class`` from ``transformers``, or None where it is not installed or has no such
    class (then the task builder says so). Imported only when a key needs it (seconds)."""
    try:
        if importlib.util.find_spec("transformers") is None:
            return None
    except (ImportError, ValueError):
        return None
    import transformers  # lazy: seconds to import, and only some plans (an hf: key beyond the shape's) need it

    try:
        config_class = getattr(getattr(transformers, spec.removeprefix("hf:"), None), "config_class", None)
        return _ConfigKeys(config_class) if isinstance(config_class, type) else None
    except Exception:  # a class transformers cannot import here, a config without defaults: the task builder's to say
        return None


def check_model(job_cfg) -> PlannedModel:
    """The model of the job in ``job_cfg`` to plan for, refused exactly where ``trainfit train`` would refuse it,
    before any search."""
    planned = plan_model(job_cfg.model, job_cfg.model_config, seq_len=job_cfg.seq_len, config_keys=hf_config_keys)
    if planned.check_task:  # train's own checks: token rules, transformers' validation, the user's callable
        check_task(make_config({"model": planned.model, "model_config": planned.model_config}, base=job_cfg))
    return planned


def checked_model(job_cfg) -> PlannedModel:
    """:func:`check_model` of the job in ``job_cfg``, remembered in the basis cache under the same key rules
    (the model, its config, the sequence, the data and every file they name, the versions of torch,
    transformers and trainfit's source): a job accepted once is not built again, which spares importing
    ``transformers`` (seconds) when every basis is cached too. A refusal is never remembered."""
    key = cache_key(job_cfg, target="checked-model")
    record = read_record("checked", key)
    if record is not None:
        try:
            shape = record["shape"]
            return PlannedModel(model=record["model"], model_config=record["model_config"],
                                shape=None if shape is None else TransformerShape(**shape),
                                notes=tuple(record["notes"]), check_task=record["check_task"])
        except (KeyError, TypeError):  # another layout: check again
            pass
    planned = check_model(job_cfg)
    write_record("checked", key, dataclasses.asdict(planned))
    return planned


def _read_data(spec: DataSpec) -> TextData:
    # lazy: reading data builds its datasets (torch); a plan of generated data, cached, never imports torch
    from trainfit.tasks.files import load_text_data

    return load_text_data(spec)


def data_model_config(model: str, model_config: str, text: TextData | None) -> str:
    """``model_config`` with the vocabulary ``trainfit train`` takes from the data's tokenizer: a GPT built-in
    whose ``vocab_size`` the user left open gets the tokenizer's (``tasks.builtin.gpt_task``)."""
    if text is None or run_spec(model, model_config)[0] not in GPT_PRESETS:
        return model_config
    if "vocab_size" in parse_model_config(model_config):
        return model_config
    return ",".join(x for x in (model_config.strip(), f"vocab_size={text.vocab_size}") if x)


# -- pricing helpers ----------------------------------------------------------------------------------------------
def _with_compile_speedup(links, base, speedup):
    """``links`` carrying the compile speed-up (given, or measured per pair on this CPU) and its source line."""
    if speedup != "measure":
        return ((lambda p, ck="none": dataclasses.replace(links(p, ck), compile_speedup=speedup)),
                f"compile: compute priced at {speedup:g}x the eager speed (--compile-speedup, as given); memory "
                "as eager")
    _progress("measuring eager vs compiled steps of this model (a compile per pair; minutes when inductor's "
              "cache is cold) ...")
    return (_calibrate().compile_speedup_links(base, links),
            "compile: compute priced at the eager/compiled step ratio measured on this CPU per (precision, "
            "checkpointing), interleaved steps at the basis micro-batch (probes.compile.measure_compile_speedup); "
            "memory as eager")


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch  # a calibrating plan's: the others never import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fp32_slow(row) -> bool:
    """A GPU row whose half precision runs at least twice fp32's dense peak: there a traced default plan searches
    the half precisions first and traces fp32 only if ``plan.search.step_floor`` says an fp32 row could rank first."""
    peak = find_device(row.peak_row) if row.peak_row else None
    if peak is None or Dtype.FP32 not in peak.peak_tflops:
        return False
    return max(peak.peak_tflops.get(d, 0.0) for d in (Dtype.BF16, Dtype.FP16)) >= 2 * peak.peak_tflops[Dtype.FP32]


def _floor_how(c, b) -> str:
    """Where a deferred choice's step floor (``plan.search.step_floor``) comes from, in words."""
    recompute = (f" plus the {b.full_recompute_flops_per_sample:.3g} per sample full checkpointing recomputes"
                 if c.checkpointing == "full" else "")
    return (f"its fastest candidate, {c.precision} {c.strategy} micro-batch {c.micro_batch} x {c.accumulation}, "
            f"priced at the model's FLOPs{recompute} and the communication of the traces without it; memory "
            "and offload aside")


@dataclasses.dataclass(frozen=True)
class _Deferred:
    """A choice a traced default plan prices only where one of its rows could rank first: searched without it,
    then traced when its fastest possible step is not slower than the best plan found, or when nothing fits."""

    flag: str
    """The flag and the SearchSpace field that list it (``--precisions``, ``--checkpointings``)."""
    value: str
    applies: Callable
    """``applies(device row)``: whether it is deferred on that device."""

    def only(self, space):
        return dataclasses.replace(space, **{self.flag: (self.value,)})

    def narrow(self, space):
        return dataclasses.replace(space, **{self.flag: tuple(v for v in getattr(space, self.flag) if v != self.value)})

    def widen(self, space, full):
        """``space`` with the value back, in ``full``'s order (a tie ranks as the whole search ranks it)."""
        kept = {*getattr(space, self.flag), self.value}
        return dataclasses.replace(space, **{self.flag: tuple(v for v in getattr(full, self.flag) if v in kept)})


_FULL = _Deferred(flag="checkpointings", value="full", applies=lambda row: row.peak_row is not None)
_FP32 = _Deferred(flag="precisions", value=PrecisionName.FP32, applies=_fp32_slow)


def plan_config(entry, base: RunConfig, *, devices: int, global_batch: int) -> RunConfig:
    """The RunConfig that runs ``entry`` (a plan row; ``trainfit train PLAN.toml``): ``devices`` per node."""
    values = {"precision": entry.precision, "micro_batch": entry.micro_batch, "accumulation": entry.accumulation,
              "checkpointing": entry.checkpointing, "strategy": entry.strategy, "grad_sync": entry.grad_sync,
              "devices": devices}
    if strategy_facts(entry.strategy).distributed:
        values["global_batch"] = global_batch
    if entry.compile:
        values["compile"] = True
    if entry.offload:
        values["offload"] = entry.offload
    return make_config(values, base=base)


def run_config(request: PlanRequest, report: PlanReport, row: int = 1) -> RunConfig:
    """The RunConfig ``trainfit train`` runs for plan ``row`` (1-based; default the best) of ``report``, planned
    for ``request``: what ``plan --write`` writes. Its ``devices`` counts one node's (``request.nodes`` nodes)."""
    if not 1 <= row <= len(report.plans):
        raise ConfigError("row", row, f"a plan number from 1 to {len(report.plans)}")
    return plan_config(report.plans[row - 1], job_config(request), devices=request.devices,
                       global_batch=report.global_batch)


def export_for(request: PlanRequest, report: PlanReport, tool: str, row: int = 1) -> ToolConfig:
    """Plan ``row`` of ``report`` (planned for ``request``) as ``tool``'s own configuration (``plan --write-for
    TOOL FILE``): the text to write and what the tool cannot express (``ToolConfig.gaps``)."""
    return export_plan(tool, run_config(request, report, row), nodes=request.nodes, cpu=request.row.name == "cpu")


__all__ = ["CHECKPOINT_CHOICES", "FILE_DATA_FLAGS", "OFFLOAD_FLAG", "PlanRequest", "check_model", "checked_model",
           "explain_row", "export_for", "format_explain", "format_plan", "format_table", "hf_config_keys",
           "job_config", "plan", "plan_config", "run_config", "search", "subsets"]
