"""The run flags: the ``trainfit`` flags that map onto RunConfig fields, and turning them into a RunConfig.

Every command that runs a step (train, memory, profile, verify) registers these flags and reads them back with
:func:`config_from_args`: TOML file < flags < explicit overrides, then the refusals of flags that disagree or
would be ignored. Its own module below ``cli`` and the command modules, so that both import it and neither
imports the other (``cli`` registers the commands; a command never imports ``cli``). It imports only light
modules at load (the parsers of ``trainfit.commands.parsers`` use it to print ``--help`` at once); the front
door's refusals are imported when a config is made.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainfit.config import SECTIONS, RunConfig, load_toml, make_config, read_toml
from trainfit.errors import ConfigError, check_unique_keys
from trainfit.gate import parse_int
from trainfit.outputs import owns
from trainfit.presets import MODEL_HELP
from trainfit.progress import info
from trainfit.vocabulary import (
    CHECKPOINT_SPECS,
    PRECISIONS,
    STRATEGIES,
    CompileMode,
    CompileScope,
    GradSync,
    LogSink,
    OffloadPart,
    Optimizer,
    Schedule,
    choices,
    precision_alias_note,
)

EXIT_USAGE = 2
"""Exit status of a refused flag or setting (every TrainfitError the CLI prints as one line)."""

RUN_FLAGS = {
    "model": MODEL_HELP,
    "model_config": "key=value,... overrides (or a JSON config path for hf: models)",
    "seq_len": "longest sequence length in tokens",
    "precision": choices(PRECISIONS) + " (default fp32; Lightning's 16-mixed, 32-true, ... and HF's fp16/bf16 too)",
    "micro_batch": "samples per micro-batch, or auto",
    "accumulation": "micro-batches per optimizer step",
    "checkpointing": choices(CHECKPOINT_SPECS),
    "strategy": choices(STRATEGIES) + " (default single; the others need --devices N or torchrun)",
    "grad_sync": f"{choices(GradSync)} ({choices(s.name for s in STRATEGIES.values() if len(s.grad_sync_choices) > 1)}"
                 " with accumulation)",
    "global_batch": "samples per optimizer step over all ranks (accumulation is derived from it)",
    "optimizer": choices(Optimizer),
    "lr": "learning rate",
    "steps": "optimizer steps",
    "seed": "random seed",
    "run_dir": "directory for metrics.jsonl and checkpoints",
    "checkpoint_every": "save a checkpoint every N optimizer steps",
    "loader_workers": "DataLoader worker processes",
    "memory_cap": "CPU stand-in for device memory, e.g. 2GiB",
    "checkpoint_minutes": "also checkpoint when this many minutes passed since the last (default 30; 0: off)",
    "data": "training data: text file, directory or glob of text files, .jsonl, .parquet, .csv, "
            "or a `trainfit prepare` directory",
    "text_field": "JSON Lines field / Parquet or CSV column holding the text (default text)",
    "text_errors": "bytes that are not UTF-8: strict (refuse) or replace (U+FFFD)",
    "tokenizer": "byte or a directory holding a Hugging Face tokenizer.json "
                 "(default: the hf:DIR model's own, else the prepared data's, else byte)",
    "packing": "on: join documents with end-of-document and cut seq_len rows; off: one padded document per row",
    "val_fraction": "fraction of the documents held out for validation",
    "val_data": "validation data (any --data format)",
    "init_from": "initialise the weights from a trainfit run directory",
    "freeze": "comma-separated glob patterns of parameter names to freeze",
    "lora": "LoRA adapters (peft): r=8,alpha=16,targets=q_proj,v_proj[,merge=true]",
    "save_every": "also export RUN_DIR/model every N steps (always at the end)",
    "schedule": "learning-rate schedule after warm-up: " + choices(Schedule),
    "warmup_steps": "linear warm-up steps",
    "min_lr": "learning rate the linear/cosine schedule ends at",
    "weight_decay": "decoupled weight decay (not applied to biases, norms and embeddings)",
    "eval_every": "validation loss every N steps and at the end",
    "eval_batches": "micro-batches per rank per evaluation (0: all)",
    "log": choices(LogSink) + " (metrics.jsonl is always written)",
    "compile": "on/off: run the model through torch.compile",
    "compile_mode": "torch.compile mode: " + choices(CompileMode),
    "compile_scope": "what is compiled: " + choices(CompileScope),
    "offload": "parts kept in host memory: none or comma-separated " + ", ".join(OffloadPart),
}


def add_run_flags(p: argparse.ArgumentParser, *, config_positional: bool = True, sections: tuple[str, ...] = (),
                  leave_out: tuple[str, ...] = ()) -> dict[str, argparse._ArgumentGroup]:
    """The flags that map onto RunConfig fields (``--micro-batch`` -> ``micro_batch``), in one ``--help`` group
    per section of the config (``trainfit.config.SECTIONS``: model, data, levers, distribution, schedule, run).

    ``sections``: only these sections' flags (default: all); ``leave_out``: fields whose flags a command does not
    read (its ``--help`` does not list them; a TOML file may still carry their keys, as before). Returns the
    groups by section, so that a command adds its own flags (``--devices``) where they belong.
    """
    if config_positional:
        p.add_argument("config", nargs="?", help="TOML config file (flags override it)")
    groups = {}
    for section, keys in SECTIONS.items():
        if sections and section not in sections:
            continue
        groups[section] = p.add_argument_group(section)
        for key in (k for k in keys if k in RUN_FLAGS and k not in leave_out):
            flags = ["--" + key.replace("_", "-")]
            if key == "seq_len":
                flags.append("--seq")
            groups[section].add_argument(*flags, dest=key, help=RUN_FLAGS[key])
    return groups


def integer(field: str, *, minimum: int | None = None, maximum: int | None = None):
    """An option's ``type``: its text read by the one integer parser (``gate.parse_int``: ASCII digits, at most
    19 of them, within ``[minimum, maximum]``) -- argparse's ``int`` takes ``"١٢"`` and ``"1_000"`` -- refused
    naming ``field`` in one line."""

    def parse(text: str) -> int:
        try:
            return parse_int(field, text, minimum=minimum, maximum=maximum)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def add_output_group(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The ``output`` group of ``--help``: --json, --report, --plot and the like."""
    return p.add_argument_group("output")


def config_from_args(args: argparse.Namespace, *, from_run_dir: bool = True, nodes: int = 1,
                     ranks: int | None = None, sources: Mapping[str, str] | None = None, **overrides: Any):
    """TOML file (if any) < flags < explicit overrides -> a validated RunConfig.

    Without a TOML file, ``--run-dir`` of an existing run (trainfit's ``config.toml`` there) supplies the
    configuration, so ``memory``/``profile``/``verify`` pointed at a run measure that run; flags still
    override it, and stderr says which was used.

    Each value the user wrote carries where it was written (a TOML key with its section and file, a flag, an
    override's ``sources`` entry such as a ``--from`` key): a derived value that would replace one of them
    (``accumulation`` from ``global_batch``) is refused naming both (``front.request.refuse_conflicts``), from
    whichever sources they came. ``nodes``: the job's nodes (its ranks are devices x nodes); ``ranks``: its
    ranks where the command counts them itself (``memory --devices``).
    """
    values, written = read_toml(args.config) if getattr(args, "config", None) else ({}, {})
    given: dict[str, str] = {}
    if from_run_dir and not values and getattr(args, "run_dir", None):
        values = _run_dir_config(args)  # trainfit's record of a run: resolved values, not the user's word
    for key in RUN_FLAGS:
        v = getattr(args, key, None)
        if v is not None:
            values[key] = v
            given[key] = _as_typed(key, v)
    values.update(overrides)
    given.update({k: (sources or {}).get(k) or f"{k}={_cut(v)}" for k, v in overrides.items()})
    cfg = make_config(values)
    check_unique_keys("model_config", cfg.model_config)  # the user's text (a preset's expansion may repeat keys)
    default = RunConfig()  # a file's key at its default value: dump_toml writes every one, so it counts as unsaid
    given = {**{k: w for k, w in written.items() if getattr(cfg, k, None) != getattr(default, k, None)}, **given}
    # lazy: the front door imports numpy; the parsers import this module, and --help must not pay for it
    from trainfit.front.request import refuse_conflicts

    refuse_conflicts(cfg, given=given, nodes=nodes, ranks=ranks)  # the front door's refusals
    note = precision_alias_note(values.get("precision"))
    if note:  # accepted: another tool's spelling, echoed as trainfit's name
        info("config", note)
    return cfg


def _as_typed(key: str, value: Any) -> str:
    """A flag as the user typed it (``--global-batch 8``), its value cut as any echoed value is."""
    return f"--{key.replace('_', '-')} {_cut(value)}"


def _cut(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _run_dir_config(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration of the run in ``--run-dir`` (empty when it holds none), said on stderr."""
    path = Path(args.run_dir) / "config.toml"
    if not (path.is_file() and owns(args.run_dir)):
        return {}
    values = load_toml(path)
    flagged = [k for k in RUN_FLAGS if getattr(args, k, None) is not None and k not in ("run_dir", "steps")
               and str(getattr(args, k)) != str(values.get(k))]
    extra = ("; flags override " + ", ".join(f"{k}={getattr(args, k)}" for k in flagged)) if flagged else ""
    info("config", f"using the configuration of {path}{extra}")
    return values
