"""``trainfit.front.plan``'s request: :class:`PlanRequest`, every field checked when it is built (the same one-line
refusals as ``trainfit plan``'s flags), and the checks of the job's model and data it needs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trainfit.config import make_config
from trainfit.errors import ConfigError, check_unique_keys
from trainfit.gate import parse_int
from trainfit.integrations.export_plan import (
    check_tool,
    expressible_offloads,
    expressible_precisions,
    runnable_strategies,
)
from trainfit.integrations.read_config import FromConfig, plan_job, read_from
from trainfit.meters.devices import (
    DeviceRow,
    device_row,
)
from trainfit.plan.offload import OFFLOAD_CHOICES
from trainfit.plan.search import (
    CHECKPOINT_CHOICES,
    precision_choices,
    strategy_choices,
)
from trainfit.probes.fastbasis import (
    BASIS_SOURCES,
)
from trainfit.units import parse_bytes
from trainfit.vocabulary import (
    EveryKthBlock,
    MemoryBudget,
    Optimizer,
    SelectiveOps,
    canonical_precision,
    parse_checkpoint_policy,
    precision_alias_note,
)

if TYPE_CHECKING:
    pass


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
PLAN_MAX = {"global-batch": 2**63 - 1, "devices": 2**24, "nodes": 2**20, "seq": 2**24, "top": 10**6,
            "explain": 10**6}
"""The largest value of each count plan takes: a plan is arithmetic, so it takes far more than one machine runs
(a global batch up to 2**63 - 1, 16 million devices), but nothing past what its numbers can hold."""


def _int(name: str, value: Any, minimum: int = 1) -> int:
    """An integer field of the request, from Python or text, through the one integer parser (``gate.parse_int``:
    ASCII digits only, at most 19 of them) and within ``[minimum, PLAN_MAX[name]]``."""
    if not isinstance(value, (int, str)) or isinstance(value, bool):
        raise ConfigError(name, value, f"an integer >= {minimum}")
    return parse_int(name, value, minimum=minimum, maximum=PLAN_MAX.get(name))


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
    file_nodes = _int("nodes", found.values.get("nodes", 1))
    n = nodes if nodes is not None else file_nodes
    total = None
    if devices is not None:
        total = devices * n
    elif nodes is not None and "devices" in found.values:
        # the file's devices per node, on the nodes given
        total = _int("devices", found.values["devices"]) // file_nodes * n
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
        if self.global_batch is not None:  # the job's size first: a global batch past any bound is what is named
            _int("global-batch", self.global_batch)
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
            self.searched_precisions()  # and a --precisions its file cannot hold
        object.__setattr__(self, "compile_speedup", _compile_speedup(self.compile_speedup, row))
        object.__setattr__(self, "offloads", _offloads(self.offloads, row, calibrate=self.calibrate))
        if self.offloads is not None:
            self.searched_offloads(self.offloads)  # an --offloads the tool's file cannot hold: refused now
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


    def searched_precisions(self) -> tuple[str, ...] | None:
        """``precisions``, or with ``write_for`` those the tool's file holds as planned (no master copy)."""
        if self.write_for is None:
            return self.precisions
        return expressible_precisions(self.write_for, self.precisions)

    def searched_offloads(self, settings: tuple[str, ...]) -> tuple[str, ...]:
        """``settings`` (``offloads``, or the default), or with ``write_for`` those the tool's file holds under a
        searched strategy (an optimizer offload under FSDP only; no activation offload)."""
        if self.write_for is None:
            return settings
        return expressible_offloads(self.write_for, settings, self.searched_strategies(), devices=self.world_size,
                                    chosen=self.offloads is not None)


def _calibrate():
    """``trainfit.probes.calibrate``, imported on first use."""
    # lazy: calibration and the measured compile speed-up build, compile and step runs here; a plan that
    # measures nothing never imports the run
    import trainfit.probes.calibrate as calibrate

    return calibrate
