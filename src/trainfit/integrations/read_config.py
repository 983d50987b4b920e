"""Read another tool's training configuration into trainfit's terms (``memory --from``, ``plan --from``).

Three formats, told apart by their keys (not the file name):

- a Hugging Face ``TrainingArguments`` JSON (``args.to_json_string()``): per_device_train_batch_size,
  gradient_accumulation_steps, bf16/fp16, gradient_checkpointing, fsdp (+ fsdp_config), deepspeed, optim;
- an accelerate config YAML (``accelerate config``): distributed_type, mixed_precision, num_processes,
  num_machines, fsdp_config, deepspeed_config;
- Lightning ``Trainer`` arguments as JSON or YAML (flat, or the ``trainer:`` section of a LightningCLI
  config): accumulate_grad_batches, precision, strategy, devices, num_nodes (and ``data.batch_size``).

The core is pure: a mapping in, a :class:`FromConfig` out (RunConfig values, what was read, what was
ignored). Only the settings that change the memory of a step or the job's shape are read; every other key
is listed as ignored, so nothing is dropped silently. Each tool's offload (FSDP's CPU offload, DeepSpeed's
``offload_optimizer`` / ``offload_param``) becomes trainfit's ``offload`` lever under the file's sharding stage,
checked by the lever's own rules (``levers/offload_rules.py``). A value trainfit cannot represent (NVMe
offload, fp8, hybrid sharding) is refused naming the key, the value and what is allowed, never approximated.
"""

from __future__ import annotations

import importlib.util
import json
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import trainfit.gate as gate
from trainfit.errors import SHOWN_CHARS, ConfigError
from trainfit.levers.offload_rules import offload_as_run, plan_offload
from trainfit.vocabulary import OffloadPart, strategy_facts

Tool = Literal["transformers", "accelerate", "lightning"]

TOOL_LABELS: dict[str, str] = {
    "transformers": "transformers TrainingArguments",
    "accelerate": "accelerate config",
    "lightning": "Lightning Trainer arguments",
}

SIGNATURES: dict[str, frozenset[str]] = {
    "transformers": frozenset({"per_device_train_batch_size", "gradient_accumulation_steps", "output_dir",
                               "per_device_eval_batch_size", "gradient_checkpointing", "learning_rate",
                               "lr_scheduler_type", "optim", "fsdp", "deepspeed", "bf16", "fp16"}),
    "accelerate": frozenset({"distributed_type", "mixed_precision", "compute_environment", "num_machines",
                             "machine_rank", "main_training_function", "fsdp_config", "deepspeed_config",
                             "downcast_bf16", "use_cpu"}),
    "lightning": frozenset({"accumulate_grad_batches", "precision", "strategy", "devices", "num_nodes",
                            "accelerator", "max_epochs", "gradient_clip_val", "log_every_n_steps",
                            "check_val_every_n_epoch", "enable_checkpointing"}),
}
"""Keys that mark each format; the format with the most present wins (keys of one format only count)."""

EXPECTED = ("a transformers TrainingArguments JSON (per_device_train_batch_size, gradient_accumulation_steps, ...), "
            "an accelerate config YAML (distributed_type, mixed_precision, num_processes, ...) or Lightning Trainer "
            "arguments as JSON/YAML (accumulate_grad_batches, precision, strategy, devices, ...)")

FSDP_SHARDING = {"FULL_SHARD": "zero3", "SHARD_GRAD_OP": "zero2", "NO_SHARD": "ddp",
                 "1": "zero3", "2": "zero2", "3": "ddp"}
"""torch FSDP ShardingStrategy (by name, or accelerate's older 1-based number) -> trainfit strategy."""

DEEPSPEED_STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
"""DeepSpeed ZeRO stage -> trainfit strategy (stage 0 shards nothing: data parallel)."""

ACCELERATE_PRECISIONS = {"no": "fp32", "fp16": "fp16-mixed", "bf16": "bf16-mixed"}
LIGHTNING_PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
                        "16-mixed": "fp16-mixed", "16": "fp16-mixed", "bf16-true": "bf16-true",
                        "16-true": "fp16-true"}
"""Lightning precision (2.x names and the 1.x ones 32/16/bf16) -> trainfit precision. Lightning's ``*-true``
keeps no fp32 master copy; trainfit's does (its optimizer state counts 4 more bytes per parameter)."""

HF_OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw": "adamw",
                 "adam": "adam", "sgd": "sgd"}
LIGHTNING_STRATEGIES = {"ddp": "ddp", "ddp_spawn": "ddp", "ddp_fork": "ddp", "ddp_find_unused_parameters_true": "ddp",
                        "ddp_notebook": "ddp", "single_device": "single", "fsdp": "zero3",
                        "deepspeed": "zero2", "deepspeed_stage_1": "zero1", "deepspeed_stage_2": "zero2",
                        "deepspeed_stage_3": "zero3"}
"""Lightning strategy names -> trainfit strategy ("fsdp" is FSDPStrategy's default FULL_SHARD, "deepspeed"
DeepSpeedStrategy's default stage 2)."""

LIGHTNING_OFFLOAD_STRATEGIES = {
    "fsdp_cpu_offload": ("fsdp", "FULL_SHARD", None),
    "deepspeed_stage_2_offload": ("deepspeed", 2, ("cpu", "none")),
    "deepspeed_stage_3_offload": ("deepspeed", 3, ("cpu", "cpu")),
    "deepspeed_stage_3_offload_nvme": ("deepspeed", 3, ("nvme", "nvme")),
}
"""Lightning's registered offload strategies (``StrategyRegistry``): FSDPStrategy(cpu_offload=True), or
DeepSpeedStrategy's stage and (optimizer, parameter) offload devices."""

OFFLOAD_DEVICES = ("none", "cpu")
"""DeepSpeed offload devices trainfit models (``nvme`` is DeepSpeed's third: refused, trainfit has no disk tier)."""


@dataclass(frozen=True, kw_only=True)
class FromConfig:
    """Another tool's configuration, read: the trainfit values it sets and an account of every key."""

    path: str
    """The file as given."""
    tool: Tool
    """Which format the keys showed."""
    values: Mapping[str, Any]
    """RunConfig fields (plus ``devices``: total ranks, ``nodes``: machines) and the value the file sets."""
    read: Mapping[str, Any]
    """The file's keys that were read (dotted for nested ones) and their values as written."""
    ignored: tuple[str, ...] = field(default_factory=tuple)
    """The file's keys not read (dotted for nested ones), sorted."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Where a mapped value differs from the tool's own in memory (said, never silent)."""

    def __post_init__(self) -> None:
        assert self.tool in TOOL_LABELS, self.tool

    def lines(self, overridden: Mapping[str, Any]) -> list[str]:
        """What stderr says: one line for the settings read, one for those ignored, one for flags over them."""
        sets = ", ".join(f"{k}={v}" for k, v in self.values.items())
        read = ", ".join(f"{k}={_show(v)}" for k, v in self.read.items())
        label = TOOL_LABELS[self.tool]
        out = [f"trainfit: read from {self.path} ({label}): {read or 'nothing'} -> {sets or 'nothing'}",
               f"trainfit: ignored from {self.path}: {gate.listed(self.ignored, 40) or 'nothing'}"]
        out.extend(f"trainfit: note: {n}" for n in self.notes)
        if overridden:
            out.append("trainfit: flags override the file: "
                       + ", ".join(f"{k}={v} (file: {self._file_value(k)})" for k, v in overridden.items()))
        return out

    def _file_value(self, key: str) -> Any:
        """The file's value for ``key``; the global batch is not a key of any file but the product of its
        per-device batch, accumulation and devices."""
        if key in self.values:
            return self.values[key]
        if key == "global_batch":
            v = self.values
            devices = f"{v['devices']} devices" if "devices" in v else "the devices of its launch"
            return f"per-device batch {v.get('micro_batch')} x accumulation {v.get('accumulation', 1)} x {devices}"
        return "not set"

    def to_dict(self, overridden: Mapping[str, Any]) -> dict[str, Any]:
        """The ``--json`` ``from`` object."""
        return {"file": self.path, "format": self.tool, "read": dict(self.read), "sets": dict(self.values),
                "ignored": list(self.ignored), "overridden": dict(overridden), "notes": list(self.notes)}


def _show(v: Any) -> str:
    text = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."  # a value, not a page


# -- files ---------------------------------------------------------------------------------------------------


def load_mapping(path: str) -> dict[str, Any]:
    """The file's top-level mapping, read through the one bounded reader (:func:`trainfit.gate.read_document`,
    :data:`trainfit.gate.CONFIG`: size, nesting, keys and items, integers; a key given twice refused): JSON when
    its text opens with ``{``, else YAML. Refused (naming the file) when it is missing, unreadable, past a bound,
    or not a mapping."""
    fmt = _format(path)
    if fmt == "yaml" and importlib.util.find_spec("yaml") is None:
        raise ConfigError("from", path, "a JSON file (reading YAML needs PyYAML)", "pip install 'trainfit[accelerate]'")
    try:
        data = gate.read_document(path, field="from", fmt=fmt, limits=gate.CONFIG)
    except ConfigError as e:
        if fmt == "yaml" and str(e).endswith("keys and items)"):  # a few hundred bytes of nested aliases: say so
            raise ConfigError("from", path, f"a YAML document of {gate.CONFIG.words()}",
                              f"more than {gate.CONFIG.max_items:,} keys and items once its YAML aliases are "
                              "expanded; write the settings out") from None
        raise
    if not isinstance(data, dict) or not data:
        raise ConfigError("from", path, EXPECTED, "the file does not hold a mapping of settings")
    return data


def _format(path: str) -> str:
    """The format by the file's suffix (``.json``, ``.yaml``/``.yml``); for any other name ``json`` when the first
    non-blank character opens a JSON object, else ``yaml`` (YAML also reads JSON, but a JSON file is read as JSON:
    ``1e-5`` is a number there, a string to YAML 1.1). Only a regular file is opened here; anything else is
    refused by the reader."""
    p = Path(path)
    by_suffix = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}.get(p.suffix.lower())
    if by_suffix:
        return by_suffix
    try:
        if not stat.S_ISREG(p.stat().st_mode):
            return "yaml"
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError:
        return "yaml"  # the reader names the error
    return "json" if head.lstrip().startswith(b"{") else "yaml"


def detect(data: Mapping[str, Any], path: str) -> Tool:
    """The format the keys show; refused when no format's keys are there or two tie."""
    keys = set(data)
    if isinstance(data.get("trainer"), dict):  # a LightningCLI config: the Trainer's arguments under trainer:
        return "lightning"
    scores = {tool: len(keys & sig - set().union(*(s for t, s in SIGNATURES.items() if t != tool)))
              for tool, sig in SIGNATURES.items()}
    best = max(scores.values())
    winners = [t for t, n in scores.items() if n == best]
    if best == 0 or len(winners) > 1:
        raise ConfigError("from", path, EXPECTED, f"its keys ({gate.listed(sorted(map(str, keys)), 6)}) match "
                          "none of these formats")
    return winners[0]


def read_from(path: str) -> FromConfig:
    """Read ``path`` into a :class:`FromConfig`.

    Raises:
        ConfigError: a missing or malformed file, one whose keys match no format, or a value trainfit cannot
            map (the message names the key, the value and what is allowed).
    """
    data = load_mapping(path)
    tool = detect(data, path)
    reader = _Reader(path=path, data=data)
    READERS[tool](reader)
    return FromConfig(path=path, tool=tool, values=reader.values, read=reader.read,
                      ignored=tuple(sorted(reader.unread())), notes=tuple(reader.notes))


# -- the pure mapping ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Reader:
    """Walks one file's mapping: ``take`` marks a key read; whatever was never taken is ignored."""

    path: str
    data: Mapping[str, Any]
    values: dict[str, Any] = field(default_factory=dict)
    read: dict[str, Any] = field(default_factory=dict)
    taken: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        """The value at dotted ``key`` (marked read), or ``default`` where absent or null."""
        node: Any = self.data
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        self.taken.add(key)
        if node is None:
            return default
        self.read[key] = node
        return node

    def set(self, name: str, value: Any) -> None:
        self.values[name] = value

    def refuse(self, key: str, value: Any, allowed: Any, fix: str = "") -> None:
        raise ConfigError(f"{self.path}: {key}", value, allowed, fix)

    def int_of(self, key: str, value: Any, minimum: int = 1) -> int:
        """An integer the file writes as a number or as ASCII digits (:func:`trainfit.gate.parse_int`)."""
        if not isinstance(value, (int, str)):  # a float, a list: not a count
            self.refuse(key, value, f"an integer >= {minimum}")
        return gate.parse_int(f"{self.path}: {key}", value, minimum=minimum)

    def flag(self, key: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        self.refuse(key, value, "true or false")
        raise AssertionError  # refuse raises

    def unread(self) -> list[str]:
        """Every leaf key (dotted) neither read nor under a key that was read."""
        out: list[str] = []

        def walk(node: Mapping[str, Any], prefix: str) -> None:
            for k, v in node.items():
                key = f"{prefix}{k}"
                if key in self.taken:
                    continue
                if isinstance(v, Mapping) and v and any(t.startswith(key + ".") for t in self.taken):
                    walk(v, key + ".")
                else:
                    out.append(key)

        walk(self.data, "")
        return out


# -- offload: each tool's switches onto trainfit's lever --------------------------------------------------------


def _fsdp_offload(r: _Reader, key: str, value: Any, on: bool) -> None:
    """FSDP's CPU offload switch (``key``, ``value`` as written) under the file's FSDP stage (``r.values``'s
    strategy, set before): FSDP2's CPUOffloadPolicy, trainfit's ``optimizer`` under zero2 and
    ``optimizer,params`` under zero3 (:func:`~trainfit.levers.offload_rules.offload_as_run`)."""
    if not on:
        return
    strategy = r.values.get("strategy")
    run = offload_as_run(OffloadPart.OPTIMIZER, strategy) if strategy_facts(strategy).fsdp else None
    if run is None:
        r.refuse(key, value, "false under NO_SHARD", "trainfit models FSDP's CPU offload under FULL_SHARD (zero3: "
                 "offload optimizer,params) and SHARD_GRAD_OP (zero2: optimizer); NO_SHARD's moves whole parameters "
                 "to the host between uses, which trainfit's ddp does not do")
    r.set("offload", run)


def _offload_device(r: _Reader, key: str, value: Any) -> bool:
    """A DeepSpeed offload device as written: ``cpu`` -> True, ``none`` or absent -> False; ``nvme`` (or any other
    text) refused naming the key."""
    if value in (None, False) or str(value).lower() == "none":
        return False
    if value == "cpu":
        return True
    r.refuse(key, value, OFFLOAD_DEVICES, "trainfit models offload to host memory; NVMe (ZeRO-Infinity) is not "
             "modeled" if str(value).lower() == "nvme" else "DeepSpeed's offload devices are none, cpu and nvme")
    raise AssertionError  # refuse raises


def _deepspeed(r: _Reader, stage_key: str, stage: Any, optimizer: tuple[str, Any], param: tuple[str, Any]) -> None:
    """A DeepSpeed ZeRO stage and its offload devices (each ``(key, value as written)``) -> strategy and offload:
    ZeRO-Offload of the optimizer under stage 2 is trainfit's zero2 + ``optimizer``; stage 3 with both the optimizer
    and the parameters on the host is zero3 + ``optimizer,params``. Anything else with an offload is refused."""
    n = r.int_of(stage_key, stage, minimum=0)
    if n not in DEEPSPEED_STAGES:
        r.refuse(stage_key, stage, "0, 1, 2 or 3")
    strategy = DEEPSPEED_STAGES[n]
    r.set("strategy", strategy)
    keys = {OffloadPart.OPTIMIZER: optimizer, OffloadPart.PARAMS: param}
    parts = {part for part, (key, value) in keys.items() if _offload_device(r, key, value)}
    if not parts:
        return
    _check_deepspeed_offload(r, n, parts, keys)
    spec = ",".join(sorted(parts))
    plan_offload(spec, strategy)  # trainfit's own rule agrees with the checks above (raises where they missed)
    r.set("offload", spec)


def _check_deepspeed_offload(r: _Reader, stage: int, parts: set, keys: Mapping[OffloadPart, tuple[str, Any]]) -> None:
    """Refuse, naming the file's key, an offload the lever cannot run under ``stage``'s strategy."""
    s = strategy_facts(DEEPSPEED_STAGES[stage])
    (opt_key, opt), (par_key, par) = keys[OffloadPart.OPTIMIZER], keys[OffloadPart.PARAMS]
    if stage == 0:
        key, value = (opt_key, opt) if OffloadPart.OPTIMIZER in parts else (par_key, par)
        r.refuse(key, value, "none under ZeRO stage 0", "DeepSpeed offloads only with ZeRO (stage 1, 2 or 3)")
    if OffloadPart.PARAMS in parts and OffloadPart.PARAMS not in s.offload_parts:
        r.refuse(par_key, par, f"none under ZeRO stage {stage}", "parameters are offloaded under stage 3 only "
                 "(trainfit's zero3, together with the optimizer)")
    if OffloadPart.OPTIMIZER in parts and OffloadPart.OPTIMIZER not in s.offload_parts:
        r.refuse(opt_key, opt, f"none under ZeRO stage {stage}", f"trainfit's {s.name} keeps the optimizer on the "
                 f"device ({s.offload_refusal}); stage 2 with the same offload is modeled")
    if OffloadPart.PARAMS in s.offload_parts and len(parts) == 1:
        (key, value), other = ((par_key, par), opt_key) if OffloadPart.PARAMS in parts else ((opt_key, opt), par_key)
        r.refuse(key, value, f"cpu only together with {other}: cpu under ZeRO stage {stage}, else none",
                 "trainfit's zero3 offload is FSDP2's CPUOffloadPolicy, which keeps the sharded parameters, their "
                 "gradients and the optimizer state on the host together")


def _deepspeed_config(r: _Reader, key: str, ds: Any) -> None:
    """A DeepSpeed JSON config (a mapping, read at ``key``): its ZeRO stage and offload sections. DeepSpeed's
    deprecated ``cpu_offload`` switches are refused (their current form is read), and a partial optimizer
    offload (``ratio`` below 1) too."""
    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        r.refuse(f"{key}.zero_optimization", zero, "a mapping with stage and offload_optimizer / offload_param")
    for old in ("cpu_offload", "cpu_offload_param"):
        if zero.get(old) not in (None, False):
            r.refuse(f"{key}.zero_optimization.{old}", zero[old], "false", "DeepSpeed's deprecated switch: write "
                     "offload_optimizer / offload_param with device: cpu")
    sections = {}
    for name in ("offload_optimizer", "offload_param"):
        sections[name] = zero.get(name) or {}
        if not isinstance(sections[name], Mapping):
            r.refuse(f"{key}.zero_optimization.{name}", sections[name], "a mapping with device: none, cpu or nvme")
    ratio = sections["offload_optimizer"].get("ratio", 1)
    if ratio != 1 and sections["offload_optimizer"].get("device") not in (None, "none"):
        r.refuse(f"{key}.zero_optimization.offload_optimizer.ratio", ratio, "1 (the whole optimizer state)",
                 "trainfit models the whole optimizer state on the host, not a share of it")
    _deepspeed(r, f"{key}.zero_optimization.stage", zero.get("stage", 0),
               *((f"{key}.zero_optimization.{name}.device", sections[name].get("device")) for name in sections))


def _read_transformers(r: _Reader) -> None:
    """TrainingArguments: the per-device batch, accumulation, AMP flags, checkpointing, FSDP/DeepSpeed, optim."""
    if (mb := r.get("per_device_train_batch_size")) is not None:
        r.set("micro_batch", r.int_of("per_device_train_batch_size", mb))
    if (acc := r.get("gradient_accumulation_steps")) is not None:
        r.set("accumulation", r.int_of("gradient_accumulation_steps", acc))
    bf16, fp16 = r.get("bf16"), r.get("fp16")
    if bf16 is not None or fp16 is not None:
        bf16, fp16 = r.flag("bf16", bf16 or False), r.flag("fp16", fp16 or False)
        if bf16 and fp16:
            r.refuse("bf16", True, "bf16 or fp16, not both", "TrainingArguments refuses both too")
        r.set("precision", "bf16-mixed" if bf16 else "fp16-mixed" if fp16 else "fp32")
    for key in ("gradient_checkpointing", "activation_checkpointing"):  # 4.x name, and 5.x's (both written)
        if (ck := r.get(key)) is not None:
            on = r.flag(key, ck) or r.values.get("checkpointing") == "full"
            r.set("checkpointing", "full" if on else "none")
    if (opt := r.get("optim")) is not None:
        if str(opt) not in HF_OPTIMIZERS:
            r.refuse("optim", opt, tuple(HF_OPTIMIZERS), "trainfit models torch AdamW/Adam/SGD state only")
        r.set("optimizer", HF_OPTIMIZERS[str(opt)])
    _hf_fsdp(r)
    _hf_deepspeed(r)


def _hf_fsdp(r: _Reader) -> None:
    """TrainingArguments' FSDP as the Trainer reads it (``_process_fsdp_args``): nothing unless ``fsdp`` is set;
    ``fsdp_config`` keys with or without their ``fsdp_`` prefix; the legacy words of ``fsdp`` ("full_shard
    offload") only where ``fsdp_config`` does not set the same thing (the Trainer's ``setdefault``)."""
    fsdp = r.get("fsdp")
    if not fsdp:
        return
    words = [] if fsdp is True else fsdp.split() if isinstance(fsdp, str) else [str(w) for w in fsdp] \
        if isinstance(fsdp, list) else r.refuse("fsdp", fsdp, "true/false, or a string or list such as 'full_shard "
                                                "auto_wrap'")
    modes = [w for w in words if w not in ("auto_wrap", "offload")]
    if len(modes) > 1 or (modes and modes[0].upper() not in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")):
        r.refuse("fsdp", fsdp, "full_shard, shard_grad_op or no_shard (with auto_wrap, offload)")
    key = _hf_fsdp_key(r, "reshard_after_forward")
    if (reshard := r.get(key)) is not None:  # the Trainer's setdefault: the config's own key wins over a word
        r.set("strategy", FSDP_SHARDING.get(str(reshard).upper()) or ("zero3" if r.flag(key, reshard) else "zero2"))
    else:
        r.set("strategy", FSDP_SHARDING[modes[0].upper()] if modes else "zero3")  # default: reshard after forward
    key = _hf_fsdp_key(r, "cpu_offload")
    if (off := r.get(key)) is None:
        _fsdp_offload(r, "fsdp", fsdp, "offload" in words)
    elif not isinstance(off, bool):  # the Trainer tests it for truth: the text "false" would offload
        r.refuse(key, off, "true or false (a JSON boolean)")
    else:
        _fsdp_offload(r, key, off, off)
    ck = _hf_fsdp_key(r, "activation_checkpointing")
    if (on := r.get(ck)) is not None and r.flag(ck, on):
        r.set("checkpointing", "full")
    config = r.data.get("fsdp_config")
    for name in ("offload_params", "fsdp_offload_params"):
        if isinstance(config, Mapping) and name in config:
            r.notes.append(f"the Trainer does not read fsdp_config.{name} (its switch is fsdp_config.cpu_offload or "
                           "the word offload in fsdp): not read, as the Trainer runs it")


def _hf_fsdp_key(r: _Reader, name: str) -> str:
    """The dotted key the Trainer reads for ``fsdp_config[name]``: it strips an ``fsdp_`` prefix, so
    ``fsdp_cpu_offload`` is ``cpu_offload`` (and replaces it where both are given)."""
    config = r.data.get("fsdp_config")
    prefixed = isinstance(config, Mapping) and f"fsdp_{name}" in config
    return f"fsdp_config.fsdp_{name}" if prefixed else f"fsdp_config.{name}"


def _hf_deepspeed(r: _Reader) -> None:
    """TrainingArguments' ``deepspeed``: a DeepSpeed config as a mapping or the path of its JSON."""
    ds = r.get("deepspeed")
    if isinstance(ds, str) and ds:
        ds = _deepspeed_file(r, ds)
    if isinstance(ds, Mapping) and ds:
        if "strategy" in r.values:
            r.refuse("deepspeed", "set", "fsdp or deepspeed, not both")
        _deepspeed_config(r, "deepspeed", ds)
    elif ds:
        r.refuse("deepspeed", ds, "a DeepSpeed config: a JSON file path or a mapping")


def _deepspeed_file(r: _Reader, name: Any, key: str = "deepspeed") -> Mapping[str, Any]:
    """The DeepSpeed JSON a file names at ``key`` (relative to that file, then to the working directory)."""
    for p in (Path(r.path).parent / str(name), Path(str(name))):
        if p.is_file():  # read as the --from file itself is: bounded, a key given twice refused
            data = gate.read_document(p, field=f"{r.path}: {key}", fmt="json", limits=gate.CONFIG)
            if isinstance(data, dict):
                return data
            break
    r.refuse(key, name, "the path of a readable DeepSpeed JSON config (relative to the file or here)")
    raise AssertionError


def _read_accelerate(r: _Reader) -> None:
    """accelerate config: processes and machines, mixed precision, the distributed type and its plug-in."""
    machines = r.int_of("num_machines", r.get("num_machines", 1))
    if (n := r.get("num_processes")) is not None:
        r.set("devices", r.int_of("num_processes", n))
    if machines != 1:
        r.set("nodes", machines)
    if (mp := r.get("mixed_precision")) is not None:
        if str(mp) not in ACCELERATE_PRECISIONS:
            r.refuse("mixed_precision", mp, tuple(ACCELERATE_PRECISIONS), "trainfit has no fp8 precision")
        r.set("precision", ACCELERATE_PRECISIONS[str(mp)])
    kind = str(r.get("distributed_type", "NO")).upper()
    if kind == "NO":
        r.set("strategy", "single")
    elif kind in ("MULTI_GPU", "MULTI_CPU"):
        r.set("strategy", "ddp")
    elif kind == "FSDP":
        reshard, sharding = r.get("fsdp_config.fsdp_reshard_after_forward"), r.get("fsdp_config.fsdp_sharding_strategy")
        if isinstance(reshard, str) and reshard.lower() not in ("true", "false"):  # FSDP1 configs put the name here
            sharding, reshard = reshard, None
        if reshard is not None:
            r.set("strategy", "zero3" if r.flag("fsdp_config.fsdp_reshard_after_forward", reshard) else "zero2")
        elif sharding is not None:
            if str(sharding).upper() not in FSDP_SHARDING:
                r.refuse("fsdp_config.fsdp_sharding_strategy", sharding, ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"))
            r.set("strategy", FSDP_SHARDING[str(sharding).upper()])
        else:
            r.set("strategy", "zero3")  # accelerate's default: FULL_SHARD / reshard after forward
        if (off := r.get("fsdp_config.fsdp_offload_params")) is not None:
            _fsdp_offload(r, "fsdp_config.fsdp_offload_params", off, r.flag("fsdp_config.fsdp_offload_params", off))
        if (ck := r.get("fsdp_config.fsdp_activation_checkpointing")) is not None:
            r.set("checkpointing", "full" if r.flag("fsdp_config.fsdp_activation_checkpointing", ck) else "none")
    elif kind == "DEEPSPEED":
        if (acc := r.get("deepspeed_config.gradient_accumulation_steps")) is not None and acc != "auto":
            r.set("accumulation", r.int_of("deepspeed_config.gradient_accumulation_steps", acc))
        _accelerate_deepspeed(r)
    else:
        r.refuse("distributed_type", kind, ("NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED"))


def _accelerate_deepspeed(r: _Reader) -> None:
    """accelerate's DeepSpeed plug-in: a ``deepspeed_config_file`` (DeepSpeed's own JSON, which then holds the
    stage and offload), else the stage and offload devices in the YAML."""
    if (name := r.get("deepspeed_config.deepspeed_config_file")) not in (None, "none"):
        key = "deepspeed_config.deepspeed_config_file"
        _deepspeed_config(r, key, _deepspeed_file(r, name, key))
        return
    devices = [(f"deepspeed_config.{k}", r.get(f"deepspeed_config.{k}"))
               for k in ("offload_optimizer_device", "offload_param_device")]
    _deepspeed(r, "deepspeed_config.zero_stage", r.get("deepspeed_config.zero_stage", 0), *devices)


def _read_lightning(r: _Reader) -> None:
    """Lightning Trainer arguments (flat or under ``trainer:``), and a LightningCLI ``data`` batch size."""
    pre = "trainer." if isinstance(r.data.get("trainer"), Mapping) else ""
    nodes = r.int_of(pre + "num_nodes", r.get(pre + "num_nodes", 1))
    if nodes != 1:
        r.set("nodes", nodes)
    devices = r.get(pre + "devices")
    if isinstance(devices, list):
        per_node = len(devices)
    elif devices is None or str(devices).strip() in ("auto", "-1"):
        per_node = None  # the machine decides: not read
        if devices is not None:
            r.read.pop(pre + "devices")
            r.taken.discard(pre + "devices")
    elif isinstance(devices, str) and "," in devices:
        per_node = len([d for d in devices.split(",") if d.strip()])
    else:
        per_node = r.int_of(pre + "devices", devices)
    if per_node is not None:
        r.set("devices", per_node * nodes)
    if (acc := r.get(pre + "accumulate_grad_batches")) is not None:
        r.set("accumulation", r.int_of(pre + "accumulate_grad_batches", acc))
    if (p := r.get(pre + "precision")) is not None:
        if str(p) not in LIGHTNING_PRECISIONS:
            r.refuse(pre + "precision", p, tuple(LIGHTNING_PRECISIONS))
        r.set("precision", LIGHTNING_PRECISIONS[str(p)])
        if str(p).endswith("-true") and str(p) != "32-true":
            r.notes.append(f"Lightning's precision={p} keeps no fp32 master copy; trainfit's "
                           f"{LIGHTNING_PRECISIONS[str(p)]} does (4 more bytes of optimizer state per trainable "
                           f"parameter than Lightning uses)")
    if (s := r.get(pre + "strategy")) is not None:
        r.set("strategy", _lightning_strategy(r, pre + "strategy", s))
    for key in ("data.batch_size", "data.init_args.batch_size", "batch_size"):  # batch_size: plan --write-for's
        if (mb := r.get(key)) is not None:
            r.set("micro_batch", r.int_of(key, mb))


def _lightning_strategy(r: _Reader, key: str, s: Any) -> str:
    """Lightning's ``strategy`` (a registered name, or LightningCLI's class_path and init_args) -> the strategy;
    its offload is set on ``r`` (:func:`_fsdp_offload`, :func:`_deepspeed`)."""
    if isinstance(s, Mapping):  # LightningCLI: {class_path: ...FSDPStrategy, init_args: {...}}
        return _lightning_strategy_object(r, key, s)
    name = str(s)
    if name == "auto":
        return "ddp" if r.values.get("devices", 1) > 1 else "single"  # Lightning's choice for several devices
    if name in LIGHTNING_OFFLOAD_STRATEGIES:
        kind, stage, devices = LIGHTNING_OFFLOAD_STRATEGIES[name]
        if kind == "fsdp":
            r.set("strategy", FSDP_SHARDING[stage])
            _fsdp_offload(r, key, s, True)
        elif "nvme" in devices:  # the name is what the file wrote: it is named, not the device it stands for
            read = [n for n in LIGHTNING_OFFLOAD_STRATEGIES if "nvme" not in n]
            r.refuse(key, s, ("auto", *LIGHTNING_STRATEGIES, *read), "trainfit models offload to host memory; "
                     "NVMe (ZeRO-Infinity) is not modeled")
        else:
            _deepspeed(r, key, stage, *((key, device) for device in devices))
        return r.values["strategy"]
    if name not in LIGHTNING_STRATEGIES:
        r.refuse(key, s, ("auto", *LIGHTNING_STRATEGIES, *LIGHTNING_OFFLOAD_STRATEGIES), "trainfit has no model "
                 "parallelism")
    return LIGHTNING_STRATEGIES[name]


def _lightning_strategy_object(r: _Reader, key: str, s: Mapping[str, Any]) -> str:
    """FSDPStrategy (``sharding_strategy``, ``cpu_offload``), DDPStrategy or DeepSpeedStrategy (``stage``,
    ``offload_optimizer`` / ``offload_parameters`` and their devices, or a DeepSpeed ``config`` over them)."""
    cls = str(s.get("class_path", "")).rsplit(".", 1)[-1]
    args = s.get("init_args") or {}
    if cls == "FSDPStrategy":
        name = str(args.get("sharding_strategy", "FULL_SHARD")).upper()
        if name not in FSDP_SHARDING:
            r.refuse(f"{key}.init_args.sharding_strategy", name, ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"))
        r.set("strategy", FSDP_SHARDING[name])
        off, off_key = args.get("cpu_offload"), f"{key}.init_args.cpu_offload"
        if isinstance(off, Mapping):  # CPUOffload(offload_params=...) as LightningCLI spells an object
            off = (off.get("init_args") or {}).get("offload_params", False)
            off_key += ".init_args.offload_params"
        _fsdp_offload(r, off_key, off, r.flag(off_key, off) if off is not None else False)
        return r.values["strategy"]
    if cls == "DDPStrategy":
        return "ddp"
    if cls == "DeepSpeedStrategy":
        if (config := args.get("config")) is not None:  # DeepSpeedStrategy uses the config over its arguments
            ds = _deepspeed_file(r, config, f"{key}.init_args.config") if isinstance(config, str) else config
            _deepspeed_config(r, f"{key}.init_args.config", ds if isinstance(ds, Mapping) else {})
            return r.values["strategy"]
        devices = []
        for switch, device in (("offload_optimizer", "offload_optimizer_device"),
                               ("offload_parameters", "offload_params_device")):
            on = args.get(switch) not in (None, False) and r.flag(f"{key}.init_args.{switch}", args.get(switch))
            dkey = f"{key}.init_args.{device}" if device in args else f"{key}.init_args.{switch}"
            devices.append((dkey, args.get(device, "cpu") if on else "none"))
        _deepspeed(r, f"{key}.init_args.stage", args.get("stage", 2), *devices)
        return r.values["strategy"]
    r.refuse(f"{key}.class_path", s.get("class_path"), ("DDPStrategy", "FSDPStrategy", "DeepSpeedStrategy"))
    raise AssertionError  # refuse raises


READERS: dict[str, Callable[[_Reader], None]] = {
    "transformers": _read_transformers, "accelerate": _read_accelerate, "lightning": _read_lightning}


# -- merging with flags --------------------------------------------------------------------------------------


RUN_KEYS = ("micro_batch", "accumulation", "precision", "checkpointing", "strategy", "optimizer", "offload")
"""The file's values that are RunConfig fields (``devices`` and ``nodes`` go to each command's own flags)."""


def file_values(found: FromConfig, given: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split the file's values into those that apply and those explicit flags override.

    Args:
        found: the file, read.
        given: field -> the value of each flag given explicitly (None: not given). Where it names ``devices``
            (the command sizes a job over devices: plan, memory), a file that runs a distributed strategy must
            say on how many (:func:`check_launch_devices`).

    Returns:
        (values the file sets, field -> flag value for each flag that overrides a value of the file).
    """
    if "devices" in given:
        check_launch_devices(found, given["devices"])
    applied, overridden = {}, {}
    for k, v in found.values.items():
        if given.get(k) is not None:
            if str(given[k]) != str(v):
                overridden[k] = given[k]
        else:
            applied[k] = v
    return applied, overridden


def check_launch_devices(found: FromConfig, devices: Any) -> None:
    """A file whose strategy runs over several processes (``fsdp``, ``deepspeed``, a DDP strategy) is sized on the
    processes its launch starts: the file's own count (accelerate's ``num_processes``, Lightning's ``devices``) or
    ``--devices``. A TrainingArguments file has none (torchrun decides): without ``--devices`` it is refused in one
    line, never sized on one device."""
    strategy = found.values.get("strategy")
    if devices is not None or "devices" in found.values or strategy is None:
        return
    if not strategy_facts(strategy).distributed:
        return
    keys = gate.listed(k for k in found.read if k.split(".")[-1] in _SHARDING_KEYS) or "its strategy"
    raise ConfigError("devices", None, "the number of processes the file's launch starts (an integer >= 1)",
                      f"{found.path} sets {keys} ({strategy}), which runs over the processes its launcher starts, "
                      f"and does not say how many: pass --devices N (per node)")


_SHARDING_KEYS = ("fsdp", "deepspeed", "distributed_type", "strategy", "zero_stage", "stage")
"""The keys of a file that choose a distributed strategy (named when the device count is missing)."""


JOB_KEYS = ("precision", "micro_batch", "accumulation", "checkpointing", "strategy", "offload")
"""The file's choices ``plan --from`` looks for among the ranked plans."""


def plan_job(found: FromConfig, *, global_batch: Any, devices: Any, nodes: Any) -> tuple[dict[str, Any], dict]:
    """The job ``plan --from`` searches for: explicit flags (None: not given) over the file's values.

    The global batch is the file's micro-batch x accumulation x devices where the flag is not given.

    Returns:
        ({"global_batch", "devices", "nodes"} as flag text, field -> flag value for each flag over the file).

    Raises:
        ConfigError: no --global-batch and the file sets no micro-batch to derive it from.
    """
    given = {"devices": devices, "nodes": nodes}
    applied, overridden = file_values(found, given)
    job = {"devices": str(devices if devices is not None else applied.get("devices", 1)),
           "nodes": str(nodes if nodes is not None else applied.get("nodes", 1))}
    mb = found.values.get("micro_batch")
    if global_batch is None:
        if mb is None:
            raise ConfigError("global-batch", None, "an integer >= 1",
                              f"{found.path} sets no per-device batch size: pass --global-batch N")
        try:
            n_dev = int(job["devices"])
        except ValueError:
            n_dev = 1  # PlanRequest refuses the text itself
        global_batch = mb * found.values.get("accumulation", 1) * n_dev
    elif mb is not None:
        overridden["global_batch"] = global_batch
    job["global_batch"] = str(global_batch)
    return job, overridden


def rank_note(found: FromConfig, entries: list) -> str:
    """Where the file's own configuration lands among the ranked plans (``entries``, best first)."""
    mine = {k: str(found.values[k]) for k in JOB_KEYS if k in found.values}
    if not mine:
        return f"{found.path} sets none of {', '.join(JOB_KEYS)}: every plan above is an alternative"
    what = ", ".join(f"{k}={v}" for k, v in mine.items())
    want = {"offload": "", **mine}  # a file that names no offload runs none (no tool offloads unless told)
    for i, e in enumerate(entries, 1):
        if all(str(getattr(e, k)) == v for k, v in want.items()):
            fits = "fits" if e.fits else "does not fit: " + "; ".join(e.reasons)
            return f"the configuration of {found.path} ({what}) is plan #{i} of {len(entries)} ({fits})"
    return f"the configuration of {found.path} ({what}) is not among the {len(entries)} plans searched"
