"""The run flags: the ``trainfit`` flags that map onto RunConfig fields, and turning them into a RunConfig.

Every command that runs a step (train, memory, profile, verify) registers these flags and reads them back with
:func:`config_from_args`: TOML file < flags < explicit overrides, then the refusals of flags that disagree or
would be ignored. Its own module below ``cli`` and the command modules, so that both import it and neither
imports the other (``cli`` registers the commands; a command never imports ``cli``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from trainfit.config import RunConfig, load_toml, make_config
from trainfit.errors import ConfigError, check_unique_keys
from trainfit.outputs import owns
from trainfit.presets import MODEL_HELP
from trainfit.tasks.corpus import find_sources
from trainfit.tasks.prepared import is_prepared
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


def add_run_flags(p: argparse.ArgumentParser, *, config_positional: bool = True) -> None:
    """The flags that map onto RunConfig fields (``--micro-batch`` -> ``micro_batch``)."""
    if config_positional:
        p.add_argument("config", nargs="?", help="TOML config file (flags override it)")
    for key, help_text in RUN_FLAGS.items():
        flags = ["--" + key.replace("_", "-")]
        if key == "seq_len":
            flags.append("--seq")
        p.add_argument(*flags, dest=key, help=help_text)


def config_from_args(args: argparse.Namespace, *, from_run_dir: bool = True, **overrides: Any):
    """TOML file (if any) < flags < explicit overrides -> a validated RunConfig.

    Without a TOML file, ``--run-dir`` of an existing run (trainfit's ``config.toml`` there) supplies the
    configuration, so ``memory``/``profile``/``verify`` pointed at a run measure that run; flags still
    override it, and stderr says which was used.
    """
    values: dict[str, Any] = load_toml(args.config) if getattr(args, "config", None) else {}
    if from_run_dir and not values and getattr(args, "run_dir", None):
        values = _run_dir_config(args)
    for key in RUN_FLAGS:
        v = getattr(args, key, None)
        if v is not None:
            values[key] = v
    values.update(overrides)
    cfg = make_config(values)
    check_unique_keys("model_config", cfg.model_config)  # the user's text (a preset's expansion may repeat keys)
    given = {k for k in RUN_FLAGS if getattr(args, k, None) is not None}
    _refuse_overridden(cfg, given=given)
    _refuse_unused(cfg, given=given)
    note = precision_alias_note(values.get("precision"))
    if note:  # accepted: another tool's spelling, echoed as trainfit's name
        print(note, file=sys.stderr)
    return cfg


def _run_dir_config(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration of the run in ``--run-dir`` (empty when it holds none), said on stderr."""
    path = Path(args.run_dir) / "config.toml"
    if not (path.is_file() and owns(args.run_dir)):
        return {}
    values = load_toml(path)
    flagged = [k for k in RUN_FLAGS if getattr(args, k, None) is not None and k not in ("run_dir", "steps")
               and str(getattr(args, k)) != str(values.get(k))]
    extra = ("; flags override " + ", ".join(f"{k}={getattr(args, k)}" for k in flagged)) if flagged else ""
    print(f"trainfit: using the configuration of {path}{extra}", file=sys.stderr)
    return values


def _refuse_overridden(cfg, *, given: set[str]) -> None:
    """An explicit ``--accumulation`` that ``--global-batch`` or ``--micro-batch auto`` would change is refused,
    not silently replaced."""
    if "accumulation" not in given:
        return
    if cfg.micro_batch == "auto":
        raise ConfigError("accumulation", cfg.accumulation, "no --accumulation with --micro-batch auto",
                          "auto-fit chooses the split of --global-batch itself")
    if cfg.global_batch:
        world = int(os.environ.get("WORLD_SIZE") or cfg.devices)
        if cfg.micro_batch * cfg.accumulation * world != cfg.global_batch:
            derived = cfg.global_batch / (cfg.micro_batch * world)
            raise ConfigError(
                "accumulation", cfg.accumulation,
                f"global_batch / (micro_batch x ranks) = {cfg.global_batch} / ({cfg.micro_batch} x {world}) = "
                f"{derived:g}", "give --global-batch or --accumulation, not two that disagree")


def _refuse_unused(cfg, *, given: set[str]) -> None:
    """A setting that would be ignored is refused, naming why: ``--compile-mode``/``--compile-scope`` without
    ``--compile on``, ``--text-field`` where no data has fields (text files, a prepared directory, no --data)."""
    default = RunConfig()
    for key in ("compile_mode", "compile_scope"):
        if not cfg.compile and (key in given or getattr(cfg, key) != getattr(default, key)):
            raise ConfigError(key, getattr(cfg, key), "a setting of --compile on",
                              "torch.compile is off, so it would be ignored: add --compile on, or drop it")
    if "text_field" in given or cfg.text_field != default.text_field:
        why = _no_fields(cfg)
        if why:
            raise ConfigError("text_field", cfg.text_field, "a setting of JSON Lines, Parquet or CSV data",
                              f"{why}, so it would be ignored: drop it")


def _no_fields(cfg) -> str:
    """Why ``--text-field`` applies to none of the run's data ("" when some source has fields)."""
    named = {f: p for f, p in (("data", cfg.data), ("val_data", cfg.val_data)) if p}
    if not named:
        return "no --data is given (the generated data has no fields)"
    for field, p in named.items():
        if not is_prepared(p) and any(s.kind != "text" for s in find_sources(p, field=field).files):
            return ""
    paths = list(named.values())
    kinds = ["a prepared directory (its fields were read by trainfit prepare)" if is_prepared(p) else
             "text files (one document per file)" for p in paths]
    return f"{' and '.join(paths)} {'are' if len(paths) > 1 else 'is'} {' and '.join(dict.fromkeys(kinds))}"
