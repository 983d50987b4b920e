"""Issue 35, row 8 (numbers): an integer typed as text goes through one parser (``gate.parse_int``) and every count
field has a stated bound. Generated digit strings -- Unicode digits that ``str.isdigit`` and ``int`` accept (``"²"``,
``"١٢"``), thousands of digits, signs, values just past a field's bound -- given to flags of train, memory, profile
and plan and to a TOML config's keys: exit 2, exactly one stderr line naming the field, nothing on stdout, nothing
written, in bounded time."""

from __future__ import annotations

import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.cli_harness import cli, snapshot
from trainfit.config import MAX_COUNTS, SECTION_OF, RunConfig, make_config
from trainfit.errors import ConfigError

ASCII = "0123456789"
UNICODE_DIGITS = st.characters(categories=["Nd", "No"], exclude_characters=ASCII)
"""Digits of other scripts and superscripts: ``str.isdigit`` says yes to each, ``int`` takes the Nd ones."""


@st.composite
def foreign_digits(draw) -> str:
    """ASCII digits with at least one digit of another script among them (``"1٢3"``)."""
    head = draw(st.text(alphabet=ASCII, max_size=5))
    return head + draw(UNICODE_DIGITS) + draw(st.text(alphabet=ASCII + "٠١٢٣", max_size=5))


@st.composite
def huge(draw) -> str:
    """20 to 5,000 digits (past 2**63, past Python's own 4,300-digit limit), maybe signed."""
    n = draw(st.integers(20, 5000))
    digits = draw(st.sampled_from("123456789")) + draw(st.sampled_from(ASCII)) * (n - 1)
    return draw(st.sampled_from(["", "+", "-"])) + digits


def past_bound(top: int) -> st.SearchStrategy[str]:
    """A value from just past ``top`` up to 19 digits, as typed (with a ``+`` sometimes)."""
    return st.builds(lambda n, plus: ("+" if plus else "") + str(n), st.integers(top + 1, 10**19 - 1), st.booleans())


def bad_text(top: int) -> st.SearchStrategy[str]:
    return st.one_of(foreign_digits(), huge(), past_bound(top), st.integers(-10**6, -1).map(str),
                     st.just("²"), st.just("1_000"), st.just("0x10"), st.just("1e3"))


TRAIN_FLAGS = {"--global-batch": "global_batch", "--micro-batch": "micro_batch", "--accumulation": "accumulation",
               "--seq": "seq_len", "--steps": "steps", "--warmup-steps": "warmup_steps",
               "--checkpoint-every": "checkpoint_every", "--eval-every": "eval_every", "--save-every": "save_every"}
"""train's count flags and the field each names (the flags of memory, profile and verify are the same ones)."""

CONFIG_FIELDS = sorted({*TRAIN_FLAGS.values(), "dataset_size", "keep_checkpoints", "eval_batches",
                        "max_consecutive_skips", "devices"})
"""The count keys of a TOML config tried (each in its own section)."""

OTHER_FLAGS = {("memory", "--batch"): ("batch", MAX_COUNTS["micro_batch"]),
               ("memory", "--devices"): ("devices", MAX_COUNTS["devices"]),
               ("profile", "--warmup"): ("warmup", 10**9),
               ("plan", "--global-batch"): ("global-batch", 2**63 - 1), ("plan", "--seq"): ("seq", 2**24),
               ("plan", "--devices"): ("devices", 2**24), ("plan", "--top"): ("top", 10**6)}
PLAN_BASE = ["--device-memory", "1GiB", "--device", "cpu"]


def _refused_in_one_line(r, field: str, seconds: float) -> None:
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and r.out == "", (r.rc, r.err[:500])
    assert field in lines[0] and len(lines[0]) < 1300, lines[0][:300]
    assert seconds < 5, f"{seconds:.1f} s"
    assert r.peak_bytes < 64 * 2**20, f"{r.peak_bytes / 2**20:.0f} MiB traced"  # refused before any real work


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(sorted(TRAIN_FLAGS)), data=st.data())
def test_train_count_flags_refuse_any_bad_digit_string(tmp_path_factory, case, data):
    field = TRAIN_FLAGS[case]
    text = data.draw(bad_text(MAX_COUNTS[field]))
    tmp = tmp_path_factory.mktemp("n")
    t0 = time.perf_counter()
    r = cli(["train", f"{case}={text}", "--run-dir", str(tmp / "run")], cwd=tmp, traced=True)
    _refused_in_one_line(r, field, time.perf_counter() - t0)
    assert snapshot(tmp) == {}  # nothing written


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(sorted(OTHER_FLAGS)), data=st.data())
def test_memory_profile_and_plan_count_flags_refuse_any_bad_digit_string(tmp_path_factory, case, data):
    command, flag = case
    field, top = OTHER_FLAGS[case]
    text = data.draw(bad_text(top))
    tmp = tmp_path_factory.mktemp("n")
    base = PLAN_BASE + ([] if flag == "--global-batch" else ["--global-batch", "8"]) if command == "plan" else []
    t0 = time.perf_counter()
    r = cli([command, *base, f"{flag}={text}"], cwd=tmp, traced=True)
    _refused_in_one_line(r, field, time.perf_counter() - t0)
    assert snapshot(tmp) == {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(CONFIG_FIELDS), data=st.data(), quoted=st.booleans())
def test_a_config_key_refuses_any_bad_digit_string(tmp_path_factory, field, data, quoted):
    """In a TOML config: as a string (parsed by the one parser) or, where it is one, as a TOML integer."""
    text = data.draw(bad_text(MAX_COUNTS[field]))
    as_int = text.lstrip("+").lstrip("-").isascii() and text.lstrip("+-").isdigit() and len(text) < 300
    value = text if as_int and not quoted else '"' + text + '"'
    tmp = tmp_path_factory.mktemp("n")
    (tmp / "job.toml").write_text(f"[{SECTION_OF[field]}]\n{field} = {value}\n")
    before = snapshot(tmp)
    t0 = time.perf_counter()
    r = cli(["train", "job.toml", "--run-dir", str(tmp / "run")], cwd=tmp, traced=True)
    past_toml = value == text and abs(int(text)) >= 2**63  # the gate refuses the document, naming the file
    _refused_in_one_line(r, "job.toml" if past_toml else field, time.perf_counter() - t0)
    assert snapshot(tmp) == before


def test_every_count_field_has_a_bound_and_the_bound_is_stated():
    # the fields of RunConfig that are counts (int defaults but the seed and the worker count, bounded apart)
    counts = {k for k, v in RunConfig().to_dict().items() if type(v) is int and k not in ("seed", "loader_workers")}
    assert counts <= set(MAX_COUNTS), counts - set(MAX_COUNTS)
    for field, top in MAX_COUNTS.items():
        try:  # the bound itself passes the bound (eval_every alone is refused for having no validation split)
            make_config({field: top})
        except ConfigError as e:
            assert "more than one run can use" not in str(e), str(e)
        try:
            make_config({field: top + 1})
        except ConfigError as e:
            assert f"{top:,}" in str(e) or str(top) in str(e) or "2**64" in str(e), str(e)
        else:
            raise AssertionError(f"{field}={top + 1} accepted")
