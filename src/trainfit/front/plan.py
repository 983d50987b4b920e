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
import math
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from trainfit.config import RunConfig, make_config
from trainfit.errors import ConfigError, check_unique_keys
from trainfit.integrations.export_plan import ToolConfig, check_tool, export_plan, runnable_strategies
from trainfit.integrations.read_config import FromConfig, plan_job, rank_note, read_from
from trainfit.meters.devices import (
    DeviceRow,
    clock_facts,
    device_row,
    dtypes_of,
    find_device,
    measure_host_copy,
    measure_loopback,
)
from trainfit.plan.basis import OPTIMIZER_BYTES, analytic_basis
from trainfit.plan.clock import DeviceClock, clocked_links
from trainfit.plan.offload import OFFLOAD_CHOICES, offload_as_run, offload_price
from trainfit.plan.rules import Context
from trainfit.plan.search import (
    CHECKPOINT_CHOICES,
    SearchSpace,
    needed_pairs,
    precision_choices,
    search,
    strategy_choices,
    step_floor,
)
from trainfit.plan.shapes import PlannedModel, TransformerShape, parse_model_config, plan_model, run_spec
from trainfit.plan.trainable import trainable
from trainfit.presets import GPT_PRESETS
from trainfit.progress import logger, say
from trainfit.probes.fastbasis import (
    BASIS_SOURCES,
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
from trainfit.results import PlanReport, PlanRow
from trainfit.tasks.spec import DataSpec, check_model_fits
from trainfit.units import fmt_bytes, parse_bytes
from trainfit.vocabulary import (
    Dtype,
    EveryKthBlock,
    MemoryBudget,
    OffloadPart,
    Optimizer,
    PrecisionName,
    SelectiveOps,
    canonical_precision,
    parse_checkpoint_policy,
    parse_offload,
    parse_lora,
    precision_alias_note,
    precision_facts,
    strategy_facts,
)

if TYPE_CHECKING:
    from trainfit.tasks.files import TextData


FILE_DATA_FLAGS = {
    "data": "plan for this training data (as train takes it): activations sized for the longest row it produces",
    "tokenizer": "byte or a directory holding a Hugging Face tokenizer.json "
                 "(default: the hf:DIR model's own, else the prepared data's, else byte)",
    "packing": "on (rows of seq_len tokens) or off (one document per row, the longest sets the size)",
    "text_field": "JSON Lines field / Parquet or CSV column holding the text (default text)",
    "text_errors": "bytes that are not UTF-8: strict (refuse) or replace (U+FFFD)",
}
"""The fields of ``--data`` jobs plan reads (and their help); None when not given (RunConfig's defaults then)."""


OFFLOAD_FLAG = {"none": "", "optimizer": "optimizer", "activations": "activations",
                "optimizer+activations": "activations,optimizer"}
"""``plan --offloads`` names -> ``SearchSpace.offloads`` settings (``plan.offload.OFFLOAD_CHOICES``); under zero3
"optimizer" runs as ``--offload optimizer,params``."""
assert sorted(OFFLOAD_FLAG.values()) == sorted(OFFLOAD_CHOICES)

FAST_DEFAULT_CHECKPOINTINGS = ("none", "full")
"""The checkpointing policies searched by default when the basis is traced (``--basis fast``)."""

SEARCH_NOTES = ("best: ", "nothing fits ")
"""How the search's first note starts (``plan.search``): the notes before it describe the job and its sources."""

def subsets() -> dict[str, tuple[str, ...]]:
    """What each subset flag allows, read from the tables when called (a row registered later counts)."""
    return {"precisions": precision_choices(), "checkpointings": CHECKPOINT_CHOICES, "strategies": strategy_choices()}
"""The request fields that narrow the search, and the names each takes."""


# -- field checks (each refusal names the flag, as the command line spells it) ---------------------------------------
def _int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise ConfigError(name, value, f"an integer >= {minimum}")
    try:
        v = int(value) if isinstance(value, (int, str)) else int(str(value))
    except (TypeError, ValueError):
        raise ConfigError(name, value, f"an integer >= {minimum}") from None
    if v < minimum:
        raise ConfigError(name, value, f"an integer >= {minimum}")
    return v


def _names(value: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """A comma-separated text or a sequence of names, stripped (None: not given)."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else [str(x) for x in value]
    return tuple(x.strip() for x in items if x.strip())


def _extra_policy(spec: str) -> bool:
    """every:K, selective and budget:F: the policies plan can cost beyond its defaults (a malformed one is not)."""
    try:
        policy = parse_checkpoint_policy(spec)
    except ConfigError:
        return False
    return isinstance(policy, (EveryKthBlock, SelectiveOps, MemoryBudget))


def _subset(flag: str, value: str | Sequence[str] | None) -> tuple[tuple[str, ...] | None, list[str]]:
    """``--precisions`` / ``--checkpointings`` / ``--strategies``: the names, checked; and the alias notes."""
    chosen, aliases = _names(value), []
    if chosen is None:
        return None, aliases
    if flag == "precisions":  # Lightning's and HF's spellings: trainfit's names, echoed once accepted
        aliases = [n for n in map(precision_alias_note, chosen) if n]
        chosen = tuple(canonical_precision(x) for x in chosen)
    allowed = subsets()[flag]
    bad = [x for x in chosen if x not in allowed and not (flag == "checkpointings" and _extra_policy(x))]
    if bad or not chosen:
        raise ConfigError(flag, value, allowed)
    return chosen, aliases


def _offloads(value: str | Sequence[str] | None, row: DeviceRow, *, calibrate: bool) -> tuple[str, ...] | None:
    """``--offloads``: the settings to search (None: the default, decided once the host link is known)."""
    names = _names(value)
    if names is None:
        return None
    bad = [x for x in names if x not in OFFLOAD_FLAG]
    if bad or not names:
        raise ConfigError("offloads", value, "comma-separated " + ", ".join(OFFLOAD_FLAG))
    chosen = tuple(dict.fromkeys(OFFLOAD_FLAG[x] for x in names))
    if any(chosen) and row.host_bytes_per_s is None and not calibrate:
        raise ConfigError("offloads", value, "none without a host link to price the copies",
                          f"device {row.name} has no host link in the table: with --device cpu pass --calibrate "
                          "(it measures the host copy), or --offloads none")
    return chosen


def _compile_speedup(value: Any, row: DeviceRow) -> float | str | None:
    """``--compile-speedup``: None (compile not searched), "measure" (cpu only) or a ratio > 0."""
    if value is None:
        return None
    allowed = "a positive ratio (eager step / compiled step, e.g. 1.3) or measure (with --device cpu)"
    if str(value).strip() == "measure":
        if row.peak_row is not None:
            raise ConfigError("compile-speedup", value, allowed, "measure times steps on this machine's CPU; for "
                              f"{row.name} pass the ratio measured there")
        return "measure"
    try:
        v = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        raise ConfigError("compile-speedup", value, allowed) from None
    if not 0.0 < v < math.inf:  # NaN fails too
        raise ConfigError("compile-speedup", value, allowed)
    return v


def _headroom(value: Any) -> float:
    try:
        v = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        v = math.nan
    if not 0.0 <= v < 1.0:  # NaN fails both comparisons; inf and negatives fail one
        raise ConfigError("headroom", value, "a number in [0, 1), the share of device memory kept free")
    return v


def _rate(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 1 <= value < math.inf:
        return float(value)  # bytes per second, from Python
    text, allowed = str(value), "a bandwidth of at least 1 byte/s (and at most 16 EiB/s) such as 450GB/s or 50GB/s"
    try:
        return float(parse_bytes(name, text[:-2] if text.endswith("/s") else text, allowed=allowed))
    except ConfigError:
        raise ConfigError(name, text, allowed) from None  # the text as typed, "/s" included


def _job_from(found: FromConfig, *, global_batch: Any, devices: int | None,
              nodes: int | None) -> tuple[int, int, Any, dict]:
    """``--from``: (devices per node, nodes, global batch, flags over the file) for the flags given (None: not
    given) over the file's values. The file's ``devices`` counts all ranks (``read_config.plan_job``): a flag's
    devices per node become that total here, so the file's own count and the flags' are compared alike."""
    file_nodes = int(found.values.get("nodes", 1))
    n = nodes if nodes is not None else file_nodes
    total = None
    if devices is not None:
        total = devices * n
    elif nodes is not None and "devices" in found.values:
        total = int(found.values["devices"]) // file_nodes * n  # the file's devices per node, on the nodes given
    elif nodes is not None:
        total = n  # one device per node
    job, overridden = plan_job(found, global_batch=global_batch, devices=total, nodes=nodes)
    total, n = _int("devices", job["devices"]), _int("nodes", job["nodes"])
    if total % n:  # the file's own counts (the flags' are a product)
        raise ConfigError("nodes", n, f"a divisor of the {total} devices {found.path} sets",
                          "every node holds the same number")
    return total // n, n, job["global_batch"], overridden


# -- the request ------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """A job to plan for and the search's bounds, checked when built (:class:`ConfigError` naming the field as
    the command line spells it: ``global-batch``, ``device-memory``, ...). Text is taken where the command line
    gives text (``"80GiB"``, ``"450GB/s"``, ``"bf16-mixed,fp32"``); the checked fields hold the parsed values."""

    model: str = "gpt-tiny"
    model_config: str = ""
    """key=value,... overrides of the model's config."""
    global_batch: int | str | None = None
    """Samples per optimizer step over all devices (required unless ``from_file`` sets a per-device batch)."""
    seq_len: int | str = 64
    device_memory: int | str | None = None
    """Memory per device: bytes, or text such as ``"80GiB"`` (required)."""
    devices: int | str | None = None
    """Devices per node (as torchrun's ``--nproc_per_node`` and Lightning's ``devices``); default 1."""
    nodes: int | str | None = None
    """Nodes; the plan is for ``devices x nodes`` devices. Default 1."""
    device: str = "h100"
    """A row of ``trainfit.meters.devices.DEVICES``."""
    bandwidth_intra: float | str | None = None
    """Per-device bandwidth inside a node (bytes/s, or text such as ``"450GB/s"``)."""
    bandwidth_inter: float | str | None = None
    """Per-device bandwidth between nodes."""
    optimizer: str | None = None
    """Default: the ``from_file``'s optimizer, else adamw."""
    lora: str = ""
    freeze: str = ""
    data: str | None = None
    tokenizer: str | None = None
    packing: str | None = None
    text_field: str | None = None
    text_errors: str | None = None
    headroom: float | str = 0.1
    """Share of device memory kept free."""
    basis: str = "auto"
    calibrate: bool = False
    """cpu only: fit the step times to measured steps of this model."""
    compile_speedup: float | str | None = None
    """Search torch.compile too, priced at this eager/compiled ratio, or ``"measure"`` (cpu)."""
    precisions: str | tuple[str, ...] | None = None
    checkpointings: str | tuple[str, ...] | None = None
    offloads: str | tuple[str, ...] | None = None
    strategies: str | tuple[str, ...] | None = None
    top: int | str = 10
    """Plans kept in the report."""
    explain: int | str | None = None
    """Row (1-based, at most ``top``) whose step is split into its parts (``report.extra["explain"]``)."""
    write_for: str | None = None
    """A tool (``hf-trainer``, ``accelerate``, ``lightning``) the best plan will be written for: the search
    keeps to the strategies it runs as planned on this device."""
    from_file: str | None = None
    """A TrainingArguments JSON, accelerate config YAML or Lightning Trainer arguments: its global batch,
    devices and nodes (the fields given override it) and optimizer."""

    alias_notes: tuple[str, ...] = dataclasses.field(init=False, default=(), compare=False)
    """One line per precision alias accepted (``16-mixed`` -> ``fp16-mixed``)."""
    source: FromConfig | None = dataclasses.field(init=False, default=None, repr=False, compare=False)
    """``from_file``, read."""
    overridden: dict = dataclasses.field(init=False, default_factory=dict, repr=False, compare=False)
    """The fields given over the file's values (field -> value)."""

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 -- frozen: the checked value
        check_unique_keys("model_config", self.model_config)  # the user's text: a repeated key would silently win
        devices = None if self.devices is None else _int("devices", self.devices)
        nodes = None if self.nodes is None else _int("nodes", self.nodes)
        global_batch, optimizer = self.global_batch, self.optimizer
        if self.from_file:
            found = read_from(self.from_file)
            devices, nodes, global_batch, overridden = _job_from(found, global_batch=global_batch, devices=devices,
                                                                 nodes=nodes)
            put("source", found), put("overridden", overridden)
            optimizer = optimizer if optimizer is not None else found.values.get("optimizer")
        elif global_batch is None:
            raise ConfigError("global-batch", None, "an integer >= 1", "pass --global-batch N (or --from FILE)")
        put("devices", devices or 1), put("nodes", nodes or 1)
        notes = []
        for name in subsets():
            chosen, aliases = _subset(name, getattr(self, name))
            put(name, chosen), notes.extend(aliases)
        put("alias_notes", tuple(notes))
        put("headroom", _headroom(self.headroom)), put("global_batch", _int("global-batch", global_batch))
        if self.device_memory is None:
            raise ConfigError("device-memory", None, "a size such as 80GiB", "pass --device-memory")
        put("device_memory", parse_bytes("device-memory", self.device_memory))
        put("seq_len", _int("seq", self.seq_len, 2)), put("top", _int("top", self.top))
        put("explain", None if self.explain is None else _int("explain", self.explain))
        put("bandwidth_intra", _rate("bandwidth-intra", self.bandwidth_intra))
        put("bandwidth_inter", _rate("bandwidth-inter", self.bandwidth_inter))
        self._check_search(optimizer)

    def _check_search(self, optimizer: str | None) -> None:
        """The fields that need the device row: the tool written for, compile, offload, basis, calibration."""
        row = self.row
        if self.write_for is not None:
            check_tool(self.write_for)
            self.searched_strategies()  # a --strategies the tool would run as something else: refused now
        object.__setattr__(self, "compile_speedup", _compile_speedup(self.compile_speedup, row))
        object.__setattr__(self, "offloads", _offloads(self.offloads, row, calibrate=self.calibrate))
        if self.basis not in BASIS_SOURCES:
            raise ConfigError("basis", self.basis, BASIS_SOURCES)
        if self.calibrate and row.peak_row is not None and not _calibrate().cuda_available():
            raise ConfigError("calibrate", True, "--device cpu, or a GPU row on a machine with CUDA",
                              "calibration measures this machine's CPU or CUDA device")
        object.__setattr__(self, "optimizer", str(make_config({"optimizer": optimizer or Optimizer.ADAMW}).optimizer))
        if self.explain is not None and self.explain > self.top:
            raise ConfigError("explain", self.explain, f"a row number from 1 to --top ({self.top})")

    @property
    def row(self) -> DeviceRow:
        """The device's row of ``meters.devices.DEVICES`` (refused when there is none)."""
        return device_row(self.device)

    @property
    def world_size(self) -> int:
        """Devices in all: ``devices`` per node x ``nodes``."""
        return self.devices * self.nodes

    def searched_strategies(self) -> tuple[str, ...] | None:
        """``strategies``, or with ``write_for`` those the tool runs as planned here (None: every strategy)."""
        if self.write_for is None:
            return self.strategies
        return runnable_strategies(self.write_for, self.strategies, cpu=self.row.name == "cpu",
                                   devices=self.world_size)


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
    offloads = req.offloads if req.offloads is not None else (OFFLOAD_CHOICES if r.host_bw else ("",))
    subsets = {k: v for k, v in (("precisions", req.precisions), ("checkpointings", req.checkpointings),
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
def _calibrate():
    """``trainfit.probes.calibrate``, imported on first use."""
    # lazy: calibration and the measured compile speed-up build, compile and step runs here; a plan that
    # measures nothing never imports the run
    import trainfit.probes.calibrate as calibrate

    return calibrate


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


def _offload_source(offloads: tuple[str, ...], host_bw: float | None, row) -> str:
    """The plan's source line for offload: what was searched, and the host link it is priced at."""
    searched = [x for x in offloads if x]
    if not searched:
        why = ("--offloads none" if host_bw else f"device {row.name} has no host link to price its copies"
               + (" (pass --calibrate to measure this machine's)" if row.peak_row is None else ""))
        return f"offload: not searched ({why})"
    link = (f"{host_bw / 1e9:.3g} GB/s per direction, "
            + ("the device row's datasheet host link" if row.host_bytes_per_s else "a host copy measured on this CPU"))
    return (f"offload: searched {', '.join(x.replace(',', '+') for x in searched)} (zero3 moves params with the "
            f"optimizer; zero1 offloads activations only), priced at {link}; copies not overlapped (an upper bound)")


def _offload_notes(result, basis, row, space, base) -> list[str]:
    """What offload would free and cost for the best plan (or, when nothing fits, the smallest), when the search
    did not try it (``--offloads none``, or no host link): priced by the device row's host link, if any."""
    e = result.best or min(result.entries, key=lambda x: x.peak_bytes_per_device)
    run = offload_as_run(OffloadPart.OPTIMIZER, e.strategy)  # the strategy's row: what it offloads with it
    if run is None:
        return []
    b = basis(e.precision, e.checkpointing)
    w, _, master, _ = precision_facts(e.precision).bytes_per_param
    parts = set(parse_offload(run))
    notes = []
    for chosen in (parts, {OffloadPart.ACTIVATIONS}):
        price = offload_price(parts=chosen, strategy=e.strategy, n_params=b.n_trainable or b.n_params,
                              world_size=space.devices, accumulation=e.accumulation, weight_bytes=w,
                              state_bytes_per_param=OPTIMIZER_BYTES[Optimizer(base.optimizer)],
                              master_bytes_per_param=master,
                              activation_bytes_per_micro_batch=int(e.parts.get("activations", 0)),
                              grad_sync=e.grad_sync, host_bytes_per_s=row.host_bytes_per_s)
        if not price.traffic:
            continue
        line = f"other lever for plan {'1' if result.best else '(smallest)'}: {price.reason}"
        if price.seconds_per_step is not None and e.step_s:
            line += f" (+{price.seconds_per_step / e.step_s:.0%} of its {e.step_s:.3g} s step if not overlapped)"
        if result.best is None:
            fits = e.peak_bytes_per_device - price.frees_device_bytes <= space.budget_bytes
            line += "; it would fit" if fits else "; still too big"
        notes.append(line + f" (--offload {','.join(sorted(str(p) for p in chosen))})")
    return notes


def _source_lines(basis, used: str, row, base, *, calibrate: bool, needed, clocked: bool = False) -> list[str]:
    """One line per source of the plan's numbers: the basis, the kernels it assumes, the device, the step times."""
    first = basis(*needed[0]) if needed else None
    lines = []
    if first is not None and used != "fast":
        lines.append(f"basis ({used}): {first.source}")
    elif first is not None:
        how, _, kernels = first.source.partition("; kernels of ")
        lines.append(f"basis trace: {how.removeprefix('fast trace (')}")
        lines.append(f"kernels of {kernels}" if kernels else "kernels: this machine's (cpu)")
    if used == "analytic":
        lines.append("kernels: none traced: the analytic shape counts the tensors its blocks save (flash-style "
                     "attention: no sequence-squared probabilities)")
    elif used != "fast":
        lines.append("kernels: this machine's CPU kernels (the estimate and measure bases trace or run here)")
    peak = find_device(row.peak_row) if row.peak_row else None
    lines.append(f"device {row.name} (meters.devices, every source there): " + row.source.split(";")[0]
                 + (f"; peak FLOP/s: {peak.source.split(';')[0]}" if peak else ""))
    if not clocked:
        lines.append("step times: " + ("fitted to steps measured on this machine (--calibrate)" if calibrate else
                                       f"FLOPs / ({row.achievable_frac:.0%} of the dense peak) plus the ring model of "
                                       "the links (plan.cost, plan.comm)"))
    return lines


def _clock_lines(facts: dict, tuned: bool) -> list[str]:
    """The op-level clock's source lines: how a step is priced and every coefficient's source."""
    lines = [f"step times: op by op (plan.clock) on {facts['name']}: GEMMs at max(FLOPs / {facts['gemm_share']:.0%} of "
             f"the dense peak, bytes / HBM), attention at {facts['attention_share']:.0%} of the peak (causal flash), "
             f"memory-bound ops at {facts['hbm_share']:.0%} of {facts['hbm_bytes_per_s'] / 1e12:.3g} TB/s, "
             f"{facts['kernel_s'] * 1e6:.3g} us per kernel, all / {facts['eager_share']:.2f} (eager share); "
             f"collectives at {facts['bus_share']:.0%} of the link, FSDP prefetch and DDP buckets overlapped"
             + ("; --lora/--freeze: backward priced whole (an upper bound)" if tuned else "")]
    lines.extend(f"clock source: {s}" for s in facts["sources"])
    return lines



def format_table(entries) -> str:
    mw = max([5, *(len(str(e.micro_batch)) + 1 for e in entries)])  # a 10**18 batch keeps its columns apart
    aw = max([6, *(len(str(e.accumulation)) + 1 for e in entries)])
    cw = max([8, *(len(e.checkpointing) + 1 + len(" +compile") * e.compile for e in entries)])
    head = f"{'#':>3} {'precision':<11}{'mb':>{mw}}{'acc':>{aw}} {'ckpt':<{cw}}{'strategy':<9}{'sync':<16}" \
           f"{'peak/dev':>11}{'step s':>10}{'eff':>6}  fits / reasons"
    lines = [head]
    for i, e in enumerate(entries, 1):
        n = e.peak_bytes_per_device
        peak = fmt_bytes(n)
        why = "yes" if e.fits else "no"
        if e.reasons:
            why += ": " + "; ".join(e.reasons)
        ck = e.checkpointing + (" +compile" if e.compile else "")
        lines.append(f"{i:>3} {e.precision:<11}{e.micro_batch:>{mw}}{e.accumulation:>{aw}} {ck:<{cw}}"
                     f"{e.strategy:<9}{e.grad_sync:<16}{peak:>11}{e.step_s:>10.4g}{e.scaling_efficiency:>6.0%}  {why}")
    return "\n".join(lines)


EXPLAIN_PARTS = {"compute_bound_s": "compute-bound (GEMMs, attention)",
                 "memory_bound_s": "memory-bound (norms, activations, casts, loss, optimizer step)",
                 "recompute_s": "recompute (checkpointing)", "exposed_comm_s": "exposed communication",
                 "fixed_s": "fixed cost (kernel launches, per-step overheads)",
                 "dist_overhead_s": "measured distributed overhead", "offload_s": "offload copies"}
"""``plan --explain``'s parts of a step (``plan.cost.Time.parts``), in the order printed."""


def explain_row(shown, n: int) -> dict:
    """Row ``n`` (1-based) of the plans ``shown`` split into the parts of its step (``plan --explain``)."""
    if n > len(shown):
        raise ConfigError("explain", n, f"a row number from 1 to {len(shown)} (the rows shown)")
    e = shown[n - 1]
    return {"row": n, "precision": e.precision, "micro_batch": e.micro_batch, "accumulation": e.accumulation,
            "checkpointing": e.checkpointing, "strategy": e.strategy, "grad_sync": e.grad_sync, "step_s": e.step_s,
            "parts": dict(e.time_parts)}


def format_explain(x: dict) -> str:
    """The ``--explain`` block: each part in seconds and as a share of the step."""
    head = (f"explain row {x['row']}: {x['precision']}, micro-batch {x['micro_batch']} x {x['accumulation']}, "
            f"checkpointing {x['checkpointing']}, {x['strategy']} ({x['grad_sync']}): {x['step_s']:.4g} s/step")
    step = x["step_s"] or 1.0
    lines = [head] + [f"  {label:<62}{x['parts'].get(k, 0.0):>11.4g} s {x['parts'].get(k, 0.0) / step:>6.1%}"
                      for k, label in EXPLAIN_PARTS.items() if k in x["parts"]]
    return "\n".join(lines)


# -- what a plan is turned into: the table, a config to train, another tool's configuration -------------------------
def format_plan(report: PlanReport) -> str:
    """The plan as the command prints it: the job and its sources, the table of plans, then the search's notes
    (the first of which says the best plan, or that nothing fits) and the rest."""
    n = next((i for i, note in enumerate(report.notes) if note.startswith(SEARCH_NOTES)), len(report.notes))
    return "\n".join([*report.notes[:n], format_table(report.plans), *report.notes[n:]])


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
