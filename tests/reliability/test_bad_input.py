"""Property-based: every invalid config value or flag -> one line naming field, value and
what is allowed, exit code 2, no traceback, nothing written to the run directory.

Each example has exactly one invalid field (given in a TOML file or as a flag), on top of
a valid tiny job; a generated value that happened to be valid would train one step and
fail the property, so the strategies below are themselves checked by the test.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainfit.cli import RUN_FLAGS
from trainfit.cli import main as cli_main
from trainfit.vocabulary import GradSync, Optimizer, PrecisionName, StrategyName

from .conftest import TINY_VALUES

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00:"), max_size=12)
ints_below = lambda m: st.integers(max_value=m - 1, min_value=-(10**6))  # noqa: E731
bad_floats = st.sampled_from([math.nan, math.inf, -math.inf])
wrong_type = st.one_of(st.lists(st.integers(0, 3), max_size=2), st.booleans(),
                       st.dictionaries(st.sampled_from("ab"), st.integers(0, 3), min_size=1, max_size=1))
non_int_text = text.filter(lambda s: _not(int, s))
non_num_text = text.filter(lambda s: _not(float, s))


def _not(conv, s: str) -> bool:
    try:
        conv(s)
        return False
    except ValueError:
        return True


def _choice(allowed):
    return st.one_of(text.filter(lambda s: s not in allowed), st.integers(), wrong_type)


def _int_field(minimum: int):
    return st.one_of(ints_below(minimum), non_int_text, st.floats(allow_nan=False).filter(lambda x: x != int(x)
                                                                                         if math.isfinite(x) else True),
                     wrong_type)


def _positive_float(inclusive: bool):
    below = st.floats(max_value=0.0, exclude_max=inclusive, allow_nan=False, allow_infinity=False)
    return st.one_of(below, bad_floats, non_num_text, wrong_type)


INVALID = {
    "precision": _choice(tuple(PrecisionName)),
    "strategy": _choice(tuple(StrategyName)),
    "grad_sync": _choice(tuple(GradSync)),
    "optimizer": _choice(tuple(Optimizer)),
    "micro_batch": st.one_of(ints_below(1), non_int_text.filter(lambda s: s != "auto"), wrong_type),
    "accumulation": _int_field(1),
    "seq_len": _int_field(2),
    "steps": _int_field(1),
    "seed": _int_field(0),
    "devices": _int_field(1),
    "dataset_size": _int_field(1),
    "loader_workers": _int_field(0),
    "checkpoint_every": _int_field(0),
    "keep_checkpoints": _int_field(1),
    "max_consecutive_skips": _int_field(1),
    "lr": _positive_float(inclusive=False),
    "min_loss_scale": _positive_float(inclusive=False),
    "weight_decay": _positive_float(inclusive=True),
    "grad_clip": _positive_float(inclusive=True),
    "memory_cap": st.one_of(st.integers(max_value=-1), st.sampled_from(["-1GiB", "12 parsecs", "GiB", "1.5.2MB"]),
                            st.lists(st.integers(0, 3), min_size=1, max_size=2)),
    "checkpointing": st.one_of(st.sampled_from(["sometimes", "every:0", "every:-2", "every:x", "class:", "full,none"]),
                               st.integers(), wrong_type),
    "model": st.one_of(text.filter(lambda s: s and s not in ("gpt-tiny", "gpt-small", "gpt2-small", "cnn")),
                       st.just(""), st.integers(), wrong_type),
    "model_config": st.one_of(st.sampled_from(["n_layer=0", "d_model=33", "n_head=-1", "bogus=1", "n_layer",
                                               "dropout=1.5", "vocab_size=x"]), st.integers(), wrong_type),
    "run_dir": st.one_of(st.just(""), st.integers(), wrong_type),
    "global_batch": _int_field(0),
    "collective_timeout_s": _positive_float(inclusive=False),
}
"""Field -> values that must be refused (the tiny job's other fields stay valid)."""


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        # TOML refuses JSON's surrogate-pair escapes and a raw DEL; JSON already escapes C0 controls.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = cli_main(argv)
        except SystemExit as e:  # argparse errors exit from inside parse_args
            rc = e.code
    return rc, err.getvalue()


def _check_refused(rc: int, err: str, field: str, value, run_dir: Path) -> None:
    assert rc == 2, (field, value, err)
    assert err.count("\n") == 1 and err.startswith("trainfit: error: "), err  # exactly one line
    assert "Traceback" not in err
    line = err.strip()
    assert field in line, (field, line)
    shown = {repr(value), str(value)}
    if field == "model_config" and isinstance(value, str):
        # The offending key or its value is named (model_config='bogus', model_config.vocab_size='x').
        shown |= {repr(x) for p in value.split(",") for x in p.split("=", 1)} | {f".{p}" for p in value.split(",")}
    assert any(s in line for s in shown), (value, line)
    assert "allowed" in line or "expected" in line, line
    assert not run_dir.exists(), "an invalid input wrote to the run directory"


@pytest.mark.parametrize("field", sorted(INVALID))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), via_flag=st.booleans(), wrap_table=st.booleans())
def test_every_invalid_value_is_refused_in_one_line(field, data, via_flag, wrap_table):
    value = data.draw(INVALID[field], label="value")
    flag_ok = field in RUN_FLAGS and isinstance(value, (str, int, float)) and not isinstance(value, bool)
    if field == "run_dir":
        flag_ok = value == ""  # any other text is a valid directory name
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        values = {**TINY_VALUES, "steps": 1, "run_dir": str(run_dir)}
        argv = ["train"]
        if via_flag and flag_ok:
            value = str(value)
            argv.append(f"--{field.replace('_', '-')}={value}")
        else:
            values[field] = value
        if field == "run_dir":
            run_dir = Path(tmp) / "never"  # (an empty run_dir would mean the current directory)
        body = "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items())
        cfg = Path(tmp) / "c.toml"
        cfg.write_text("[train]\n" + body if wrap_table else body)
        rc, err = _run([*argv[:1], str(cfg), *argv[1:]])
        _check_refused(rc, err, field, value, run_dir)


@SETTINGS
@given(key=st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True))
def test_unknown_config_keys_are_named_with_the_known_ones(key):
    from trainfit.config import FIELDS

    if key in FIELDS:
        return
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.toml"
        cfg.write_text(f'{key} = 1\nrun_dir = "{tmp}/run"\n')
        rc, err = _run(["train", str(cfg)])
        _check_refused(rc, err, "config key", key, Path(tmp) / "run")
        assert "micro_batch" in err  # the allowed keys are listed


@SETTINGS
@given(junk=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30))
def test_unparsable_toml_is_one_line(junk):
    import tomllib

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "c.toml"
        cfg.write_text(junk)
        try:  # as the loader reads it (text mode turns a lone "\r" into a newline, which is valid)
            tomllib.loads(cfg.read_text())
            return  # happened to be valid TOML
        except tomllib.TOMLDecodeError:
            pass
        rc, err = _run(["train", str(cfg), "--steps=1", "--model-config=n_layer=1,d_model=32,n_head=2",
                        f"--run-dir={tmp}/run"])
        _check_refused(rc, err, "config", str(cfg), Path(tmp) / "run")


@SETTINGS
@given(flag=st.from_regex(r"--[a-z][a-z-]{0,12}", fullmatch=True))
def test_unknown_flags_are_one_line(flag):
    from trainfit.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and "train" in a.choices)
    known = set(sub.choices["train"]._option_string_actions)
    if any(k.startswith(flag) for k in known):  # argparse accepts unambiguous prefixes
        return
    with tempfile.TemporaryDirectory() as tmp:
        rc, err = _run(["train", flag, f"--run-dir={tmp}/run"])
        assert rc == 2 and err.count("\n") == 1 and flag in err and "Traceback" not in err, err
        assert not (Path(tmp) / "run").exists()
