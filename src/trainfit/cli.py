"""The ``trainfit`` command: parse flags/TOML into a RunConfig, call one library function.

Each subcommand lives in ``trainfit.commands.<name>`` and exposes ``register(subparsers)``.
Every user error prints one line ``trainfit: error: ...`` on stderr and exits 2.
``--json`` prints exactly one JSON object on stdout; progress and logs go to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from trainfit.config import load_toml, make_config
from trainfit.errors import ConfigError, TrainfitError
from trainfit.outputs import owns
from trainfit.presets import MODEL_HELP
from trainfit.vocabulary import (
    CHECKPOINT_SPECS,
    PRECISIONS,
    CompileMode,
    CompileScope,
    OffloadPart,
    STRATEGIES,
    GradSync,
    LogSink,
    Optimizer,
    Schedule,
    choices,
)

EXIT_USAGE = 2
COMMANDS = ("train", "memory", "verify", "plan", "report", "profile", "prepare")
"""Subcommand modules under trainfit.commands, in help order."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage block
        raise SystemExit(fail(message if self.prog == "trainfit" else f"{self.prog.removeprefix('trainfit ')}: {message}"))


def fail(msg: str) -> int:
    print(f"trainfit: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


RUN_FLAGS = {
    "model": MODEL_HELP,
    "model_config": "key=value,... overrides (or a JSON config path for hf: models)",
    "seq_len": "longest sequence length in tokens",
    "precision": choices(PRECISIONS) + " (default fp32)",
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
    "tokenizer": "byte (default, nothing to download) or a directory holding a Hugging Face tokenizer.json",
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
    _refuse_overridden(cfg, given={k for k in RUN_FLAGS if getattr(args, k, None) is not None})
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


USAGE = """\
Make a PyTorch training run fit in memory and scale across devices -- measuring before changing anything.

first hour:
  trainfit train                          train the built-in GPT on generated data (about 2 minutes on 2 cores)
  trainfit memory --precision bf16-mixed  what fills memory in one step: parameters, gradients, optimizer, activations
  trainfit profile                        where each step's time goes, and what to change first
  trainfit verify --accumulation 4        check a configuration against the fp32 big-batch reference
  trainfit plan --model llama-7b --global-batch 512 --seq 4096 --device-memory 80GiB --devices 64
                                          choose precision, micro-batch, checkpointing and strategy before running
  trainfit report RUN_DIR                 one HTML page of what a run directory holds

your model, your data:
  trainfit prepare --data 'corpus/*.txt' --out tokens      tokenize once into a memory-mapped token file
  trainfit train --model hf:CKPT_DIR --data tokens --val-fraction 0.05 --eval-every 100 --log tensorboard
                                          fine-tune a local transformers checkpoint; RUN_DIR/model loads back
                                          with from_pretrained (--lora r=8,alpha=16,targets=q_proj,v_proj)

Every command takes --json (one object on stdout); train, memory, profile and verify also read a TOML config
whose keys are the flags' names (micro_batch = 8).
Bad input gives one line naming the field, the value and what is allowed, and exit status 2.
"""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``only`` (one of COMMANDS): each command module imports what
    its command runs, so registering one spares the others' imports (seconds on a small machine)."""
    parser = Parser(prog="trainfit", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMANDS if only not in COMMANDS else (only,):
        importlib.import_module(f"trainfit.commands.{name}").register(sub)
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"trainfit: warning: {str(message).splitlines()[0] if str(message) else category.__name__}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `trainfit plan ...` registers plan alone; anything else (no command, --help, a typo) registers them all,
    # so help lists every command and a wrong name is answered with the full choice.
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    warnings.simplefilter("default")
    # transformers logs its own config warnings on stderr, several lines each; keep its errors (override: set it)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.formatwarning = _one_line_warning  # a warning is one line on stderr, not its source line too
    try:
        return int(args.func(args) or 0)
    except TrainfitError as e:
        return fail(str(e))
    except OSError as e:  # the environment, not a bug: a full disk, no permission, a missing directory
        where = f": {e.filename}" if e.filename else ""
        kept = "; checkpoints already on disk are intact (they are written atomically)" if args.command == "train" else ""
        return fail(f"{args.command}: {e.strerror or e}{where}{kept}")
    except KeyboardInterrupt:
        return fail("interrupted")


if __name__ == "__main__":
    sys.exit(main())
