"""The ``trainfit`` command: parse flags/TOML into a RunConfig, call one library function.

Each subcommand's flags live in ``trainfit.commands.parsers.<name>`` (``register(subparsers)``: light modules only,
so ``--help`` answers at once); its work in ``trainfit.commands.<name>`` (``run(args)``), imported by
:func:`run_command` only when the command runs.
Every user error prints one line ``trainfit: error: ...`` on stderr and exits 2.
``--json`` prints exactly one JSON object on stdout; progress and logs go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings

import trainfit.progress as progress
from trainfit import __version__
from trainfit.commands.flags import EXIT_USAGE, RUN_FLAGS, add_run_flags, config_from_args  # noqa: F401 -- re-exported
from trainfit.errors import ConfigError, TrainfitError, one_line
from trainfit.logs import held_until_accepted

COMMANDS = ("train", "memory", "verify", "plan", "report", "profile", "prepare")
"""The subcommands, in help order: each has its parser in trainfit.commands.parsers and its run in
trainfit.commands."""

HELD = ("train", "memory", "verify", "profile", "plan", "prepare")
"""Commands whose stderr is held until the job is accepted (``logs.accept``): a refusal prints one line, not
the data, tokenizer and progress lines that came before it."""


class _Once:
    """An option's action that refuses a second appearance of its destination: argparse keeps the last value of a
    repeated option silently (``--steps 5 --steps 50``, ``--devices 2 --nproc 4``, ``--measure --estimate``, two
    ``--write-for``). Every store/store_const/store_true/store_false option of every Parser is one (registered in
    :class:`Parser`), so the rule holds for each flag without a list of them: ``--flag=value`` and abbreviations
    reach the same action."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = parser.__dict__.setdefault("_given", {})
        if option_string is not None and self.dest in given:  # positionals are consumed once by argparse itself
            first = given[self.dest]
            raise ConfigError(option_string, _value_text(self, values), "each option once",
                              f"{first[0]} {_value_text(self, first[1])} is given before it, and argparse would "
                              "keep the last silently; keep one")
        if option_string is not None:
            given[self.dest] = (option_string, values)
        super().__call__(parser, namespace, values, option_string)


def _value_text(action: argparse.Action, values: object) -> str:
    """What an option was given, as typed (a flag without a value: "on")."""
    if action.nargs == 0:
        return "on"
    return " ".join(map(str, values)) if isinstance(values, list) else str(values)


_ONCE_ACTIONS = {name: type(f"Once{cls.__name__}", (_Once, cls), {}) for name, cls in (
    (None, argparse._StoreAction), ("store", argparse._StoreAction), ("store_const", argparse._StoreConstAction),
    ("store_true", argparse._StoreTrueAction), ("store_false", argparse._StoreFalseAction))}
"""The actions every Parser registers in place of argparse's own (each refuses a repeated option)."""


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name, cls in _ONCE_ACTIONS.items():  # argument groups share this registry: their options too
            self.register("action", name, cls)

    def parse_known_args(self, args=None, namespace=None):
        self._given = {}  # the options seen in this parse (a parser may parse more than once)
        try:
            return super().parse_known_args(args, namespace)
        except ConfigError as e:  # a repeated option (_Once): one line, as any parse error
            self.error(str(e))

    def error(self, message: str) -> None:  # one line, no usage block
        where = "" if self.prog == "trainfit" else f"{self.prog.removeprefix('trainfit ')}: "
        raise SystemExit(fail(where + message))


def fail(msg: str) -> int:
    print(f"trainfit: error: {one_line(msg)}", file=sys.stderr)  # one line, however long the value it echoes
    return EXIT_USAGE


# The run flags (RUN_FLAGS, add_run_flags, config_from_args and the refusals of flags that disagree or would be
# ignored) live in trainfit/commands/flags.py, below both this module and the commands that use them.


USAGE = """\
Make a PyTorch training run fit in memory and scale across devices -- measuring before changing anything.

first hour:
  trainfit train                          train the built-in GPT on generated data (about 2 minutes on 2 cores)
  trainfit memory --precision bf16-mixed  what fills memory in one step: parameters, gradients, optimizer, activations
  trainfit profile                        where each step's time goes, and what to change first
  trainfit verify --accumulation 4        check a configuration against the fp32 big-batch reference
  trainfit plan --model llama-7b --global-batch 512 --seq 4096 --device-memory 80GiB --devices 8 --nodes 8
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
Progress goes to stderr ("trainfit: plan: traced pair 3/8 ..."): --quiet keeps warnings and errors only, --verbose
adds debug lines; either one before or after the command name.
"""

VERBOSITY = {"--quiet": "quiet", "--verbose": "verbose"}
"""The global flags, taken out of the arguments wherever they stand (before or after the command's name)."""
LEVELS = {"quiet": progress.QUIET, "normal": progress.NORMAL, "verbose": progress.VERBOSE}
VERBOSITY_ENV = "TRAINFIT_VERBOSITY"
"""quiet, normal or verbose: the level when no flag is given. ``main`` sets it while a flag's command runs, so the
workers ``train --devices N`` starts say as much as it does."""


def split_verbosity(argv: list[str]) -> tuple[list[str], str | None]:
    """(``argv`` without ``--quiet`` / ``--verbose``, which one was given or None); a lone ``--`` ends the scan.

    Raises:
        ConfigError: both were given."""
    rest, given = [], []
    for i, arg in enumerate(argv):
        if arg == "--":
            rest.extend(argv[i:])
            break
        (given if arg in VERBOSITY else rest).append(arg)
    if len(given) > 1:  # both, or one twice: each option once, as every other (Parser's _Once)
        raise ConfigError("verbosity", " ".join(given), "one of --quiet, --verbose, once",
                          "--quiet prints warnings and errors only, --verbose adds debug lines")
    return rest, VERBOSITY[given[0]] if given else None


def verbosity_level(given: str | None) -> int:
    """The logging level of the flag given, else of $TRAINFIT_VERBOSITY, else INFO."""
    name = given or os.environ.get(VERBOSITY_ENV) or "normal"
    if name not in LEVELS:
        raise ConfigError(VERBOSITY_ENV, name, tuple(LEVELS), "or pass --quiet / --verbose")
    return LEVELS[name]


@contextlib.contextmanager
def _verbosity_env(given: str | None):
    """$TRAINFIT_VERBOSITY set to the flag given while the command runs (its workers inherit it), then restored."""
    if given is None:
        yield
        return
    before = os.environ.get(VERBOSITY_ENV)
    os.environ[VERBOSITY_ENV] = given
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(VERBOSITY_ENV, None)
        else:
            os.environ[VERBOSITY_ENV] = before


def _add_verbosity_flags(parser: argparse.ArgumentParser) -> None:
    """--quiet / --verbose in ``parser``'s help (``main`` takes them out of the arguments before parsing)."""
    if any(flag in parser._option_string_actions for flag in VERBOSITY):  # a command that defines its own
        return
    group = parser.add_argument_group("verbosity (before or after the command name)")
    group.add_argument("--quiet", action="store_true", help="print warnings and errors only on stderr: no progress "
                                                            "or info lines, no progress bar")
    group.add_argument("--verbose", action="store_true", help="also print debug lines: every step of a progress "
                                                              "loop, what each probe inside it does")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``only`` (one of COMMANDS). The parsers import light modules only
    (the vocabulary, the config's facts): torch, numpy and the front door wait for :func:`run_command`."""
    parser = Parser(prog="trainfit", description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"trainfit {__version__}")
    _add_verbosity_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMANDS if only not in COMMANDS else (only,):
        importlib.import_module(f"trainfit.commands.parsers.{name}").register(sub)
    for command_parser in sub.choices.values():
        _add_verbosity_flags(command_parser)
    return parser


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command: its module (``trainfit.commands.<name>``, which imports what the command runs)
    is imported now, once its flags have parsed, not to print help or refuse a flag."""
    return int(importlib.import_module(f"trainfit.commands.{args.command}").run(args) or 0)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"trainfit: warning: {str(message).splitlines()[0] if str(message) else category.__name__}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # `trainfit --quiet plan ...` and `trainfit plan ... --quiet` alike
        argv, given = split_verbosity(argv)
        level = verbosity_level(given)
    except ConfigError as e:
        return fail(str(e))
    # `trainfit plan ...` registers plan alone; anything else (no command, --help, a typo) registers them all,
    # so help lists every command and a wrong name is answered with the full choice.
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    warnings.simplefilter("default")
    # transformers logs its own config warnings on stderr, several lines each; keep its errors (override: set it)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.formatwarning = _one_line_warning  # a warning is one line on stderr, not its source line too
    refused = (TrainfitError, OSError, KeyboardInterrupt, SystemExit)  # what is held is dropped: one line
    try:  # progress lines are written to the stderr of their moment: a held one holds them too
        with progress.to_stderr(level), _verbosity_env(given), \
                held_until_accepted(dropped_on=refused) if args.command in HELD else contextlib.nullcontext():
            return run_command(args)
    except TrainfitError as e:
        return fail(str(e))
    except OSError as e:  # the environment, not a bug: a full disk, no permission, a missing directory
        where = f": {e.filename}" if e.filename else ""
        kept = ("; checkpoints already on disk are intact (they are written atomically)" if args.command == "train"
                else "")
        return fail(f"{args.command}: {e.strerror or e}{where}{kept}")
    except KeyboardInterrupt:
        return fail("interrupted")


if __name__ == "__main__":
    sys.exit(main())
