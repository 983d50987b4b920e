"""config: RunConfig refuses a bad value by name, coerces command-line text, and its TOML reads back unchanged;
its six sections (dataclasses and TOML tables), the flat spelling of earlier versions, and the config page."""

import dataclasses
import re
import tempfile
import tomllib
import warnings
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from trainfit.config import (
    SECTION_CLASSES,
    SECTIONS,
    FlatConfigWarning,
    LeversSection,
    RunConfig,
    ScheduleSection,
    dump_toml,
    load_toml,
    make_config,
)
from trainfit.errors import ConfigError
from trainfit.vocabulary import CompileMode, Optimizer, PrecisionName, Schedule, StrategyName


@pytest.mark.parametrize("key, value, allowed", [
    ("accumulation", 0, "an integer >= 1"),
    ("micro_batch", "x", "an integer"),
    ("precision", "fp8", "one of: fp32, bf16-mixed"),
    ("lr", "fast", "a number"),
    ("optimizer", "lion", "one of:"),
    ("checkpointing", "sometimes", ""),
])
def test_a_bad_value_is_refused_naming_the_field_the_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(ConfigError) as e:
        make_config({key: value})
    assert e.value.field == key
    assert f"{key}={value!r} is not valid; allowed: " in str(e.value) or f"{key}={value} is not valid" in str(e.value)
    assert allowed in str(e.value)
    assert "\n" not in str(e.value)


def test_an_unknown_key_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"config key='micro_bach' is not valid; allowed: one of: .*micro_batch"):
        make_config({"micro_bach": 4})


def test_command_line_text_becomes_the_fields_types():
    cfg = make_config({"micro_batch": "4", "lr": "1e-2", "packing": "off", "precision": "bf16-mixed",
                       "optimizer": "sgd", "memory_cap": "2MiB", "nproc": "2"})
    assert cfg.micro_batch == 4 and cfg.lr == 0.01 and cfg.packing is False and cfg.devices == 2
    assert cfg.precision is PrecisionName.BF16_MIXED and cfg.optimizer is Optimizer.SGD
    assert cfg.memory_cap == 2 * 2**20


def test_toml_written_reads_back_to_the_same_config(tmp_path):
    cfg = make_config({"precision": "fp16-mixed", "micro_batch": 3, "accumulation": 5, "checkpointing": "every:2",
                       "lr": 1e-4, "run_dir": 'a "quoted" dir', "freeze": "*.bias", "schedule": "cosine",
                       "warmup_steps": 3})
    for only_changed in (False, True):
        path = tmp_path / f"c{only_changed}.toml"
        path.write_text(dump_toml(cfg, only_changed=only_changed))
        assert make_config(load_toml(path)) == cfg


# -- sections: RunConfig in six parts, TOML in tables (issue #29 item 3) -------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def _read(path):
    """load_toml's flat values and the FlatConfigWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = load_toml(path)
    return values, [w for w in caught if issubclass(w.category, FlatConfigWarning)]


def test_every_field_is_in_exactly_one_section_with_its_type_default_and_doc():
    names = [f.name for f in dataclasses.fields(RunConfig)]
    placed = [key for keys in SECTIONS.values() for key in keys]
    assert sorted(placed) == sorted(names) and len(placed) == len(set(placed)) == 48
    assert set(SECTIONS) == {"model", "data", "levers", "distribution", "schedule", "run"}
    default, by_name = RunConfig(), {f.name: f for f in dataclasses.fields(RunConfig)}
    for name, cls in SECTION_CLASSES.items():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
        fields = dataclasses.fields(cls)
        assert [f.name for f in fields] == list(SECTIONS[name])
        section = cls()  # the defaults are RunConfig's
        for f in fields:
            assert f.kw_only and f.type == by_name[f.name].type
            assert getattr(section, f.name) == getattr(default, f.name)
            assert f.metadata["doc"]
        with pytest.raises(TypeError):
            cls(1)  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        LeversSection().precision = "fp32"
    # the doc is the one written under the field in config.py (read here from the source text independently)
    source = (ROOT / "src" / "trainfit" / "config.py").read_text()
    assert re.search(r'\n    seed: int = 0\n    """(.*?)"""', source).group(1) == \
        dataclasses.fields(SECTION_CLASSES["run"])[0].metadata["doc"]


def test_sections_of_a_config_hold_its_values_and_build_it_back():
    cfg = make_config({"precision": "bf16-mixed", "micro_batch": 3, "strategy": "ddp", "devices": 2, "lr": 0.01,
                       "schedule": "cosine", "seed": 7, "model_config": "n_layer=1", "seq_len": 32,
                       "checkpointing": "every:2", "run_dir": "r"})
    for name, keys in SECTIONS.items():
        section = cfg.section(name)
        assert type(section) is SECTION_CLASSES[name]
        assert {k: getattr(section, k) for k in keys} == {k: getattr(cfg, k) for k in keys}
    assert RunConfig.from_sections(*cfg.sections().values()) == cfg
    assert list(cfg.sections()) == list(SECTIONS)
    # a section not given keeps the defaults (or base's values); the result is validated as any RunConfig
    assert RunConfig.from_sections(LeversSection(precision="bf16-mixed", micro_batch=5)) == \
        RunConfig(precision=PrecisionName.BF16_MIXED, micro_batch=5)
    # a section given is given whole: cfg's schedule (cosine) gives way to the section's default (constant)
    others = {k: getattr(cfg, k) for name, keys in SECTIONS.items() if name != "schedule" for k in keys}
    assert RunConfig.from_sections(ScheduleSection(lr=0.5), base=cfg) == RunConfig(lr=0.5, **others)
    with pytest.raises(ConfigError) as e:
        RunConfig.from_sections(ScheduleSection(lr=-1.0))
    assert e.value.field == "lr"
    with pytest.raises(ConfigError) as e:
        cfg.section("optimizer")
    assert e.value.field == "section"
    with pytest.raises(TypeError):
        RunConfig.from_sections({"lr": 0.5})
    with pytest.raises(TypeError):
        RunConfig.from_sections(ScheduleSection(), ScheduleSection())


def test_tables_are_read_without_a_note(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nmodel = "gpt-tiny"\nmodel_config = "n_layer=1"\n\n[data]\nseq_len = 32\n\n'
                    '[levers]\nprecision = "bf16-mixed"\nmicro_batch = 2\ncheckpointing = "full"\n\n'
                    '[distribution]\nstrategy = "ddp"\nnproc = 2\n\n[schedule]\nlr = 0.01\nschedule = "linear"\n\n'
                    '[run]\nseed = 3\nrun_dir = "r"\n')
    values, notes = _read(path)
    assert notes == []
    assert make_config(values) == RunConfig(model_config="n_layer=1", seq_len=32, precision=PrecisionName.BF16_MIXED,
                                            micro_batch=2, checkpointing=make_config({"checkpointing": "full"})
                                            .checkpointing, strategy=StrategyName.DDP, devices=2, lr=0.01,
                                            schedule=Schedule.LINEAR, seed=3, run_dir="r")


def test_flat_keys_are_read_as_before_with_one_note_line_naming_the_tables(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text('precision = "bf16-mixed"\nlr = 0.01\nmicro_batch = 2\nseed = 3\n')
    values, notes = _read(path)
    assert make_config(values) == RunConfig(precision=PrecisionName.BF16_MIXED, lr=0.01, micro_batch=2, seed=3)
    assert len(notes) == 1
    note = str(notes[0].message)
    assert "\n" not in note and note.startswith(f"{path}: flat config keys are read as before")
    assert note.endswith("the sectioned spelling is [levers] precision, micro_batch; [schedule] lr; [run] seed")
    # the [train] table of earlier versions around flat keys: the same
    (tmp_path / "t.toml").write_text("[train]\n" + path.read_text())
    values, notes = _read(tmp_path / "t.toml")
    assert make_config(values).lr == 0.01 and len(notes) == 1


@pytest.mark.parametrize("text, field, parts", [
    ('[levers]\nlr = 0.1\n', "[levers] key", ["'lr'", "[levers]", "lr belongs in [schedule]"]),
    ('[schedule]\nprecision = "fp32"\n', "[schedule] key", ["'precision'", "precision belongs in [levers]"]),
    ('[run]\nmicro_bach = 2\n', "[run] key", ["'micro_bach'", "seed", "not a config key in any table"]),
    ('[optim]\nlr = 0.1\n', "config table", ["'[optim]'", "[levers]", "[schedule]"]),
    ('lr = 0.1\n[levers]\nprecision = "fp32"\n', "config", ["flat keys or [section] tables, not both",
                                                             "lr is outside any table; write it under [schedule]"]),
    ('lr = {a = 1}\n[levers]\nprecision = "fp32"\n', "lr", ["a value, not a table", "[schedule]"]),
    ('levers = 3\n', "config key", ["'levers'", "write [levers] and its keys under it"]),
])
def test_a_misplaced_key_or_table_is_refused_in_one_line(tmp_path, text, field, parts):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        make_config(_read(path)[0])
    assert e.value.field == field and "\n" not in str(e.value)
    for part in parts:
        assert part in str(e.value)


@pytest.mark.parametrize("text, parts", [
    ('[levers]\nlr = 0.1\n', ["[levers] key='lr'", "lr belongs in [schedule]"]),
    ('steps = 2\n[schedule]\nlr = 0.1\n', ["flat keys or [section] tables, not both", "write it under [schedule]"]),
])
def test_the_command_line_refuses_a_misplaced_key_in_one_line(trainfit_cli, tmp_path, text, parts):
    (tmp_path / "c.toml").write_text(text)
    r = trainfit_cli("train", tmp_path / "c.toml", "--run-dir", tmp_path / "r")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("trainfit: error: ")
    for part in parts:
        assert part in r.stderr
    assert not (tmp_path / "r").exists()


def _config_values():
    """Configs over every section: typed names, numbers, policies and odd strings (RunConfig refuses the
    combinations it does not run; those draws are discarded)."""
    text = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)
    return st.fixed_dictionaries({}, optional={
        "model_config": text, "init_from": text.filter(str.strip), "freeze": st.sampled_from(["", "*.bias", "a.*,b"]),
        "seq_len": st.integers(2, 4096), "packing": st.booleans(), "text_field": text.filter(str.strip),
        "loader_workers": st.integers(0, 4), "dataset_size": st.integers(1, 10**6),
        "precision": st.sampled_from([str(p) for p in PrecisionName]),
        "micro_batch": st.one_of(st.integers(1, 64), st.just("auto")), "accumulation": st.integers(1, 16),
        "checkpointing": st.sampled_from(["none", "full", "every:1", "every:3", "class:Block,Attn"]),
        "offload": st.sampled_from(["", "optimizer", "activations", "optimizer,activations"]),
        "compile": st.booleans(), "compile_mode": st.sampled_from([str(m) for m in CompileMode]),
        "strategy": st.sampled_from([str(s) for s in StrategyName]), "devices": st.integers(1, 8),
        "global_batch": st.integers(0, 512), "collective_timeout_s": st.floats(0.5, 1e4),
        "optimizer": st.sampled_from(["adamw", "adam", "sgd"]), "lr": st.floats(1e-6, 10.0),
        "weight_decay": st.floats(0, 1), "grad_clip": st.floats(0, 10), "steps": st.integers(1, 10**6),
        "schedule": st.sampled_from([str(s) for s in Schedule]), "warmup_steps": st.integers(0, 100),
        "seed": st.integers(0, 2**32 - 1), "run_dir": text.filter(str.strip), "checkpoint_every": st.integers(0, 99),
        "checkpoint_minutes": st.floats(0, 120), "keep_checkpoints": st.integers(1, 9), "log": st.sampled_from(
            ["jsonl", "tensorboard"]), "memory_cap": st.integers(0, 2**40), "min_loss_scale": st.floats(0.001, 4.0),
    })


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(values=_config_values(), only_changed=st.booleans())
def test_toml_in_tables_reads_back_to_the_same_config(values, only_changed):
    try:
        cfg = make_config(values)
    except ConfigError:
        assume(False)
    text = dump_toml(cfg, only_changed=only_changed)
    raw = tomllib.loads(text)  # the tables as TOML itself reads them
    assert set(raw) <= set(SECTIONS) and all(set(raw[t]) <= set(SECTIONS[t]) for t in raw)
    assert {k for t in raw.values() for k in t} == ({k for k in cfg.to_dict() if cfg.to_dict()[k] !=
                                                     RunConfig().to_dict()[k]} if only_changed else set(cfg.to_dict()))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.toml"
        path.write_text(text)
        back, notes = _read(path)
    assert make_config(back) == cfg and notes == []


def test_a_trained_run_dir_config_is_sectioned_and_resumes_without_the_note(trainfit_cli, tmp_path):
    user = tmp_path / "flat.toml"  # the user's file in the flat spelling: one note line
    user.write_text('model_config = "n_layer=1,d_model=32,n_head=2"\nseq_len = 16\nmicro_batch = 2\n'
                    'accumulation = 2\nlr = 0.01\nsteps = 2\n')
    run = tmp_path / "run"
    r = trainfit_cli("train", user, "--run-dir", run)
    assert r.returncode == 0, r.stderr
    notes = [line for line in r.stderr.splitlines() if "flat config keys" in line]
    assert notes == [f"trainfit: warning: {user}: flat config keys are read as before; the sectioned spelling is "
                     "[model] model_config; [data] seq_len; [levers] micro_batch, accumulation; [schedule] lr, steps"]
    raw = tomllib.loads((run / "config.toml").read_text())
    assert list(raw) == list(SECTIONS)  # every table, in order, and no flat key
    assert raw["levers"]["micro_batch"] == 2 and raw["schedule"]["lr"] == 0.01 and raw["run"]["run_dir"] == str(run)
    # resumed from the run dir's own config.toml (sectioned): no note
    r = trainfit_cli("train", "--resume", "--run-dir", run, "--steps", "3")
    assert r.returncode == 0, r.stderr
    assert "flat config keys" not in r.stderr and f"using the configuration of {run / 'config.toml'}" in r.stderr
    # a run dir an earlier trainfit wrote (config.toml flat, as tomli-w wrote the whole config): read silently,
    # while the same text in the user's own file gets the note
    flat = tomli_w.dumps({k: v for t in raw.values() for k, v in t.items()})
    (run / "config.toml").write_text(flat)
    (tmp_path / "config.toml").write_text(flat)
    values, notes = _read(run / "config.toml")
    assert notes == [] and make_config(values) == make_config(raw)
    assert len(_read(tmp_path / "config.toml")[1]) == 1


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_the_config_page_lists_every_key_under_its_section_and_its_examples_load(tmp_path):
    page = (ROOT / "docs" / "config.md").read_text()
    listed = page.split("## The keys of each section")[1].split("\n## ")[0]
    found = {m.group(1): re.findall(r"`(\w+)`", m.group(2))
             for m in re.finditer(r"- `\[(\w+)\]`: (.*?)(?=\n- `\[|\n\n|\Z)", listed, re.S)}
    assert found == {name: list(keys) for name, keys in SECTIONS.items()}
    # the TOML on the page and in examples/ (and any in the README) is in tables and is a valid config
    configs = [*_blocks(page, "toml"), (ROOT / "examples" / "config.toml").read_text(),
               *_blocks((ROOT / "README.md").read_text(), "toml")]
    configs += [p.read_text() for p in sorted((ROOT / "examples").glob("*.toml")) if p.name != "config.toml"]
    for i, text in enumerate(configs):
        path = tmp_path / f"c{i}.toml"
        path.write_text(text)
        values, notes = _read(path)
        assert notes == [] and set(tomllib.loads(text)) <= set(SECTIONS), text
        make_config(values)
    assert make_config(_read(tmp_path / "c0.toml")[0]) == dataclasses.replace(
        make_config(_read(tmp_path / "c1.toml")[0]), **{k: getattr(RunConfig(), k) for k in
                                                        ("dataset_size", "devices", "optimizer", "seed",
                                                         "checkpoint_every")})
    # the page's Python runs and does what its comments say
    namespace: dict = {}
    exec(_blocks(page, "python")[0], namespace)
    cfg = namespace["cfg"]
    assert cfg == RunConfig(precision=PrecisionName.BF16_MIXED, micro_batch=4, lr=1e-3, steps=60)
    assert tomllib.loads(namespace["text"]) == {"levers": {"precision": "bf16-mixed", "micro_batch": 4},
                                                "schedule": {"lr": 1e-3, "steps": 60}}


def test_a_field_that_names_a_section_given_a_table_is_refused_naming_the_field(tmp_path):
    """`model`, `data` and `schedule` are fields and sections: `model = {a = 0}` beside flat keys is the field
    given a table (found by the property test of tests/reliability/test_bad_input.py), while `[model]` holding
    model keys is the section and an empty `[data]` table is an empty section."""
    from trainfit.config import load_toml
    from trainfit.errors import ConfigError

    bad = tmp_path / "bad.toml"
    bad.write_text('lr = 0.1\nmodel = {a = 0}\n')
    with pytest.raises(ConfigError) as e:
        load_toml(bad)
    assert "model=" in str(e.value) and "a value, not a table" in str(e.value)
    good = tmp_path / "good.toml"
    good.write_text('[model]\nmodel = "gpt-tiny"\n[data]\n[schedule]\nlr = 0.1\n')
    assert load_toml(good) == {"model": "gpt-tiny", "lr": 0.1}
