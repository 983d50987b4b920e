"""Issue 38, point 4: a command line that answers at once, and help whose examples mean what they say.

``--help`` of every command builds its parser from light modules only: in a fresh interpreter (a subprocess, so
that nothing imported by another test hides an import), printing any command's help leaves torch, numpy,
transformers and matplotlib -- and the command's own module, which imports what it runs -- out of
``sys.modules``. Deterministic: the modules imported are checked, not the time taken (``benchmarks/help_speed.py``
times it). The help still lists every option its parser has, and every example it gives parses and uses
``--devices`` as it means today (devices per node).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from trainfit.cli import COMMANDS, USAGE, build_parser

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "numpy", "transformers", "matplotlib")
"""Libraries that take seconds to import: none of them may be imported to print help."""

_PROBE = """
import contextlib, io, json, sys
from trainfit.cli import main
out, code = io.StringIO(), 0
try:
    with contextlib.redirect_stdout(out):
        main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "help": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def _help_in_fresh_process(argv: list[str]) -> dict:
    """``trainfit ARGV`` run in a new interpreter: its exit code, what it printed and every module it imported."""
    r = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120, check=False,
                       cwd=ROOT, env={**os.environ, "COLUMNS": "120"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


CASES = [[], *[[name] for name in COMMANDS]]


@pytest.mark.parametrize("command", CASES, ids=lambda c: c[0] if c else "trainfit")
def test_help_imports_nothing_heavy(command):
    done = _help_in_fresh_process([*command, "--help"])
    assert done["code"] == 0 and "usage: trainfit" in done["help"]
    heavy = [m for m in done["modules"] if m.split(".")[0] in HEAVY]
    assert not heavy, f"`trainfit {' '.join(command)} --help` imported {heavy[:5]}"
    # the command's own module imports what it runs: it is imported to run the command, never to print its help
    ran = [f"trainfit.commands.{name}" for name in COMMANDS if f"trainfit.commands.{name}" in done["modules"]]
    assert not ran, f"`trainfit {' '.join(command)} --help` imported {ran}"


def test_version_imports_nothing_heavy():
    from trainfit import __version__

    done = _help_in_fresh_process(["--version"])
    assert done["code"] == 0 and done["help"].strip() == f"trainfit {__version__}"
    assert not [m for m in done["modules"] if m.split(".")[0] in HEAVY]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _shown_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of the parser's actions that help shows (a suppressed one is the launcher's own)."""
    return {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings}


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_help_lists_every_option(name, capsys):
    """The printed help names each option of the command's parser (all its spellings), and no option it lacks."""
    from trainfit.cli import main

    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    listed = set(re.findall(r"(?<![\w-])(-{1,2}[a-z][a-z-]*)", text.split("\n\n", 1)[1]))  # after the usage block
    wanted = _shown_options(_subparsers(build_parser(name))[name])
    assert wanted and wanted <= listed, sorted(wanted - listed)


def _examples(text: str) -> list[str]:
    """The ``trainfit ...`` command lines of a help text or README (a trailing description cut off)."""
    found = []
    for line in text.splitlines():
        line = line.strip().removeprefix("$ ")
        if line.startswith("trainfit ") and "`" not in line:
            found.append(re.split(r"\s{2,}", line)[0])
    return found


def test_every_example_in_the_help_parses():
    """Each command line trainfit's own help shows is one its parser takes (no flag renamed or gone)."""
    examples = _examples(USAGE)
    assert len(examples) >= 8
    for line in examples:
        argv = shlex.split(line)[1:]
        args = build_parser(argv[0]).parse_args(argv)
        assert args.command == argv[0], line


PER_NODE = 8
"""The most devices one node holds on the machines trainfit's device table lists (an 8-GPU HGX/DGX node)."""


def _device_counts(text: str) -> list[tuple[str, int]]:
    return [(m.group(0), int(m.group(2))) for m in re.finditer(r"--(devices|nproc|world)[ =](\d+)", text)]


def test_examples_count_devices_per_node():
    """``--devices`` counts one node's devices (``--nodes`` the nodes): an example of 64 devices says
    ``--devices 8 --nodes 8``. Every count in the help (the usage text and each command's help) and in the
    README's command lines is at most one node's devices."""
    parser = build_parser()
    texts = [USAGE, parser.format_help(), *(p.format_help() for p in _subparsers(parser).values()),
             "\n".join(_examples((ROOT / "README.md").read_text()))]
    counts = [c for text in texts for c in _device_counts(text)]
    assert counts, "no --devices example found"
    assert all(n <= PER_NODE for _, n in counts), [c for c in counts if c[1] > PER_NODE]
    plan = next(shlex.split(line)[1:] for line in _examples(USAGE) if line.startswith("trainfit plan"))
    args = build_parser("plan").parse_args(plan)
    assert int(args.devices) * int(args.nodes) == 64  # the llama-7b example: 64 devices, as it always meant


def test_the_mirrored_facts_match_their_homes():
    """The parsers mirror four facts whose homes import torch or numpy; each mirror equals its home."""
    from trainfit.commands.parsers import prepare, train, verify
    from trainfit.integrations import frameworks
    from trainfit.strategies import launch
    from trainfit.tasks import tokenizer

    assert verify.FRAMEWORKS == frameworks.FRAMEWORKS and verify.LOSSES == frameworks.LOSSES
    assert train.JOIN_TIMEOUT_S == launch.JOIN_TIMEOUT_S
    assert prepare.BYTE == tokenizer.BYTE
