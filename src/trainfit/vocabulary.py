"""One vocabulary for every lever: the typed names, and one row of facts per precision and per strategy.

Every other module reads these rows: the CLI help, config validation, the precision and strategy
factories, the FSDP2 policy, the memory estimator's sharding, the planner's search space and cost
model, the comm model's collectives, verify's tolerances and the report's labels. Pure: no torch.

Adding a precision or a strategy = its implementation module + one row here + tests
(``docs/architecture.md`` walks through it).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from enum import StrEnum

from trainfit.errors import ConfigError
from trainfit.gate import parse_int


class PrecisionName(StrEnum):
    FP32 = "fp32"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    BF16_TRUE = "bf16-true"
    FP16_TRUE = "fp16-true"


class StrategyName(StrEnum):
    """The built-in strategies, and (looked up by value, through :meth:`_missing_`) any added by
    :func:`register_strategy`; :func:`strategy_names` lists both."""

    SINGLE = "single"
    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"

    @classmethod
    def _missing_(cls, value: object) -> StrategyName | None:
        """``StrategyName("x")`` for a name :func:`register_strategy` added (Enum's own hook for values it
        does not hold); None (a ValueError) for any other."""
        return _REGISTERED.get(value) if isinstance(value, str) else None


_REGISTERED: dict[str, StrategyName] = {}
"""The names :func:`register_strategy` added, by value (the enum's own members are left as defined)."""


class Dtype(StrEnum):
    """Arithmetic a device computes in (tf32: fp32 matmuls on tensor cores, where enabled)."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"


TORCH_DTYPE_NAMES = {Dtype.FP32: "float32", Dtype.TF32: "float32", Dtype.BF16: "bfloat16", Dtype.FP16: "float16"}
"""The ``torch`` attribute of each dtype (the torch shells look it up; the vocabulary stays pure)."""


class GradSync(StrEnum):
    DEFERRED = "deferred"
    """Sync gradients once per optimizer step (after the last micro-batch)."""
    PER_MICRO_BATCH = "per-micro-batch"
    """Reduce-scatter after every micro-batch (zero2/zero3: less memory, more traffic)."""


class Optimizer(StrEnum):
    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"


class Schedule(StrEnum):
    """Learning-rate schedule after the linear warm-up (``levers/schedule.py``)."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class LogSink(StrEnum):
    """Where per-step metrics go besides ``metrics.jsonl`` (always written)."""

    JSONL = "jsonl"
    TENSORBOARD = "tensorboard"


class TextErrors(StrEnum):
    """What reading a text file does with bytes that are not UTF-8."""

    STRICT = "strict"
    """Refuse the file, naming it and the byte offset."""
    REPLACE = "replace"
    """Decode them as U+FFFD (the byte tokenizer then sees its 3-byte UTF-8 encoding)."""


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """``--lora r=8,alpha=16,targets=q_proj,v_proj[,dropout=0.05][,merge=true]`` (LoRA through ``peft``)."""

    r: int = 8
    """Rank of the update."""
    alpha: float = 16.0
    """Scaling numerator: the update is scaled by alpha / r."""
    targets: tuple[str, ...] = ()
    """Module names (suffixes, as peft matches them) that get an adapter."""
    dropout: float = 0.0
    """Dropout on the adapter's input (0 keeps runs bitwise reproducible)."""
    merge: bool = False
    """Export the model with the adapters merged into the base weights (else the adapter alone)."""
    spec: str = ""
    """The text it was parsed from."""


LORA_KEYS = ("r", "alpha", "targets", "dropout", "merge")


def parse_lora(spec: str) -> LoraSpec | None:
    """The LoRA spec text -> a :class:`LoraSpec` (None for ""). Names after ``targets=`` that hold no ``=``
    are more targets: ``targets=q_proj,v_proj``."""
    if not isinstance(spec, str):
        raise ConfigError("lora", spec, "r=8,alpha=16,targets=q_proj,v_proj")
    if not spec.strip():
        return None
    values: dict[str, object] = {}
    targets: list[str] = []
    last = ""
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if "=" not in part:
            if last != "targets":
                raise ConfigError("lora", spec, "key=value pairs of " + ", ".join(LORA_KEYS),
                                  f"{part!r} has no '=' and does not follow targets=")
            targets.append(part)
            continue
        key, value = (s.strip() for s in part.split("=", 1))
        if key not in LORA_KEYS:
            raise ConfigError(f"lora.{key}", value, "a key of " + ", ".join(LORA_KEYS))
        last = key
        if key == "targets":
            targets.extend(t for t in value.split("+") if t)
            continue
        try:
            if key == "r":
                values[key] = parse_int("lora.r", value, minimum=1, maximum=2**16)
            elif key in ("alpha", "dropout"):
                values[key] = float(value)
            else:
                values[key] = {"true": True, "false": False, "1": True, "0": False}[value.lower()]
        except (ValueError, KeyError):
            kind = {"r": "an integer", "merge": "true or false"}.get(key, "a number")
            raise ConfigError(f"lora.{key}", value, kind) from None
    if isinstance(values.get("r", 8), int) and values.get("r", 8) < 1:
        raise ConfigError("lora.r", values["r"], "an integer >= 1")
    if not 0.0 < float(values.get("alpha", 16.0)) < float("inf"):
        raise ConfigError("lora.alpha", values["alpha"], "a finite number > 0")
    if not 0.0 <= float(values.get("dropout", 0.0)) < 1.0:
        raise ConfigError("lora.dropout", values["dropout"], "a number in [0, 1)")
    if not targets:
        raise ConfigError("lora.targets", "", "one or more module names, e.g. targets=q_proj,v_proj")
    bad = [t for t in targets if not all(c.isalnum() or c in "_.*" for c in t)]
    if bad:
        raise ConfigError("lora.targets", bad[0], "module names (letters, digits, _ and .)")
    return LoraSpec(targets=tuple(dict.fromkeys(targets)), spec=spec.strip(), **values)


def freeze_patterns(spec: str) -> list[str]:
    """``--freeze 'a.*,b'`` -> ``['a.*', 'b']`` (blanks dropped)."""
    return [p.strip() for p in spec.split(",") if p.strip()]


def match_frozen(names: list[str], spec: str, *, of: str = "", allow_all: bool = False) -> list[str]:
    """The parameter ``names`` that ``--freeze``'s fnmatch patterns select, in order: the one rule ``train``
    (``levers.finetune``) and ``plan`` (``plan.trainable``) both apply. ``of`` names the model in the message.

    Raises:
        ConfigError: a pattern selecting nothing (naming it and a few names); unless ``allow_all``, patterns
            selecting every parameter (nothing would train).
    """
    patterns = freeze_patterns(spec)
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(n, pat) for n in names):
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ConfigError("freeze", pat, f"a glob pattern matching parameter names{of}, e.g. {shown}",
                              "patterns match whole names: add a '*'")
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not allow_all and names and len(chosen) == len(names):
        raise ConfigError("freeze", spec, "patterns leaving at least one parameter to train",
                          f"they match all {len(names)} parameters")
    return chosen


def lora_target_matches(module_name: str, target: str) -> bool:
    """peft's rule for a ``target_modules`` entry: the whole name, or its last dotted components."""
    return module_name == target or module_name.endswith("." + target)


PARTS = ("params", "grads", "optimizer", "activations", "temporaries")
"""The parts memory is split into, in display order."""

PART_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
               "activations": "activations", "temporaries": "temporaries"}


# -- precision ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """verify's pass thresholds for one precision (measured on the built-ins; see tests/test_verify.py)."""

    min_cosine: float
    """Lowest gradient cosine similarity that passes."""
    max_grad_rel_error: float
    """Largest ``||g - g_ref|| / ||g_ref||`` that passes."""
    max_update_rel_error: float
    """Largest worst-tensor relative error of the parameter update that passes."""


@dataclass(frozen=True, kw_only=True)
class PrecisionFacts:
    name: PrecisionName
    label: str
    """One line for help texts and reports."""
    compute: Dtype
    """dtype matmuls run in: fp32, bf16 or fp16 (fp32 may run as tf32 on a GPU that allows it)."""
    weights: Dtype
    """dtype the model's weights are stored in."""
    autocast: Dtype | None
    """dtype autocast computes in (None: no autocast)."""
    master_copy: bool
    """An fp32 copy of the weights outside the model is what the optimizer updates."""
    loss_scaling: bool
    """Dynamic loss scaling (fp16's narrow exponent range)."""
    bytes_per_param: tuple[int, int, int, int]
    """(weights, gradients, fp32 master copy, activation element) bytes -- the planner's analytic basis."""
    tolerance: Tolerance
    """verify's thresholds."""
    lightning: str
    """Lightning's ``precision=`` spelling (its ``*-true`` keep no fp32 master copy: ``--write-for`` says so)."""
    accelerate: str | None
    """Accelerate's ``mixed_precision`` (the Hugging Face Trainer's ``bf16``/``fp16`` flags follow it); None: the
    tool has no such mode (a master copy), ``--write-for`` writes :func:`mixed_counterpart` and states the gap."""


# fp32 differs from the reference only by summation order (~1e-7 relative). Half precisions round every
# matmul input: bf16 keeps 8 mantissa bits (~4e-3 per op), fp16 keeps 11. Adam's first update is ~sign(g),
# so tiny gradients whose sign flips under rounding dominate the update error in half precision: that
# tolerance is loose on purpose, the gradient checks carry the signal.
PRECISIONS: dict[PrecisionName, PrecisionFacts] = {p.name: p for p in (
    PrecisionFacts(name=PrecisionName.FP32, label="fp32 weights and compute", compute=Dtype.FP32, weights=Dtype.FP32,
                   autocast=None, master_copy=False, loss_scaling=False, bytes_per_param=(4, 4, 0, 4),
                   tolerance=Tolerance(min_cosine=1 - 1e-6, max_grad_rel_error=1e-4, max_update_rel_error=1e-3),
                   lightning="32-true", accelerate="no"),
    PrecisionFacts(name=PrecisionName.BF16_MIXED, label="fp32 weights, bf16 autocast", compute=Dtype.BF16,
                   weights=Dtype.FP32, autocast=Dtype.BF16, master_copy=False, loss_scaling=False,
                   bytes_per_param=(4, 4, 0, 2),  # autocast casts per op: weights, grads, state stay fp32
                   tolerance=Tolerance(min_cosine=0.999, max_grad_rel_error=0.05, max_update_rel_error=1.0),
                   lightning="bf16-mixed", accelerate="bf16"),
    PrecisionFacts(name=PrecisionName.FP16_MIXED, label="fp32 weights, fp16 autocast, dynamic loss scaling",
                   compute=Dtype.FP16, weights=Dtype.FP32, autocast=Dtype.FP16, master_copy=False, loss_scaling=True,
                   bytes_per_param=(4, 4, 0, 2),
                   tolerance=Tolerance(min_cosine=0.9999, max_grad_rel_error=0.01, max_update_rel_error=1.0),
                   lightning="16-mixed", accelerate="fp16"),
    PrecisionFacts(name=PrecisionName.BF16_TRUE, label="bf16 weights + fp32 master copy", compute=Dtype.BF16,
                   weights=Dtype.BF16, autocast=None, master_copy=True, loss_scaling=False,
                   bytes_per_param=(2, 2, 4, 2),  # half weights + fp32 master (Micikevicius et al. 2018)
                   tolerance=Tolerance(min_cosine=0.995, max_grad_rel_error=0.1, max_update_rel_error=1.0),
                   lightning="bf16-true", accelerate=None),
    PrecisionFacts(name=PrecisionName.FP16_TRUE, label="fp16 weights + fp32 master copy, dynamic loss scaling",
                   compute=Dtype.FP16, weights=Dtype.FP16, autocast=None, master_copy=True, loss_scaling=True,
                   bytes_per_param=(2, 2, 4, 2),
                   tolerance=Tolerance(min_cosine=0.9995, max_grad_rel_error=0.03, max_update_rel_error=1.0),
                   lightning="16-true", accelerate=None),
)}


PRECISION_ALIASES: dict[str, tuple[PrecisionName, str]] = {
    "32": (PrecisionName.FP32, "Lightning"), "32-true": (PrecisionName.FP32, "Lightning"),
    "16": (PrecisionName.FP16_MIXED, "Lightning"), "16-mixed": (PrecisionName.FP16_MIXED, "Lightning"),
    "fp16": (PrecisionName.FP16_MIXED, "Hugging Face fp16=True"),
    "bf16": (PrecisionName.BF16_MIXED, "Lightning; Hugging Face bf16=True"),
    "16-true": (PrecisionName.FP16_TRUE, "Lightning; trainfit adds an fp32 master copy"),
}
"""The precision spellings of Lightning (``precision=``) and the Hugging Face Trainer (``bf16``/``fp16``) ->
trainfit's name and whose spelling it is. ``bf16-mixed`` and ``bf16-true`` are spelled the same in Lightning.
Lightning's ``16-true``/``bf16-true`` update half weights; trainfit's keep an fp32 master copy the optimizer
updates (same compute dtype, 4 more bytes per parameter)."""


def canonical_precision(text: str) -> str:
    """trainfit's name for a precision spelled another tool's way; any other text as given (validated later)."""
    alias = PRECISION_ALIASES.get(text.strip().lower()) if isinstance(text, str) else None
    return alias[0].value if alias else text


def precision_alias_note(text: object) -> str | None:
    """The info line echoing the canonical name of an alias (None when ``text`` is not one)."""
    alias = PRECISION_ALIASES.get(text.strip().lower()) if isinstance(text, str) else None
    return f"trainfit: precision {text.strip()} ({alias[1]}) is {alias[0].value}" if alias else None


def precision_facts(name: str) -> PrecisionFacts:
    return PRECISIONS[PrecisionName(name)]


def mixed_counterpart(name: str) -> PrecisionName:
    """The autocast precision computing in the same dtype (``bf16-true`` -> ``bf16-mixed``)."""
    compute = precision_facts(name).compute
    return next(p.name for p in PRECISIONS.values() if p.compute == compute and not p.master_copy)


class OffloadPart(StrEnum):
    """What ``--offload`` moves to host memory (``levers/offload.py``)."""

    OPTIMIZER = "optimizer"
    """Optimizer state (and its step) on the host; under zero3 with ``params``, FSDP2's CPUOffloadPolicy."""
    PARAMS = "params"
    """Parameters and gradients on the host between uses (zero3 only: FSDP2's CPUOffloadPolicy)."""
    ACTIVATIONS = "activations"
    """Tensors saved for backward go to the host (``torch.autograd.graph.save_on_cpu``, pinned with a device)."""


# -- strategy ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Collective:
    """One ring collective of a strategy's optimizer step (the comm model prices it)."""

    op: str
    """all_reduce, reduce_scatter or all_gather."""
    of: str
    """Which buffer it moves: "grads" or "params"."""
    times: str
    """"once" per optimizer step, or "per_micro_batch" (ZeRO-3 gathers freed parameters again)."""


RING_SOURCE = ("P. Patarasuk, X. Yuan, 'Bandwidth optimal all-reduce algorithms for clusters of workstations', "
               "J. Parallel Distrib. Comput. 69(2), 2009: ring all-reduce sends 2(n-1)/n x B per device")
ZERO_SOURCE = ("S. Rajbhandari et al., 'ZeRO: Memory Optimizations Toward Training Trillion Parameter Models', "
               "SC20, sec. 7 (communication analysis)")


@dataclass(frozen=True, kw_only=True)
class StrategyFacts:
    name: StrategyName
    label: str
    distributed: bool
    """Needs a process group of two or more ranks."""
    shards: tuple[str, ...]
    """Model-state parts divided by the data-parallel degree."""
    sharding_note: str
    """Where the memory rule comes from (the planner prints it)."""
    fsdp: bool = False
    """Built on FSDP2 (fully_shard): gradients reduce-scattered into shards, a mixed-precision policy."""
    reshard_after_forward: bool = False
    """FSDP2: free the gathered parameters after forward (gather again for backward)."""
    shards_optimizer_by_parameter: bool = False
    """The optimizer state is partitioned by whole parameters (ZeroRedundancyOptimizer)."""
    collectives: tuple[Collective, ...] = ()
    """The ring collectives of one optimizer step, in order (the comm model's bytes)."""
    traffic_formula: str = ""
    """Bytes sent per device per step, with G = gradient bytes and P = parameter bytes."""
    traffic_source: str = ""
    """Where the formula comes from."""
    offload_parts: frozenset[OffloadPart] = frozenset({OffloadPart.OPTIMIZER, OffloadPart.ACTIVATIONS})
    """The ``--offload`` parts it runs (``levers/offload_rules.py`` reads them). ``optimizer``: on the host by
    trainfit's host optimizer, or under ``fsdp`` by FSDP2's CPUOffloadPolicy (which moves the sharded parameters,
    their gradients and the state together). ``params``: only where the parameters are sharded, and then only
    together with ``optimizer`` (the same policy)."""
    offload_refusal: str = ""
    """Why a part missing from ``offload_parts`` cannot be offloaded under it (the refusal's reason)."""
    lightning_strategy: str = "auto"
    """Lightning's ``Trainer(strategy=...)`` that runs it: auto (one device), ddp or fsdp."""
    fsdp_sharding_strategy: str = ""
    """FSDP1's ``ShardingStrategy`` for the same ZeRO stage (Lightning's ``FSDPStrategy(sharding_strategy=...)``,
    the Hugging Face Trainer's ``fsdp="full_shard"``...); "" when not on FSDP."""
    accelerate_distributed_type: str = "NO"
    """Accelerate's ``distributed_type`` on accelerators: NO, MULTI_GPU (CPU processes: MULTI_CPU) or FSDP."""

    @property
    def grad_sync_choices(self) -> tuple[GradSync, ...]:
        """FSDP2 can reduce-scatter after each micro-batch; DDP's no_sync defers to the last one only."""
        return tuple(GradSync) if self.fsdp else (GradSync.DEFERRED,)

    @property
    def shards_params(self) -> bool:
        return "params" in self.shards

    @property
    def shards_grads(self) -> bool:
        return "grads" in self.shards


_AR = Collective(op="all_reduce", of="grads", times="once")
_RS = Collective(op="reduce_scatter", of="grads", times="once")
_AG = Collective(op="all_gather", of="params", times="once")
_AG_MB = Collective(op="all_gather", of="params", times="per_micro_batch")  # ZeRO-3 frees params after use

STRATEGIES: dict[StrategyName, StrategyFacts] = {s.name: s for s in (
    StrategyFacts(name=StrategyName.SINGLE, label="one device", distributed=False, shards=(),
                  sharding_note="one device holds everything"),
    StrategyFacts(name=StrategyName.DDP, label="data parallel (DistributedDataParallel)", distributed=True,
                  shards=(), lightning_strategy="ddp", accelerate_distributed_type="MULTI_GPU", collectives=(_AR,),
                  traffic_formula="2(n-1)/n x G",
                  traffic_source=RING_SOURCE + "; PyTorch DDP all-reduces gradient buckets once per step",
                  sharding_note="DDP replicates params, grads, optimizer state; its flat buckets hold a second "
                                "copy of the grads (PyTorch DDP, gradient_as_bucket_view=False)"),
    StrategyFacts(name=StrategyName.ZERO1, label="DDP + optimizer state sharded (ZeroRedundancyOptimizer)",
                  distributed=True, shards=("optimizer",), shards_optimizer_by_parameter=True,
                  lightning_strategy="ddp", accelerate_distributed_type="MULTI_GPU",
                  offload_parts=frozenset({OffloadPart.ACTIVATIONS}),
                  offload_refusal="ZeroRedundancyOptimizer broadcasts the stepped partition with the device's "
                                  "collective (NCCL cannot send host tensors): use --strategy ddp (the whole state "
                                  "on the host) or zero2",
                  collectives=(_RS, _AG), traffic_formula="(n-1)/n x G + (n-1)/n x P",
                  traffic_source=ZERO_SOURCE + ": stage 1/2 = reduce-scatter grads + all-gather updated params, "
                                               "same volume as DDP (2 psi)",
                  sharding_note="ZeRO stage 1 (Rajbhandari et al., SC20): optimizer state / n; trainfit's zero1 "
                                "is DDP + ZeroRedundancyOptimizer, so DDP's bucket copy of the gradients stays"),
    StrategyFacts(name=StrategyName.ZERO2, label="FSDP2, gradients and optimizer state sharded", distributed=True,
                  shards=("optimizer", "grads"), fsdp=True, collectives=(_RS, _AG),
                  lightning_strategy="fsdp", fsdp_sharding_strategy="SHARD_GRAD_OP", accelerate_distributed_type="FSDP",
                  traffic_formula="(n-1)/n x G + (n-1)/n x P",
                  traffic_source=ZERO_SOURCE + ": stage 2 = stage 1 traffic (2 psi)",
                  sharding_note="ZeRO stage 2: + gradients / n (FSDP2, reshard_after_forward=False keeps the "
                                "gathered compute copy of the params between forward and backward)"),
    StrategyFacts(name=StrategyName.ZERO3, label="FSDP2, parameters, gradients and optimizer state sharded",
                  distributed=True, shards=("optimizer", "grads", "params"), fsdp=True, reshard_after_forward=True,
                  lightning_strategy="fsdp", fsdp_sharding_strategy="FULL_SHARD", accelerate_distributed_type="FSDP",
                  offload_parts=frozenset(OffloadPart),
                  collectives=(_AG_MB, _RS, _AG_MB),
                  traffic_formula="2K x (n-1)/n x P + (n-1)/n x G  (K micro-batches; K=1: ~1.5x DDP)",
                  traffic_source=ZERO_SOURCE + ": stage 3 all-gathers params in forward and again in backward, "
                                 "reduce-scatters grads: 3 psi = 1.5x DDP; the gathers repeat for every micro-batch",
                  sharding_note="ZeRO stage 3: + params / n (FSDP2 gathers a unit at a time; at the activation "
                                "peak at most the largest unit is whole)"),
)}


def strategy_facts(name: str) -> StrategyFacts:
    return STRATEGIES[StrategyName(name)]


def register_strategy(facts: StrategyFacts) -> StrategyName:
    """Add a strategy: its name becomes a :class:`StrategyName` (looked up by value) and its row joins
    :data:`STRATEGIES`, so everything that reads them -- config validation, the planner's search space and
    rules, the run (``strategies.make_strategy`` picks the implementation from the row), offload,
    ``--write-for`` -- sees it. For a plugin's or a test's row; the built-in rows are listed above. The enum
    itself is not changed: the name is found through its ``_missing_`` hook. Returns the new name.

    Raises:
        ValueError: the name is taken, or is not a lower-case name of letters, digits, ``-`` and ``_``.
    """
    value = str(facts.name)
    if value in strategy_names() or not value or not all(c.islower() or c.isdigit() or c in "-_" for c in value):
        raise ValueError(f"strategy name {value!r}: taken, or not lower-case letters, digits, - and _")
    member = str.__new__(StrategyName, value)  # a value-only member, as Enum's _missing_ hook may return
    member._name_, member._value_ = value.upper().replace("-", "_"), value
    _REGISTERED[value] = member
    STRATEGIES[member] = dataclasses.replace(facts, name=member)
    return member


def unregister_strategy(name: str) -> None:
    """Remove a row :func:`register_strategy` added (a built-in row cannot be removed)."""
    member = StrategyName(name)
    if member in _BUILTIN_STRATEGIES:
        raise ValueError(f"strategy {name!r} is built in")
    del STRATEGIES[member]
    del _REGISTERED[member.value]


def strategy_names() -> tuple[StrategyName, ...]:
    """Every strategy a config may name: the built-in ones and those :func:`register_strategy` added."""
    return tuple(STRATEGIES)


_BUILTIN_STRATEGIES = tuple(STRATEGIES)


def distributed_strategies() -> tuple[StrategyName, ...]:
    """The strategies that need a process group, read from the table when called (registered rows included)."""
    return tuple(s.name for s in STRATEGIES.values() if s.distributed)


def __getattr__(name: str):
    # DISTRIBUTED, read from the table when asked for (a constant would copy it at import, before any row is
    # registered); a caller that keeps it (``from trainfit.vocabulary import DISTRIBUTED``) still holds a copy:
    # call distributed_strategies() where the answer is needed.
    if name == "DISTRIBUTED":
        return distributed_strategies()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def refusal(strategy: str, precision: str) -> str | None:
    """Why ``strategy`` cannot run ``precision`` (None when it can): the one compatibility rule.

    FSDP2 shards the model's own parameters; a precision whose optimizer updates fp32 master copies kept
    outside the model would leave those unsharded (every rank holding all of them) and shard half weights
    the optimizer never updates.
    """
    s, p = strategy_facts(strategy), precision_facts(precision)
    if not (s.fsdp and p.master_copy):
        return None
    mixed = mixed_counterpart(precision)
    scaler = (", with a loss scaler that checks each rank's gradient shard and agrees on overflow across ranks"
              if p.loss_scaling else "")
    return (f"the fp32 master copies of {p.name} live outside the model, so FSDP2 cannot shard them (every rank "
            f"would hold all of them) and the half weights it would shard are not what the optimizer updates; use "
            f"{mixed}: under {s.name} FSDP2 keeps the weights sharded in fp32 (the master copy, sharded) and computes "
            f"in {p.compute} (MixedPrecisionPolicy param_dtype={p.compute}, reduce_dtype=float32){scaler}")


def check_compatible(strategy: str, precision: str) -> None:
    """Raise ConfigError (naming the precision, what is allowed and why) when ``strategy`` cannot run it."""
    why = refusal(strategy, precision)
    if why:
        allowed = choices(p for p in PRECISIONS if refusal(strategy, p) is None)
        raise ConfigError("precision", precision, f"{allowed} with strategy={strategy}", why)


def choices(names) -> str:
    """``a, b or c`` for help texts."""
    names = [str(n) for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


# -- activation checkpointing policy -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class NoCheckpointing:
    """Keep every activation (fastest, most memory)."""

    @property
    def spec(self) -> str:
        return "none"


@dataclass(frozen=True, kw_only=True)
class EveryBlock:
    """Checkpoint every repeated block of the model."""

    @property
    def spec(self) -> str:
        return "full"


@dataclass(frozen=True, kw_only=True)
class EveryKthBlock:
    """Selective: checkpoint every k-th block (blocks 0, k, 2k, ...)."""

    k: int
    """Stride between checkpointed blocks; k=1 is the same as full."""

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ConfigError("checkpointing", f"every:{self.k}", "every:K with an integer K >= 1")

    @property
    def spec(self) -> str:
        return f"every:{self.k}"


@dataclass(frozen=True, kw_only=True)
class ByClassName:
    """Checkpoint every module whose class name is listed (for any model)."""

    names: tuple[str, ...]
    """Module class names, e.g. ("LlamaDecoderLayer",)."""

    def __post_init__(self) -> None:
        if not self.names or not all(isinstance(n, str) and n for n in self.names):
            raise ConfigError("checkpointing", self.spec, "class:Name[,Name...] with non-empty names")

    @property
    def spec(self) -> str:
        return "class:" + ",".join(self.names)


@dataclass(frozen=True, kw_only=True)
class SelectiveOps:
    """Op-level selective checkpointing inside every block: the outputs of matmuls and attention are saved,
    cheap pointwise ops are recomputed in backward (``torch.utils.checkpoint``'s selective-checkpoint contexts)."""

    @property
    def spec(self) -> str:
        return "selective"


@dataclass(frozen=True, kw_only=True)
class MemoryBudget:
    """Keep at most ``fraction`` of the activation bytes that no checkpointing keeps (``budget:0.5``)."""

    fraction: float
    """Share in [0, 1] of the un-checkpointed activations kept (0: like full, 1: like none)."""

    def __post_init__(self) -> None:
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ConfigError("checkpointing", f"budget:{f}", "budget:F with a number F in [0, 1]")

    @property
    def spec(self) -> str:
        return f"budget:{self.fraction:g}"


CheckpointPolicy = NoCheckpointing | EveryBlock | EveryKthBlock | ByClassName | SelectiveOps | MemoryBudget
CHECKPOINT_SPECS = ("none", "full", "every:K", "class:Name[,Name]", "selective", "budget:F")


def parse_checkpoint_policy(spec: str) -> CheckpointPolicy:
    """Parse ``none``, ``full``, ``every:K`` or ``class:Name[,Name]``."""
    s = str(spec).strip()
    if s == "none":
        return NoCheckpointing()
    if s in ("full", "block", "every-block"):
        return EveryBlock()
    if s.startswith("every:"):
        try:
            k = parse_int("checkpointing", s.split(":", 1)[1], maximum=2**20)
        except ConfigError:
            raise ConfigError("checkpointing", spec, CHECKPOINT_SPECS) from None
        return EveryKthBlock(k=k)
    if s.startswith("class:"):
        return ByClassName(names=tuple(n.strip() for n in s.split(":", 1)[1].split(",")))
    if s == "selective":
        return SelectiveOps()
    if s.startswith("budget:"):
        try:
            fraction = float(s.split(":", 1)[1])
        except ValueError:
            raise ConfigError("checkpointing", spec, "budget:F with a number F in [0, 1]") from None
        return MemoryBudget(fraction=fraction)
    raise ConfigError("checkpointing", spec, CHECKPOINT_SPECS)


# -- compile and offload ---------------------------------------------------------------------------------------
class CompileScope(StrEnum):
    """What ``torch.compile`` wraps (``levers/compile.py``)."""

    BLOCKS = "blocks"
    """Each repeated block on its own (torchtitan's pattern: one graph reused by every block)."""
    MODEL = "model"
    """The whole model as one graph."""


class CompileMode(StrEnum):
    """``torch.compile``'s ``mode``."""

    DEFAULT = "default"
    REDUCE_OVERHEAD = "reduce-overhead"
    MAX_AUTOTUNE = "max-autotune"
    MAX_AUTOTUNE_NO_CUDAGRAPHS = "max-autotune-no-cudagraphs"


def parse_offload(spec: str) -> frozenset[OffloadPart]:
    """``--offload optimizer,activations`` -> the parts moved to host memory ("" or "none": nothing)."""
    if not isinstance(spec, str):
        raise ConfigError("offload", spec, "a string: comma-separated " + ", ".join(OffloadPart))
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if names == ["none"]:
        return frozenset()
    bad = [n for n in names if n not in tuple(OffloadPart)]
    if bad:
        raise ConfigError("offload", spec, "none or comma-separated " + ", ".join(OffloadPart), f"{bad[0]!r} is not one")
    return frozenset(OffloadPart(n) for n in names)
