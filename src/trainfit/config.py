"""The run configuration: one frozen, keyword-only dataclass validated at construction.

Every field is documented once, right under it. A TOML file and the CLI flags both
produce a :class:`RunConfig`; unknown keys are refused with the list of known ones.
Derive variants with ``dataclasses.replace``; never mutate.

The fields fall into six sections (:data:`SECTIONS`: model, data, levers, distribution, schedule, run). Each
has a frozen keyword-only dataclass generated from RunConfig's own fields (:data:`SECTION_CLASSES`, e.g.
:class:`LeversSection`); ``cfg.section("levers")`` gives one, :meth:`RunConfig.from_sections` builds a config
from them (validated as any RunConfig). A TOML config is written in tables of the same names
(:func:`dump_toml`); :func:`load_toml` reads them, and still reads the flat keys of earlier versions (one
warning line gives the sectioned spelling, none for the config.toml trainfit wrote into its own run directory).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

from trainfit.errors import (
    ConfigError,
    check_choice,
    check_int,
    check_number,
    check_patterns,
    check_unique_keys,
    shown,
)
from trainfit.gate import parse_int, read_document
from trainfit.outputs import check_path_text, owns
from trainfit.tasks.corpus import validation_split  # a DatasetDict --data brings its own validation split
from trainfit.units import parse_bytes
from trainfit.vocabulary import (
    CheckpointPolicy,
    CompileMode,
    CompileScope,
    GradSync,
    LogSink,
    Optimizer,
    PrecisionName,
    Schedule,
    StrategyName,
    TextErrors,
    canonical_precision,
    check_compatible,
    parse_checkpoint_policy,
    parse_lora,
    parse_offload,
    strategy_names,
)

MAX_WORKERS = max(8, 4 * (os.cpu_count() or 1))
"""Most DataLoader workers a run may start on this machine (each is a process; 99999 would exhaust it)."""

MAX_SEED = 2**32 - 1
"""Largest seed: torch accepts 64 bits, but numpy's legacy generators and offsets added per rank need 32."""

MAX_STEPS = 10**9
"""Most optimizer steps (and steps between checkpoints, exports, evaluations) a run is given: a billion steps is
past any run; a larger count is a typo, and the loops and schedules would compute with it."""

MAX_COUNTS: dict[str, int] = {
    "micro_batch": 2**20, "accumulation": 2**20, "global_batch": 2**30, "seq_len": 2**24, "devices": 2**16,
    "steps": MAX_STEPS, "dataset_size": 2**31 - 1, "checkpoint_every": MAX_STEPS, "keep_checkpoints": 10**6,
    "max_consecutive_skips": MAX_STEPS, "save_every": MAX_STEPS, "warmup_steps": MAX_STEPS, "eval_every": MAX_STEPS,
    "eval_batches": 2**31 - 1, "memory_cap": 2**64,
}
"""The largest value of each count field (``docs/reliability.md`` lists them): what one run can use, so that a
typo (``--global-batch 10000000000000``) is refused in one line naming the bound instead of allocating, looping or
overflowing later. Samples: 2**30 per step over all ranks, 2**20 per micro-batch; tokens: 2**24 per sequence."""

_ENUMS = {"precision": PrecisionName, "strategy": StrategyName, "grad_sync": GradSync, "optimizer": Optimizer,
          "schedule": Schedule, "log": LogSink, "text_errors": TextErrors,
          "compile_mode": CompileMode, "compile_scope": CompileScope}
"""Fields holding a typed name: validated against the vocabulary, then stored as the enum member."""

@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one training run needs. Defaults are the embedded CPU-friendly job."""

    model: str = "gpt-tiny"
    """Built-in name (gpt-tiny, gpt-small, gpt2-small, cnn), ``hf:ArchitectureClass`` or ``module:callable``."""
    model_config: str = ""
    """Overrides for the model: ``key=value,...`` or a path to a JSON config (HF models)."""
    seq_len: int = 64
    """Longest sequence in tokens (sequences vary in length below it and are padded)."""
    precision: PrecisionName = PrecisionName.FP32
    """One of the vocabulary's precisions (``trainfit train --help`` lists them)."""
    micro_batch: int | Literal["auto"] = 8
    """Samples per forward/backward on one device, or "auto" to shrink it on out-of-memory."""
    accumulation: int = 4
    """Micro-batches per optimizer step."""
    checkpointing: CheckpointPolicy = field(default_factory=lambda: parse_checkpoint_policy("none"))
    """Activation checkpointing: none, full (every block), every:K (every K-th block), class:Name[,Name]."""
    strategy: StrategyName = StrategyName.SINGLE
    """One of the vocabulary's strategies; the distributed ones need a process group (torchrun)."""
    grad_sync: GradSync = GradSync.DEFERRED
    """Under zero2/zero3 with accumulation: "deferred" (one reduce-scatter per step, more memory)
    or "per-micro-batch" (reduce-scatter every micro-batch, less memory, more traffic)."""
    devices: int = 1
    """Processes (one per device) to launch on this node with torchrun (``trainfit train --devices N``)."""
    global_batch: int = 0
    """Samples per optimizer step over all ranks; when > 0 each rank's accumulation is derived from it
    (global_batch / (world_size x micro_batch)), so the step is the same on any world size. 0: micro_batch x
    accumulation x world_size."""
    collective_timeout_s: float = 300.0
    """Seconds a collective may wait for the other ranks before this rank fails (a dead peer must not hang it)."""
    optimizer: Optimizer = Optimizer.ADAMW
    """adamw, adam or sgd."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value after unscaling; 0 disables clipping."""
    steps: int = 250
    """Optimizer steps to run."""
    seed: int = 0
    """Seed for model init, data order and generated data."""
    dataset_size: int = 4096
    """Number of generated samples in the built-in dataset (one epoch)."""
    loader_workers: int = 0
    """DataLoader worker processes (0: load in the training process)."""
    run_dir: str = "runs/default"
    """Where metrics.jsonl and checkpoints go."""
    checkpoint_every: int = 50
    """Save a checkpoint every N optimizer steps (0: only at the end); on by default so a killed run loses at
    most 50 steps."""
    keep_checkpoints: int = 3
    """How many most recent checkpoints to keep."""
    max_consecutive_skips: int = 20
    """Stop if this many optimizer steps in a row are skipped for overflow."""
    min_loss_scale: float = 1.0
    """Stop if the dynamic loss scale falls below this floor."""
    memory_cap: int = 0
    """Bytes; when > 0 the memory tracker raises out-of-memory above it (CPU stand-in for a device limit)."""
    checkpoint_minutes: float = 30.0
    """Also save a checkpoint when this many minutes passed since the last one (0: by steps only); whichever of
    checkpoint_every and checkpoint_minutes comes first."""

    # -- data from files (empty ``data``: the task's generated data) -------------------------------------------
    data: str = ""
    """Training data: a text file, a directory or glob of text files (one document per file), JSON Lines,
    Parquet or CSV (one document per row), or a directory written by ``trainfit prepare``."""
    text_field: str = "text"
    """The field (JSON Lines) or column (Parquet, CSV) that holds each document's text."""
    text_errors: TextErrors = TextErrors.STRICT
    """Bytes that are not UTF-8 in a text file: "strict" refuses the file naming the offset, "replace" reads U+FFFD."""
    tokenizer: str = ""
    """"byte" (256 byte ids + an end-of-document id; nothing to download) or a directory with a Hugging Face
    ``tokenizer.json``; "" (not given): the model's own (``hf:DIR`` holding tokenizer.json), else the one a prepared
    ``data`` directory was made with, else byte. ``trainfit train`` records the one it used in config.toml."""
    packing: bool = True
    """True: documents joined with an end-of-document token and cut into seq_len rows (pretraining); False: one
    document per row, truncated to seq_len and padded, padding not counted by the loss (fine-tuning)."""
    val_fraction: float = 0.0
    """Fraction of the documents (the last ones) held out for validation."""
    val_data: str = ""
    """Validation data in any of ``data``'s formats (instead of val_fraction)."""

    # -- weights ---------------------------------------------------------------------------------------------
    init_from: str = ""
    """A trainfit run directory whose newest checkpoint (or exported model) initialises the weights; the optimizer,
    schedule and data order start fresh."""
    freeze: str = ""
    """Comma-separated glob patterns of parameter names to freeze (no gradient, no optimizer state)."""
    lora: str = ""
    """LoRA adapters through peft: r=8,alpha=16,targets=q_proj,v_proj[,dropout=0.05][,merge=true]; the base
    weights are frozen."""
    save_every: int = 0
    """Also export the model to RUN_DIR/model every N steps (it is always exported at the end)."""

    # -- schedule, evaluation, logs ----------------------------------------------------------------------------
    schedule: Schedule = Schedule.CONSTANT
    """Learning rate after warm-up: constant, linear (to min_lr at the last step) or cosine (to min_lr)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to lr."""
    min_lr: float = 0.0
    """Learning rate the linear and cosine schedules end at."""
    eval_every: int = 0
    """Compute the validation loss every N optimizer steps and at the end (0: never); needs a validation split."""
    eval_batches: int = 0
    """Micro-batches per rank an evaluation reads (0: the whole validation split)."""
    log: LogSink = LogSink.JSONL
    """Also write the per-step metrics as TensorBoard event files (RUN_DIR/tensorboard); metrics.jsonl always."""

    # -- more levers: compile, offload ---------------------------------------------------------------------------
    compile: bool = False
    """Run the model through ``torch.compile`` (``levers/compile.py``)."""
    compile_mode: CompileMode = CompileMode.DEFAULT
    """``torch.compile``'s mode: default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs."""
    compile_scope: CompileScope = CompileScope.BLOCKS
    """blocks: each repeated block compiled on its own (the whole model when it has none); model: one graph."""
    offload: str = ""
    """Comma-separated parts kept in host memory: optimizer, params (zero3), activations; "" keeps all on the device."""

    def __post_init__(self) -> None:
        self._check_values()
        self._check_texts()
        self._check_combinations()

    def _check_values(self) -> None:
        """The typed names (stored as their enum members), the counts and the numbers, each by its range."""
        for key, enum in _ENUMS.items():  # a typed name: check, then store the member
            check_choice(key, getattr(self, key), strategy_names() if enum is StrategyName else tuple(enum))
            object.__setattr__(self, key, enum(getattr(self, key)))
        if self.micro_batch != "auto":
            _check_count("micro_batch", self.micro_batch, minimum=1)
        _check_count("accumulation", self.accumulation, minimum=1)
        _check_count("seq_len", self.seq_len, minimum=2)
        check_compatible(self.strategy, self.precision)  # e.g. a master-copy precision cannot be sharded by FSDP2
        _check_count("devices", self.devices, minimum=1)
        _check_count("global_batch", self.global_batch, minimum=0)
        check_number("collective_timeout_s", self.collective_timeout_s, minimum=0.0)
        check_number("lr", self.lr, minimum=0.0)
        check_number("weight_decay", self.weight_decay, minimum=0.0, inclusive=True)
        check_number("grad_clip", self.grad_clip, minimum=0.0, inclusive=True)
        _check_count("steps", self.steps, minimum=1)
        check_int("seed", self.seed, minimum=0, maximum=MAX_SEED,
                  fix="seeds feed torch and numpy generators, whose seeds are 32-bit here")
        _check_count("dataset_size", self.dataset_size, minimum=1)
        check_int("loader_workers", self.loader_workers, minimum=0, maximum=MAX_WORKERS,
                  fix=f"this machine has {os.cpu_count()} CPUs; each worker is a process")
        _check_count("checkpoint_every", self.checkpoint_every, minimum=0)
        _check_count("keep_checkpoints", self.keep_checkpoints, minimum=1)
        _check_count("max_consecutive_skips", self.max_consecutive_skips, minimum=1)
        check_number("min_loss_scale", self.min_loss_scale, minimum=0.0)
        _check_count("memory_cap", self.memory_cap, minimum=0)

    def _check_texts(self) -> None:
        """The model, the run directory, the checkpointing policy and the data's text fields: strings, non-empty
        where they must be, paths without control characters."""
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", self.model, "a built-in name, hf:Class or module:callable")
        if not isinstance(self.model_config, str):
            raise ConfigError("model_config", self.model_config, "a string: key=value,... or a JSON config path")
        if not isinstance(self.run_dir, str) or not self.run_dir.strip():
            raise ConfigError("run_dir", self.run_dir, "a non-empty directory path")
        check_path_text("run_dir", self.run_dir)  # control characters / non-UTF-8 bytes cannot round-trip
        if not isinstance(self.checkpointing, CheckpointPolicy):
            raise ConfigError("checkpointing", self.checkpointing, "none, full, every:K, class:Name")
        check_number("checkpoint_minutes", self.checkpoint_minutes, minimum=0.0, inclusive=True)
        for key in ("data", "text_field", "tokenizer", "val_data", "init_from", "freeze", "lora"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(key, getattr(self, key), "a string")
        for key in ("data", "val_data", "init_from", "tokenizer"):
            if getattr(self, key):
                check_path_text(key, getattr(self, key))
        if not self.text_field.strip():
            raise ConfigError("text_field", self.text_field, "a non-empty field or column name")
        if self.tokenizer and not self.tokenizer.strip():
            raise ConfigError("tokenizer", self.tokenizer, '"byte" or a directory holding tokenizer.json')
        if not isinstance(self.packing, bool):
            raise ConfigError("packing", self.packing, "on or off (true or false)")

    def _check_combinations(self) -> None:
        """The validation split, the weights' levers (lora, freeze), compile, offload, exports, the schedule and
        evaluation: each alone and with the fields it depends on."""
        check_number("val_fraction", self.val_fraction, minimum=0.0, inclusive=True)
        if self.val_fraction >= 1.0:
            raise ConfigError("val_fraction", self.val_fraction, "a number in [0, 1)")
        if self.val_fraction and self.val_data:
            raise ConfigError("val_data", self.val_data, "empty when val_fraction is set",
                              "give --val-fraction or --val-data, not both")
        if (self.val_fraction or self.val_data) and not self.data:
            raise ConfigError("val_fraction" if self.val_fraction else "val_data",
                              self.val_fraction or self.val_data, "a validation split of --data",
                              "pass --data PATH; the generated data has no validation split")
        check_unique_keys("lora", self.lora)
        parse_lora(self.lora)  # refuses a malformed spec, naming lora.<key>
        check_patterns("freeze", self.freeze)
        if not isinstance(self.compile, bool):
            raise ConfigError("compile", self.compile, "on or off (true or false)")
        parse_offload(self.offload)  # refuses an unknown part, naming offload
        _check_count("save_every", self.save_every, minimum=0)
        _check_count("warmup_steps", self.warmup_steps, minimum=0)
        check_number("min_lr", self.min_lr, minimum=0.0, inclusive=True)
        if self.min_lr > self.lr:
            raise ConfigError("min_lr", self.min_lr, f"a number <= lr={self.lr:g}")
        _check_count("eval_every", self.eval_every, minimum=0)
        _check_count("eval_batches", self.eval_batches, minimum=0)
        if self.eval_every and not (self.val_fraction or self.val_data or validation_split(self.data)):
            raise ConfigError("eval_every", self.eval_every, "0 without a validation split",
                              "pass --val-fraction F or --val-data PATH to evaluate on")

    def to_dict(self) -> dict[str, Any]:
        """Plain values (typed names as their strings): what TOML, JSON and checkpoints hold."""
        d = dataclasses.asdict(self)
        d["checkpointing"] = self.checkpointing.spec
        for key in _ENUMS:
            d[key] = str(d[key])
        return d

    def section(self, name: str) -> Any:
        """The fields of one section (``"levers"``, ...: see :data:`SECTIONS`) as its frozen dataclass."""
        if name not in SECTIONS:
            raise ConfigError("section", name, tuple(SECTIONS))
        return SECTION_CLASSES[name](**{key: getattr(self, key) for key in SECTIONS[name]})

    def sections(self) -> dict[str, Any]:
        """Every section, by name, in :data:`SECTIONS` order."""
        return {name: self.section(name) for name in SECTIONS}

    @classmethod
    def from_sections(cls, *sections: Any, base: RunConfig | None = None) -> RunConfig:
        """A config from section objects (``RunConfig.from_sections(LeversSection(precision="bf16-mixed"))``);
        a section not given keeps ``base``'s values (the defaults without one). Validated as any RunConfig."""
        values: dict[str, Any] = {}
        seen: set[str] = set()
        for sec in sections:
            name = getattr(type(sec), "section_name", None)
            if name not in SECTION_CLASSES or type(sec) is not SECTION_CLASSES[name]:
                known = ", ".join(c.__name__ for c in SECTION_CLASSES.values())
                raise TypeError(f"from_sections takes section objects ({known}), not {type(sec).__name__}")
            if name in seen:
                raise TypeError(f"from_sections: the {name} section is given twice")
            seen.add(name)
            values.update({key: getattr(sec, key) for key in SECTIONS[name]})
        return dataclasses.replace(base or cls(), **values)


FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig))

SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("model", "model_config", "init_from", "freeze", "lora"),
    "data": ("data", "text_field", "text_errors", "tokenizer", "packing", "seq_len", "val_fraction", "val_data",
             "dataset_size", "loader_workers"),
    "levers": ("precision", "micro_batch", "accumulation", "checkpointing", "offload", "compile", "compile_mode",
               "compile_scope"),
    "distribution": ("strategy", "grad_sync", "devices", "global_batch", "collective_timeout_s"),
    "schedule": ("optimizer", "lr", "weight_decay", "grad_clip", "steps", "schedule", "warmup_steps", "min_lr"),
    "run": ("seed", "run_dir", "checkpoint_every", "checkpoint_minutes", "keep_checkpoints", "save_every",
            "eval_every", "eval_batches", "log", "max_consecutive_skips", "min_loss_scale", "memory_cap"),
}
"""Which section of a config each RunConfig field belongs to: the TOML tables, the groups of ``--help``."""

SECTION_OF: dict[str, str] = {key: name for name, keys in SECTIONS.items() for key in keys}
"""The section each field belongs to (the inverse of :data:`SECTIONS`)."""


def _check_count(field: str, value: object, *, minimum: int) -> None:
    """A count field: an integer from ``minimum`` to its bound in :data:`MAX_COUNTS`, the bound stated."""
    check_int(field, value, minimum=minimum, maximum=MAX_COUNTS[field],
              fix=f"at most {MAX_COUNTS[field]:,}: more than one run can use (a typo?)")


def _field_docs() -> dict[str, str]:
    """Each RunConfig field's docstring: the string right under it in this file (read once, not restated)."""
    try:
        tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):  # no source shipped: the sections go without field docs
        return {}
    body = next(n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunConfig")
    return {a.target.id: inspect.cleandoc(b.value.value) for a, b in zip(body, body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}


FIELD_DOCS: dict[str, str] = _field_docs()
"""The docstring of each RunConfig field (also each section field's ``metadata["doc"]``)."""


def _section_class(name: str, keys: tuple[str, ...]) -> type:
    """A frozen keyword-only dataclass holding ``keys`` with RunConfig's types, defaults and docs."""
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    specs = []
    for key in keys:
        f = fields[key]
        default = ({"default": f.default} if f.default is not dataclasses.MISSING
                   else {"default_factory": f.default_factory})
        specs.append((key, f.type, field(**default, metadata={"doc": FIELD_DOCS.get(key, "")})))
    cls_name = f"{name.capitalize()}Section"
    cls = dataclasses.make_dataclass(cls_name, specs, frozen=True, kw_only=True, namespace={"section_name": name})
    cls.__module__ = __name__  # pickled and shown as trainfit.config.LeversSection, where it is bound below
    lines = [f"The [{name}] section of a :class:`RunConfig` (``cfg.section({name!r})``); not validated on its "
             "own: :meth:`RunConfig.from_sections` validates the whole config.", ""]
    lines += [f"{key}: {FIELD_DOCS.get(key, '')}".replace("\n", " ") for key in keys]
    cls.__doc__ = "\n".join(lines)
    return cls


SECTION_CLASSES: dict[str, type] = {name: _section_class(name, keys) for name, keys in SECTIONS.items()}
"""The dataclass of each section, by name."""
ModelSection = SECTION_CLASSES["model"]
DataSection = SECTION_CLASSES["data"]
LeversSection = SECTION_CLASSES["levers"]
DistributionSection = SECTION_CLASSES["distribution"]
ScheduleSection = SECTION_CLASSES["schedule"]
RunSection = SECTION_CLASSES["run"]


def coerce(key: str, value: Any) -> Any:
    """Convert a raw TOML/CLI value for ``key`` into the dataclass field's type."""
    if key == "checkpointing":
        return value if isinstance(value, CheckpointPolicy) else parse_checkpoint_policy(str(value))
    if key == "memory_cap":
        return 0 if value in (0, "0", "", None) else parse_bytes(key, value)
    if key == "micro_batch" and value == "auto":
        return value
    if key == "precision":  # Lightning's and the HF Trainer's spellings (vocabulary.PRECISION_ALIASES)
        return canonical_precision(value)
    default = getattr(RunConfig(), key)
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in _BOOLS:
            return _BOOLS[value.lower()]
        return value
    if isinstance(default, int) and isinstance(value, str):  # "²" and "١٢" pass isdigit/int(): not here
        return _int_text(key, value)
    if isinstance(default, float) and isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            raise ConfigError(key, value, "a number") from None
    return value


def _int_text(key: str, text: str) -> int:
    """An integer field's text through the one parser (``gate.parse_int``); a count's refusal states its bound."""
    try:
        return parse_int(key, text)
    except ConfigError:
        if key not in MAX_COUNTS:
            raise
        raise ConfigError(key, text, f"an integer of at most {MAX_COUNTS[key]:,}", "in ASCII digits") from None


_BOOLS = {"on": True, "off": False, "true": True, "false": False, "yes": True, "no": False}

ALIASES = {"nproc": "devices"}
"""Earlier names of config keys, still read (a config written by an older trainfit keeps working)."""


def unaliased(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with earlier names (:data:`ALIASES`) under the field's own; a field given under both names
    (``nproc`` beside ``devices``) is refused, not resolved by whichever comes last."""
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in values.items():
        name = ALIASES.get(key, key)
        if name in out:
            raise ConfigError(key, value, f"one of {spelled[name]} and {key}, not both",
                              f"{'nproc is the earlier name of devices' if name == 'devices' else 'the same field'}"
                              f"; {spelled[name]}={shown(out[name], 60)} is given too: keep one")
        out[name], spelled[name] = value, key
    return out


def make_config(values: Mapping[str, Any], *, base: RunConfig | None = None) -> RunConfig:
    """Build a RunConfig from a mapping -- flat keys, or section tables as :func:`dump_toml` writes them
    (``{"levers": {"precision": ...}}``) -- refusing unknown keys by name."""
    values = unaliased(flatten(values))
    for key in values:
        if key not in FIELDS:
            raise ConfigError("config key", key, FIELDS, f"a section: write [{key}] and its keys under it"
                              if key in SECTIONS else "remove or rename it")
    coerced = {k: coerce(k, v) for k, v in values.items()}
    return dataclasses.replace(base or RunConfig(), **coerced)


_OWN_CONFIG = re.compile(r"config\.toml|launch(-node\d+)?\.toml")
"""The configs trainfit writes into a run directory (train's record, the launcher's job for its workers)."""


class FlatConfigWarning(UserWarning):
    """A TOML config in the flat spelling of earlier versions: read as before; the message gives the tables."""


def _is_table(key: str, value: Any) -> bool:
    """A section table (``[levers]``), not a flat key -- ``model``, ``data`` and ``schedule`` are both a field
    (a string) and a section (a table)."""
    return isinstance(value, Mapping)  # no field's own value is a table


def flatten(data: Mapping[str, Any], *, where: str = "config") -> dict[str, Any]:
    """The flat keys of a config given in section tables (``{"levers": {"precision": ...}}``) or flat.

    Refused, in one line each: an unknown table, a key in the wrong table (naming where it belongs), flat keys
    beside tables. ``where`` names the file in the mixed-spelling refusal. Keys are checked against the fields
    by :func:`make_config`; this only places them."""
    for key, value in data.items():  # `lr = {a = 1}`: a field given a table, flat file or not
        if not isinstance(value, Mapping) or ALIASES.get(key, key) not in SECTION_OF:
            continue
        # `model`, `data` and `schedule` name a field and a section: a table holding no config key is the field's
        if key not in SECTIONS or (value and not any(ALIASES.get(k, k) in SECTION_OF for k in value)):
            raise ConfigError(key, dict(value), "a value, not a table",
                              f"{key} is a key of [{SECTION_OF[ALIASES.get(key, key)]}]")
    tables = [k for k, v in data.items() if _is_table(k, v)]
    if not tables:
        return dict(data)
    flat = [k for k in data if k not in tables]
    if flat:
        home = SECTION_OF.get(ALIASES.get(flat[0], flat[0]))
        raise ConfigError("config", where, "flat keys or [section] tables, not both",
                          f"{flat[0]} is outside any table" + (f"; write it under [{home}]" if home else ""))
    values: dict[str, Any] = {}
    for table in tables:
        if table not in SECTIONS:
            if ALIASES.get(table, table) in SECTION_OF:  # `lr = {a = 1}`: a field given a table
                raise ConfigError(table, dict(data[table]), "a value, not a table",
                                  f"{table} is a key of [{SECTION_OF[ALIASES.get(table, table)]}]")
            raise ConfigError("config table", f"[{table}]", [f"[{name}]" for name in SECTIONS])
        for key, value in data[table].items():
            name = ALIASES.get(key, key)
            home = SECTION_OF.get(name)
            if home != table:
                fix = (f"{key} belongs in [{home}]: move it there" if home else
                       "not a config key in any table; remove or rename it")
                raise ConfigError(f"[{table}] key", key, SECTIONS[table], fix)
            values[key] = value
    return values


def flat_spelling_note(keys: Any, *, where: str = "config") -> str:
    """The one line saying how ``keys`` (flat, as read) are spelled in sections ("" when none is a field's)."""
    grouped: dict[str, list[str]] = {}
    for key in keys:
        name = ALIASES.get(key, key)
        if name in SECTION_OF:
            grouped.setdefault(SECTION_OF[name], [])
            if name not in grouped[SECTION_OF[name]]:
                grouped[SECTION_OF[name]].append(name)
    if not grouped:  # no key of a field: nothing to spell (make_config refuses what is unknown)
        return ""
    spelled = "; ".join(f"[{sec}] {', '.join(grouped[sec])}" for sec in SECTIONS if sec in grouped)
    return f"{where}: flat config keys are read as before; the sectioned spelling is {spelled}"


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config into flat keys: section tables (``[levers]``, ... as :func:`dump_toml` writes them),
    or the flat keys of earlier versions (a ``[train]`` table around them is also accepted).

    Flat keys give one :class:`FlatConfigWarning` (one line) with their sectioned spelling -- except in the
    config.toml or launch*.toml trainfit wrote into its own run directory (an older run, resumed: not the
    user's file)."""
    return read_toml(path)[0]


def is_own_config(path: str | Path) -> bool:
    """A config trainfit wrote for itself: a run directory's config.toml or launch*.toml (the directory carries
    trainfit's marker), or the launch.toml a launcher hands its workers in its own temporary directory."""
    p = Path(path)
    return bool(_OWN_CONFIG.fullmatch(p.name)) and (owns(p.parent) or p.parent.name.startswith("trainfit-launch-"))


def read_toml(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """:func:`load_toml`'s flat keys, and where each was written (``"[levers] accumulation = 3 in job.toml"``):
    the provenance a refusal of two values that disagree names. A config trainfit wrote for itself
    (:func:`is_own_config`) is a record of resolved values, not the user's word: no provenance."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", str(path), "an existing TOML file")
    data = read_document(p, field="config", fmt="toml")  # bounded: size, nesting, keys, integers
    if set(data) == {"train"} and isinstance(data["train"], dict):
        data = data["train"]
    values = flatten(data, where=str(path))
    flat = not any(_is_table(k, v) for k, v in data.items())  # the spelling of earlier versions
    note = flat_spelling_note(values, where=str(path)) if flat else ""
    own = is_own_config(p)
    if note and not own:
        warnings.warn(note, FlatConfigWarning, stacklevel=2)
    if own:
        return values, {}
    where = lambda k: "" if flat else f"[{SECTION_OF.get(ALIASES.get(k, k), '?')}] "  # noqa: E731
    return values, {ALIASES.get(k, k): f"{where(k)}{k} = {shown(v, 40)} in {path}" for k, v in values.items()}


def dump_toml(cfg: RunConfig, *, only_changed: bool = False) -> str:
    """Write a config as TOML in section tables (``[model]``, ``[data]``, ``[levers]``, ``[distribution]``,
    ``[schedule]``, ``[run]``) that ``trainfit train CONFIG`` reads back unchanged (tomli-w escapes every
    string). ``only_changed``: the values that differ from the defaults (a table with none is left out)."""
    default = RunConfig().to_dict()
    values = cfg.to_dict()
    tables = {name: {k: values[k] for k in keys if not (only_changed and default[k] == values[k])}
              for name, keys in SECTIONS.items()}
    return tomli_w.dumps({name: table for name, table in tables.items() if table})
