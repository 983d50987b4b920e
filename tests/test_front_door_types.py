"""Issue 35, row 13: the Python front door with wrong types (``trainfit.plan("str")``, ``train(model_config={...})``,
``prepare(data=123)``) raised AttributeError/TypeError from deep inside, and said progress and INFO lines before the
error. Every front-door function x every keyword (its own and the RunConfig / PlanRequest fields it takes as
``**`` keywords) x values of types the keyword does not take: a ConfigError and nothing else, nothing logged (at
INFO, through the user's own logging) and nothing printed. The types each keyword takes are read from the
signature's annotations and the dataclasses' defaults here, independently of the code under test."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainfit
from trainfit.config import RunConfig
from trainfit.errors import ConfigError
from trainfit.vocabulary import CheckpointPolicy

FUNCTIONS = ("plan", "estimate_memory", "measure_memory", "profile", "verify", "verify_framework", "train", "prepare")
HOMES = {"plan": "trainfit.front.plan", "estimate_memory": "trainfit.front.memory",
         "measure_memory": "trainfit.front.memory", "profile": "trainfit.front.profile",
         "verify": "trainfit.front.verify", "verify_framework": "trainfit.front.verify",
         "train": "trainfit.front.train", "prepare": "trainfit.front.prepare"}
REQUIRED = {"verify_framework": {"framework": "hf-trainer"}, "prepare": {"data": "in.txt", "out": "prepared"}}
"""Required keywords, given valid so that the one drawn is what is wrong."""


def _takes(hint, value) -> bool:
    """Whether ``value`` is of the annotated type (the test's own reading of an annotation)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return any(_takes(a, value) for a in args)
    if hint is type(None):
        return value is None
    if origin in (tuple, list) or str(origin).endswith("Sequence'>"):
        return isinstance(value, (tuple, list)) and all(_takes(args[0], v) for v in value)
    if origin is not None:
        return True  # Mapping[...] and the like: the function checks these itself
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, (str, os.PathLike))
    return isinstance(value, hint)


def _run_field_takes(field: str, value) -> bool:
    default = getattr(RunConfig(), field)
    if isinstance(value, str):
        return True  # text: parsed as the flag's text is (a bad one is a ConfigError of its own)
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, CheckpointPolicy):
        return isinstance(value, CheckpointPolicy)
    return isinstance(value, type(default))


def _keywords() -> list[tuple[str, str]]:
    out = []
    for name in FUNCTIONS:
        fn = getattr(importlib.import_module(HOMES[name]), name)
        params = inspect.signature(fn).parameters
        for p in params.values():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                from trainfit.front.plan_request import PlanRequest

                owner = PlanRequest if name == "plan" else RunConfig
                out += [(name, f"**{f.name}") for f in dataclasses.fields(owner) if f.init and f.name not in params]
            elif p.kind is not inspect.Parameter.POSITIONAL_ONLY:
                out.append((name, p.name))
    return out


KEYWORDS = _keywords()
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                      st.binary(max_size=8), st.lists(st.integers(), max_size=3),
                      st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.builds(object),
                      st.tuples(st.integers()), st.sets(st.integers(), max_size=2), st.complex_numbers(),
                      st.just(RunConfig), st.just(print))


def _wrong(name: str, keyword: str, value) -> bool:
    if keyword.startswith("**"):
        field = keyword[2:]
        if name == "plan":
            from trainfit.front.plan_request import PlanRequest

            return not _takes(typing.get_type_hints(PlanRequest)[field], value)
        return not _run_field_takes(field, value)
    fn = getattr(importlib.import_module(HOMES[name]), name)
    return not _takes(typing.get_type_hints(fn)[keyword], value)


@pytest.fixture
def quiet_check(capsys, caplog):
    """Asserts, after the call, that nothing was printed and nothing logged (the user's logging at INFO)."""
    caplog.set_level(logging.INFO)
    logging.getLogger("trainfit").setLevel(logging.INFO)

    def check():
        out, err = capsys.readouterr()
        assert out == "" and err == "", (out, err)
        assert [r for r in caplog.records if r.name.startswith("trainfit")] == [], caplog.records
        caplog.clear()

    return check


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.filter_too_much])
@given(case=st.sampled_from(KEYWORDS), value=ANY_VALUE)
def test_every_keyword_of_every_front_door_function_refuses_a_wrong_type_with_a_config_error(
        quiet_check, tmp_path_factory, case, value):
    name, keyword = case
    if not _wrong(name, keyword, value):
        return
    os.chdir(tmp_path_factory.mktemp("door"))  # nothing may be written; if it were, it lands here
    kwargs = {**REQUIRED.get(name, {}), keyword.lstrip("*"): value}
    with pytest.raises(ConfigError) as e:
        getattr(trainfit, name)(**kwargs)
    assert "\n" not in str(e.value) and keyword.lstrip("*") in str(e.value), str(e.value)
    quiet_check()


@pytest.mark.parametrize("call", [
    lambda: trainfit.plan("str"),
    lambda: trainfit.plan(42),
    lambda: trainfit.train(model_config={"n_layer": 2}),
    lambda: trainfit.prepare(data=123, out="p"),
    lambda: trainfit.prepare(data="x"),  # a required keyword missing: named, not Python's TypeError
    lambda: trainfit.estimate_memory(no_such_field=1),
    lambda: trainfit.train(None, None),
    lambda: trainfit.plan(device=1, global_batch=8, device_memory="1GiB"),
])
def test_the_reported_calls_raise_a_config_error_and_say_nothing(quiet_check, tmp_path, monkeypatch, call):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError):
        call()
    quiet_check()
    assert list(tmp_path.iterdir()) == []


def test_a_refusal_after_checks_that_log_says_nothing_before_it(quiet_check, tmp_path, monkeypatch):
    """A value of the right type that the job refuses later (the data file is missing): still nothing logged."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError):
        trainfit.train(data=str(tmp_path / "missing.txt"), steps=1, run_dir=str(tmp_path / "run"))
    quiet_check()
