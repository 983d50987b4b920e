"""The one gate (``trainfit.gate``): every structured document and every integer from text, over the whole class.

Each property generates the class an issue reported one member of (a TOML nested thousands deep, ``"²"`` taken
for a digit, a 200,000-table file, a YAML key given twice) and asserts the promise: an accepted document equals
what the standard library's own parser reads (the independent reference), a refused one is one
:class:`ConfigError` line, within a bound on time and peak memory. The command line is checked on the same class
through ``trainfit train CONFIG.toml``: exit 2, exactly one stderr line, the user's files unchanged (hashed).
"""

from __future__ import annotations

import json
import string
import time
import tomllib
import tracemalloc

import pytest
import tomli_w
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.cli_harness import check_one_line, check_promise, cli, snapshot
from trainfit.errors import ConfigError
from trainfit.gate import CONFIG, MAX_INT_TEXT_DIGITS, Limits, listed, parse_document, parse_int

FORMATS = ("toml", "json", "yaml")


def _nested(fmt: str, depth: int, kind: str) -> str:
    """A document ``depth`` containers deep, in ``fmt``'s own syntax (arrays or tables/objects)."""
    if fmt == "json":
        return ("[" * depth + "1" + "]" * depth) if kind == "array" else ('{"a":' * depth + "1" + "}" * depth)
    if fmt == "toml":
        if kind == "array":
            return "a = " + "[" * depth + "1" + "]" * depth
        return "a." * depth + "b = 1"  # dotted keys: tables within tables, no recursion in the parser
    return ("a: " + "[" * depth + "1" + "]" * depth) if kind == "array" else ("a: " + "{b: " * depth + "1" + "}" * depth)


def _bounded(fn):
    """Run ``fn`` and return (its exception or None, seconds, peak traced bytes)."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        fn()
        caught = None
    except Exception as e:  # noqa: BLE001 - the test inspects it
        caught = e
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return caught, seconds, peak


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(FORMATS), depth=st.integers(CONFIG.max_depth + 1, 20_000),
       kind=st.sampled_from(["array", "table"]))
def test_any_nesting_past_the_bound_is_one_line_in_bounded_time_and_memory(fmt, depth, kind):
    text = _nested(fmt, depth, kind)
    caught, seconds, peak = _bounded(lambda: parse_document(text, field="config", fmt=fmt))
    assert isinstance(caught, ConfigError), (fmt, depth, kind, repr(caught)[:300])
    assert "\n" not in str(caught) and len(str(caught)) < 1200
    assert seconds < 30, seconds  # refused before parsing: well under a second on a quiet machine
    assert peak < 64 * 2**20, peak


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(FORMATS), depth=st.integers(1, CONFIG.max_depth - 1), kind=st.sampled_from(["array", "table"]))
def test_nesting_within_the_bound_reads_as_the_standard_parser_does(fmt, depth, kind):
    text = _nested(fmt, depth, kind)
    reference = {"json": json.loads, "toml": tomllib.loads, "yaml": yaml.safe_load}[fmt](text)
    assert parse_document(text, field="config", fmt=fmt) == reference


_DIGITS = st.characters(categories=["Nd", "No", "Nl"])  # every digit-like character, ASCII included


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(
    st.text(_DIGITS, min_size=1, max_size=30),
    st.builds(lambda sign, n: sign + "9" * n, st.sampled_from(["", "-", "+"]), st.integers(1, 6000)),
    st.text(string.digits + "+- _.eEx", min_size=1, max_size=25),
))
def test_an_integer_from_text_is_ascii_digits_or_refused(text):
    """Reference: Python reads the text as an int only where every character is an ASCII digit (after one sign)
    and the value has at most 19 digits; anything else (``²``, Arabic-Indic digits, 6,000 nines, ``1_000``, ``1e3``)
    is refused in one line."""
    body = text.strip()
    body = body[1:] if body[:1] in "+-" else body
    ascii_int = bool(body) and all(c in string.digits for c in body) and len(body.lstrip("0")) <= MAX_INT_TEXT_DIGITS
    caught, seconds, _ = _bounded(lambda: parse_int("--global-batch", text))
    if ascii_int:
        assert caught is None and parse_int("--global-batch", text) == int(text.strip())
    else:
        assert isinstance(caught, ConfigError), repr(caught)
        assert "--global-batch=" in str(caught) and "\n" not in str(caught)
    assert seconds < 1


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(FORMATS), bound=st.integers(10, 1500), n=st.integers(1, 3000))
def test_more_keys_than_the_bound_is_refused_fewer_are_read_whole(fmt, bound, n):
    limits = Limits(max_bytes=2**20, max_depth=32, max_items=bound)
    table = {f"k{i}": i for i in range(n)}
    text = {"json": json.dumps, "toml": tomli_w.dumps, "yaml": yaml.safe_dump}[fmt](table)
    if n > bound:
        with pytest.raises(ConfigError, match="keys and items"):
            parse_document(text, field="config", fmt=fmt, limits=limits)
    else:
        assert parse_document(text, field="config", fmt=fmt, limits=limits) == table


@settings(max_examples=20, deadline=None)
@given(fmt=st.sampled_from(FORMATS), size=st.integers(CONFIG.max_bytes + 1, 4 * CONFIG.max_bytes))
def test_a_document_past_the_byte_bound_is_refused_before_it_is_parsed(fmt, size, tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / f"c.{fmt}"
    path.write_text({"json": '"', "toml": 'a = "', "yaml": 'a: "'}[fmt] + "x" * size + '"')
    from trainfit.gate import read_document

    caught, seconds, peak = _bounded(lambda: read_document(path, field="config", fmt=fmt))
    assert isinstance(caught, ConfigError) and f"{path.stat().st_size:,} bytes" in str(caught)
    assert peak < 2**20  # refused from the file's size: nothing was read
    assert seconds < 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63) + 1, 2**63 - 1) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(value=json_values)
def test_every_json_and_yaml_document_within_the_bounds_reads_as_the_standard_parser_does(value):
    assert parse_document(json.dumps(value), field="f", fmt="json") == json.loads(json.dumps(value))
    assert parse_document(yaml.safe_dump(value), field="f", fmt="yaml") == yaml.safe_load(yaml.safe_dump(value))


@settings(max_examples=100, deadline=None)
@given(key=st.text(string.ascii_letters, min_size=1, max_size=8), a=st.integers(0, 9), b=st.integers(0, 9),
       fmt=st.sampled_from(["json", "yaml"]), depth=st.integers(0, 5))
def test_a_key_given_twice_is_refused_at_any_depth(key, a, b, fmt, depth):
    """The standard JSON and YAML readers keep the last value silently; the gate refuses naming the key."""
    if fmt == "json":
        inner = f'{{"{key}": {a}, "{key}": {b}}}'
        text = '{"x": ' * depth + inner + "}" * depth
    else:
        text = "".join("  " * i + "x:\n" for i in range(depth)) + f"{'  ' * depth}{key}: {a}\n{'  ' * depth}{key}: {b}\n"
    with pytest.raises(ConfigError, match="given twice"):
        parse_document(text, field="f", fmt=fmt)


@pytest.mark.parametrize("levels", [3, 6, 9])
def test_a_yaml_alias_bomb_is_refused_in_bounded_time(levels):
    lines = ['l0: &l0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    text = "\n".join(lines) + "\n"
    caught, seconds, peak = _bounded(lambda: parse_document(text, field="--from", fmt="yaml"))
    if 9 ** (levels + 1) > CONFIG.max_items:
        assert isinstance(caught, ConfigError), repr(caught)
    assert seconds < 2 and peak < 64 * 2**20


@settings(max_examples=50, deadline=None)
@given(items=st.lists(st.text(max_size=500), max_size=2000), limit=st.integers(1, 20))
def test_a_listed_message_is_bounded_whatever_it_lists(items, limit):
    text = listed(items, limit)
    assert len(text) <= limit * 64 + 40 and "\n" not in text.replace("\\n", "")
    if len(items) > limit:
        assert f"({len(items) - limit:,} more)" in text


def test_limits_words_state_every_bound():
    words = Limits(max_bytes=2**20, max_depth=7, max_items=123).words()
    assert "1 MiB" in words and "7 levels" in words and "123 keys" in words


# ------------------------------------------------------------------------------- the same class, on the CLI


_TOML_CASES = st.one_of(
    st.builds(lambda d: _nested("toml", d, "array"), st.integers(CONFIG.max_depth + 1, 5000)),
    st.builds(lambda d: "[model]\n" + "a." * d + "b = 1", st.integers(CONFIG.max_depth + 1, 5000)),
    st.builds(lambda n: "[levers]\nmicro_batch = " + "9" * n, st.integers(20, 6000)),
    st.builds(lambda n: "\n".join(f"[t{i}]\na = 1" for i in range(n)), st.integers(CONFIG.max_items + 1, 60_000)),
    st.builds(lambda k: '[levers]\nmicro_batch = 2\nmicro_batch = 3', st.just(0)),
)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TOML_CASES)
def test_train_refuses_any_unbounded_config_in_one_line_and_touches_nothing(text, tmp_path):
    work = tmp_path / "w"
    work.mkdir(exist_ok=True)
    config = work / "config.toml"
    config.write_text(text)
    before = snapshot(work)
    start = time.perf_counter()
    r = cli(["train", str(config), "--run-dir", str(work / "run")], cwd=work)
    assert time.perf_counter() - start < 20
    assert r.rc == 2, (r.rc, r.err[-500:])
    check_promise(r, work, before)
    check_one_line(r)


_NOT_ASCII_INT = st.one_of(
    st.text(st.characters(categories=["Nd", "No"], exclude_characters=string.digits), min_size=1, max_size=8),
    st.builds(lambda n: "9" * n, st.integers(MAX_INT_TEXT_DIGITS + 1, 5000)),
    st.builds(lambda n: "1e" + "9" * n, st.integers(3, 40)),
)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_NOT_ASCII_INT, command=st.sampled_from(["train", "plan", "memory"]))
def test_a_model_config_number_goes_through_the_one_parser_in_every_command(text, command, tmp_path):
    """``--model-config n_layer=١٢`` was 12 to ``int()`` and 5,000 digits became ``inf`` to ``float()``; a plan of
    that spec failed on its text as a file name. Now: one line naming ``model_config.n_layer``, nothing written."""
    work = tmp_path / "w"
    work.mkdir(exist_ok=True)
    args = {"train": ["train", "--steps", "1", "--run-dir", str(work / "run")],
            "plan": ["plan", "--device", "cpu", "--device-memory", "1GiB", "--global-batch", "2", "--top", "1"],
            "memory": ["memory", "--estimate"]}[command]
    before = snapshot(work)
    r = cli([*args, "--model", "gpt-tiny", "--seq-len", "16", "--model-config", f"n_layer={text},d_model=32,n_head=2"],
            cwd=work)
    assert r.rc == 2, (command, text[:40], r.err[-300:])
    check_promise(r, work, before)
    check_one_line(r)
    assert "model_config.n_layer" in r.err, r.err[:300]


@settings(max_examples=50, deadline=None)
@given(field=st.text(max_size=20), value=json_values, allowed=st.text(max_size=40), fix=st.text(max_size=40))
def test_a_refusal_crosses_a_process_boundary_as_the_same_line(field, value, allowed, fix):
    """A ConfigError pickled in a worker (a plan's trace pool, a spawned rank) and unpickled here is the same
    class, line, field and value (its four-argument ``__init__`` made unpickling fail, breaking the pool)."""
    import pickle

    error = ConfigError(field, value, allowed, fix)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is ConfigError and str(back) == str(error)
    assert back.field == field and back.value == error.value
