"""The ecosystem's precision names (issue 28, item 6) and a truthful ``requires-python`` (item 7).

Lightning's ``precision=`` spellings and the HF Trainer's ``bf16``/``fp16`` are accepted wherever trainfit takes a
precision, as trainfit's own name, echoed in one stderr line once the job is accepted. The reference for each
alias is what the tool itself runs: Lightning's precision plugin (its autocast dtype) and TrainingArguments.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tomllib
from pathlib import Path

import pytest

from tests.reliability.cli_harness import cli, error_lines
from trainfit.config import make_config
from trainfit.vocabulary import PRECISION_ALIASES, precision_facts

ALIASES = {"16-mixed": "fp16-mixed", "bf16-mixed": "bf16-mixed", "32-true": "fp32", "16-true": "fp16-true",
           "bf16-true": "bf16-true", "32": "fp32", "16": "fp16-mixed", "bf16": "bf16-mixed", "fp16": "fp16-mixed"}


@pytest.mark.parametrize("alias, name", ALIASES.items())
def test_each_alias_is_trainfits_name_for_what_the_tool_computes_in(alias, name):
    assert str(make_config({"precision": alias}).precision) == name
    if alias in ("fp16", "bf16") and name.endswith("mixed"):  # HF: TrainingArguments(bf16=True) is bf16 autocast
        assert precision_facts(name).autocast == alias and precision_facts(name).weights == "fp32"
    lightning_name = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(alias, alias)
    # (Lightning on CPU turns 16-mixed into bf16-mixed, so fp16 autocast is not built here)
    if lightning_name in ("bf16-mixed", "32-true", "16-true", "bf16-true"):
        from lightning.fabric.connector import _Connector

        plugin = _Connector(accelerator="cpu", precision=lightning_name).precision
        compute = {"16-mixed": "fp16", "bf16-mixed": "bf16", "32-true": "fp32", "16-true": "fp16",
                   "bf16-true": "bf16"}[str(plugin.precision)]
        assert precision_facts(name).compute == compute  # the same arithmetic as Lightning's own plugin


def test_a_run_flag_alias_is_echoed_once_after_acceptance(tmp_path):
    from trainfit.commands.flags import RUN_FLAGS, config_from_args

    args = argparse.Namespace(**{k: None for k in RUN_FLAGS}, config=None)
    args.precision = "16-mixed"
    from trainfit.progress import to_stderr

    err = io.StringIO()
    with contextlib.redirect_stderr(err), to_stderr():  # the CLI's handler: the note is a trainfit.config line
        cfg = config_from_args(args)
    assert str(cfg.precision) == "fp16-mixed"
    assert err.getvalue().splitlines() == ["trainfit: precision 16-mixed (Lightning) is fp16-mixed"]


def test_plan_takes_aliases_in_precisions_and_a_bad_name_is_one_line():
    base = ["plan", "--global-batch", "8", "--device-memory", "80GiB", "--basis", "analytic", "--top", "20", "--json"]
    r = cli([*base, "--precisions", "bf16,32-true"])
    assert r.rc == 0, r.err
    assert {p["precision"] for p in json.loads(r.out)["plans"]} == {"bf16-mixed", "fp32"}
    assert "trainfit: precision bf16 (Lightning; Hugging Face bf16=True) is bf16-mixed" in r.err
    assert "trainfit: precision 32-true (Lightning) is fp32" in r.err
    r = cli([*base, "--precisions", "bf16,64-true"])
    assert r.rc == 2 and error_lines(r.err) == [r.err.strip()] and "64-true" in r.err and "precision bf16" not in r.err


def test_the_alias_table_lives_with_the_precision_rows():
    import trainfit.vocabulary as v

    assert set(PRECISION_ALIASES) | {"bf16-mixed", "bf16-true"} == set(ALIASES)
    assert {str(p) for p, _ in PRECISION_ALIASES.values()} <= set(map(str, v.PRECISIONS))


def test_requires_python_matches_what_the_package_imports():
    meta = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    floor = meta["project"]["requires-python"].split(">=")[1].strip()
    source = (Path(__file__).parents[2] / "src" / "trainfit" / "config.py").read_text()
    if "\nimport tomllib" in source:  # unconditional: the standard library's TOML reader is 3.11+
        assert tuple(map(int, floor.split("."))) >= (3, 11)
    assert sys.version_info >= tuple(map(int, floor.split(".")))
