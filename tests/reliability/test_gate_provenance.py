"""Issue 35, row 3: a value the user wrote -- a flag, a TOML key in its section or flat, a Python keyword -- is used
as written or refused naming both sources. ``[levers] micro_batch = 2, accumulation = 3`` with ``[distribution]
global_batch = 8`` (or ``--global-batch 8``) ran with accumulation 4 and recorded 4; the same conflict as flags was
refused. The triangle global_batch = micro_batch x accumulation x ranks has one derived corner (accumulation, from
global_batch or by auto-fit): every combination of sources for its three values is generated here, and the expected
outcome is computed from the rule, not from the code."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.cli_harness import cli, snapshot
from trainfit.cli import build_parser
from trainfit.commands.flags import config_from_args
from trainfit.config import SECTION_OF, RunConfig
from trainfit.errors import ConfigError
from trainfit.front.request import config_of
from trainfit.strategies import fit_to_world

FIELDS = ("micro_batch", "accumulation", "global_batch")
VALUES = {"micro_batch": [1, 2, 4, "auto"], "accumulation": [1, 2, 3, 4], "global_batch": [4, 8, 12, 16]}
DEFAULT = RunConfig()


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _label(field: str, value, source: str) -> str:
    """How a refusal names where ``field`` was written (independent of the code: the spellings users type)."""
    shown = repr(value) if isinstance(value, str) else str(value)
    return {"flag": f"{_flag(field)} {value}", "tabled": f"[{SECTION_OF[field]}] {field} = {shown}",
            "flat": f"{field} = {shown} in", "keyword": f"{field}={shown}"}[source]


def _expected(chosen: dict[str, tuple[object, str]]):
    """(None, accumulation used) when accepted, or (the two labels a refusal names) -- from the rule alone. A file's
    key at its default value counts as unsaid (a full dump_toml writes every default)."""
    value = {f: chosen[f][0] if f in chosen else getattr(DEFAULT, f) for f in FIELDS}
    said = "accumulation" in chosen and not (chosen["accumulation"][1] in ("tabled", "flat")
                                             and value["accumulation"] == DEFAULT.accumulation)
    label = {f: _label(f, *chosen[f]) for f in chosen}
    if said and value["micro_batch"] == "auto":
        return (label["accumulation"], label["micro_batch"]), None
    if said and value["global_batch"] and value["micro_batch"] * value["accumulation"] != value["global_batch"]:
        return (label["accumulation"], label["global_batch"]), None
    return None, value["accumulation"] if said else None


@st.composite
def cli_job(draw):
    """Each field absent, a flag or a key of one TOML file (in its section tables, or flat)."""
    style = draw(st.sampled_from(["tabled", "flat"]))
    chosen = {}
    for field in FIELDS:
        source = draw(st.sampled_from(["absent", "flag", style]))
        if source != "absent":
            chosen[field] = (draw(st.sampled_from(VALUES[field])), source)
    return style, chosen


def _toml(chosen: dict, style: str) -> str:
    keys = {f: v for f, (v, s) in chosen.items() if s == style}
    lit = lambda v: f'"{v}"' if isinstance(v, str) else str(v)  # noqa: E731
    if style == "flat":
        return "".join(f"{f} = {lit(v)}\n" for f, v in keys.items())
    tables: dict[str, list[str]] = {}
    for f, v in keys.items():
        tables.setdefault(SECTION_OF[f], []).append(f"{f} = {lit(v)}")
    return "".join(f"[{t}]\n" + "\n".join(lines) + "\n" for t, lines in tables.items())


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(job=cli_job())
def test_every_source_combination_on_the_command_line(tmp_path_factory, job):
    style, chosen = job
    tmp = tmp_path_factory.mktemp("p")
    argv = ["train"]
    if any(s == style for _, s in chosen.values()):
        (tmp / "job.toml").write_text(_toml(chosen, style))
        argv.append(str(tmp / "job.toml"))
    for field, (value, source) in chosen.items():
        if source == "flag":
            argv += [_flag(field), str(value)]
    refused, used = _expected(chosen)
    args = build_parser("train").parse_args(argv)
    if refused is None:
        cfg = config_from_args(args, from_run_dir=False)
        if used is not None:  # written: run exactly as written
            assert fit_to_world(cfg, 1).accumulation == used
        return
    with pytest.raises(ConfigError) as e:
        config_from_args(args, from_run_dir=False)
    assert all(label in str(e.value) for label in refused), (refused, str(e.value))
    before = snapshot(tmp)
    r = cli([*argv, "--run-dir", str(tmp / "run")], cwd=tmp, traced=True)  # the command: one line, exit 2, nothing made
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and lines[0] == f"trainfit: error: {e.value}", r.err
    assert not (tmp / "run").exists() and snapshot(tmp) == before  # the user's files unchanged (hashed)
    assert r.seconds < 10 and r.peak_bytes < 64 * 2**20, (r.seconds, r.peak_bytes)  # refused before any real work


@settings(max_examples=100, deadline=None)
@given(chosen=st.fixed_dictionaries({}, optional={f: st.tuples(st.sampled_from(VALUES[f]), st.just("keyword"))
                                                  for f in FIELDS}))
def test_every_keyword_combination_at_the_front_door(chosen):
    os.environ.pop("WORLD_SIZE", None)
    refused, used = _expected(chosen)
    fields = {f: v for f, (v, _) in chosen.items()}
    if refused is None:
        cfg = config_of(None, fields)
        if used is not None:
            assert fit_to_world(cfg, 1).accumulation == used
        return
    with pytest.raises(ConfigError) as e:
        config_of(None, fields)
    assert all(label in str(e.value) for label in refused), (refused, str(e.value))


def test_the_reported_case_is_refused_naming_both_sources(tmp_path):
    (tmp_path / "job.toml").write_text("[levers]\nmicro_batch = 2\naccumulation = 3\n[distribution]\nglobal_batch = 8\n")
    r = cli(["train", "job.toml", "--run-dir", "run"], cwd=tmp_path)
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1, r.err
    assert "[levers] accumulation = 3" in lines[0] and "[distribution] global_batch = 8" in lines[0], lines[0]
    (tmp_path / "lev.toml").write_text("[levers]\nmicro_batch = 2\naccumulation = 3\n")
    r = cli(["train", "lev.toml", "--global-batch", "8", "--run-dir", "run"], cwd=tmp_path)
    assert r.rc == 2 and "[levers] accumulation = 3" in r.err and "--global-batch 8" in r.err, r.err
    assert not (tmp_path / "run").exists()


def test_a_config_trainfit_wrote_for_its_workers_is_not_the_users_word(tmp_path):
    """launch.toml in the launcher's own temporary directory holds resolved values (accumulation derived for the
    world it launches): read back without provenance, so a worker never refuses its own job."""
    job = tmp_path / "trainfit-launch-x" / "launch.toml"
    job.parent.mkdir()
    job.write_text('[levers]\nmicro_batch = "auto"\naccumulation = 3\n[distribution]\nglobal_batch = 8\n')
    cfg = config_from_args(build_parser("train").parse_args(["train", str(job)]), from_run_dir=False)
    assert cfg.accumulation == 3 and cfg.micro_batch == "auto"
