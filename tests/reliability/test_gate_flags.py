"""Issue 35, row 12 (flags): a value given twice means nothing -- argparse keeps the last silently. Every option of
every subcommand given twice is refused in one line naming it (``--flag v``, ``--flag=v`` and an abbreviation
alike); an earlier name beside the field's own (``nproc`` beside ``devices``) and the multi-node flags on one node
are refused too. Parsing refuses before any work, so each case runs in this process in milliseconds."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.cli_harness import cli
from trainfit.cli import COMMANDS, build_parser


def _options() -> list[tuple[str, str, int, str | None]]:
    """(command, option string, number of values, the value to give or None for any text) for every option of
    every subcommand (help aside), read from the parser itself: an option added later is covered without a list
    here. An option with a type or choices gets a value it takes (argparse checks those before storing)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for name in COMMANDS:
        for action in sub.choices[name]._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            n = action.nargs if isinstance(action.nargs, int) else (0 if action.nargs == 0 else 1)
            if action.nargs == "?":
                n = 0  # --resume: its const
            fixed = str(action.choices[0]) if action.choices else "1" if action.type is not None else None
            for option in action.option_strings:
                if option not in ("--quiet", "--verbose"):  # main takes these out first (checked below)
                    found.append((name, option, n, fixed))
    return found


OPTIONS = _options()


def _spell(command: str, option: str, how: str) -> str:
    """``option`` as typed: itself, or its shortest unambiguous prefix (argparse's abbreviation)."""
    if how != "prefix":
        return option
    parser = build_parser(command)
    strings = [s for s in parser._subparsers._group_actions[0].choices[command]._option_string_actions
               if s.startswith("--")]
    for k in range(3, len(option)):
        if [s for s in strings if s.startswith(option[:k])] == [option]:
            return option[:k]
    return option


def _typed(option: str, n: int, values: list[str], how: str) -> list[str]:
    if n == 0:
        return [option]
    if how == "equals" and n == 1:
        return [f"{option}={values[0]}"]
    return [option, *values[:n]]


VALUE = st.text(alphabet="abcxyz0123456789./-_", min_size=1, max_size=12).filter(lambda v: not v.startswith("-"))


def test_the_options_are_found():
    # the generator below draws from the parser's own options: every command contributes
    commands = {c for c, _, _, _ in OPTIONS}
    assert commands == set(COMMANDS) and len(OPTIONS) > 100


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(OPTIONS), first=st.lists(VALUE, min_size=2, max_size=2),
       second=st.lists(VALUE, min_size=2, max_size=2), how=st.sampled_from(["plain", "equals", "prefix"]))
def test_every_option_of_every_command_given_twice_is_refused(case, first, second, how):
    command, option, n, fixed = case
    if fixed is not None:
        first, second = [fixed] * 2, [fixed] * 2
    typed = _spell(command, option, how)
    r = cli([command, *_typed(option, n, first, how), *_typed(typed, n, second, how)])
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and r.out == "", (r.rc, r.err)
    assert "each option once" in lines[0] and option in lines[0], lines[0]


@pytest.mark.parametrize("argv, named", [
    (["train", "--devices", "2", "--nproc", "2"], "--nproc"),  # two spellings of one option
    (["memory", "--measure", "--estimate"], "--estimate"),  # two options of one setting (argparse's own refusal)
    (["plan", "--device-memory", "1GiB", "--global-batch", "8", "--write-for", "accelerate", "a.yaml",
      "--write-for", "lightning", "b.json"], "--write-for"),
    (["--quiet", "train", "--quiet"], "--quiet"),
])
def test_two_spellings_of_one_setting_are_refused(argv, named):
    r = cli(argv)
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and named in lines[0], r.err


@pytest.mark.parametrize("flag, value", [("--master-addr", "10.1.2.3"), ("--master-port", "29999"),
                                         ("--node-rank", "0")])
def test_multi_node_flags_on_one_node_are_refused(tmp_path, flag, value):
    r = cli(["train", flag, value, "--run-dir", str(tmp_path / "run")])
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and flag in lines[0] and "--nodes" in lines[0], r.err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("table", ["[distribution]\nnproc = 2\ndevices = 2\n", "nproc = 2\ndevices = 3\n"])
def test_nproc_beside_devices_in_a_config_is_refused(tmp_path, table):
    cfg = tmp_path / "job.toml"
    cfg.write_text(table)
    r = cli(["train", str(cfg), "--run-dir", str(tmp_path / "run")])
    lines = [ln for ln in r.err.strip().splitlines() if "warning" not in ln]
    assert r.rc == 2 and len(lines) == 1 and "nproc" in lines[0] and "devices" in lines[0], r.err
    assert not (tmp_path / "run").exists()
