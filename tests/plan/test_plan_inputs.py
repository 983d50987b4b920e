"""``trainfit plan``'s inputs (issue 17): bounded work for any global batch, every numeric flag range-checked
naming the flag, every ``--model-config`` override applied or refused naming ``model_config.<key>``, and
``--write``/``--report`` outputs checked before any work, written only after the plan succeeded.

Each CLI test runs ``trainfit.cli.main`` in this process: a refusal is exit 2 with one line on stderr
naming the field, nothing on stdout, no traceback.
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

import trainfit.front.plan as plan_cmd
from trainfit.cli import main
from trainfit.errors import ConfigError
from trainfit.outputs import MARKER
from trainfit.plan.search import (
    MICRO_BATCH_SCAN,
    SearchSpace,
    candidates,
    divisors,
    explain_batch,
    micro_batch_choices,
)
from trainfit.plan.shapes import plan_model, shape_of
from trainfit.units import parse_bytes

BASE = ["plan", "--global-batch", "64", "--device-memory", "80GiB", "--devices", "8"]
TINY = "n_layer=2,d_model=32,n_head=2"


def _base_without(flag: str) -> list[str]:
    """BASE without ``flag`` and its value: a flag given twice is refused (issue 35, row 12)."""
    i = BASE.index(flag)
    return BASE[:i] + BASE[i + 2:]


def _refused(capsys, args: list[str], field: str) -> str:
    """Run ``trainfit ARGS``: exit 2, nothing on stdout, one error line naming ``field=``; returns the line."""
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert out == "" and "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("trainfit: error: "), err
    named = lines[0].removeprefix("trainfit: error: ").partition("=")[0]
    assert named == field or named.startswith(field + "."), lines[0]  # "model_config" takes model_config.<key>
    return lines[0]


def _json(capsys, args: list[str]) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out, parse_constant=lambda t: pytest.fail(f"non-finite JSON token {t}"))


@pytest.fixture
def no_search(monkeypatch):
    """Fail the test if the planner's search runs (a refusal must come before any work)."""
    def search(*a, **kw):
        raise AssertionError("the search ran")

    monkeypatch.setattr(plan_cmd, "search", search)


# -- 1. bounded work ---------------------------------------------------------------------------------------------------
def test_plan_answers_a_global_batch_of_10_18_in_bounded_time(capsys):
    t0 = time.perf_counter()
    out = _json(capsys, ["plan", "--global-batch", str(10**18), "--device-memory", "80GiB"])
    wall = time.perf_counter() - t0
    assert wall < 5, f"{wall:.2f} s"  # about 0.6 s idle; generous for a loaded 2-core machine
    assert all(p["micro_batch"] * p["accumulation"] == 10**18 for p in out["plans"])
    assert any("micro-batches tried" in n and str(MICRO_BATCH_SCAN) in n for n in out["notes"])


def test_plan_answers_a_global_batch_of_10_18_over_devices_in_bounded_time(capsys):
    t0 = time.perf_counter()
    out = _json(capsys, [*_base_without("--global-batch"), "--global-batch", str(10**18)])
    assert time.perf_counter() - t0 < 5
    assert all(p["micro_batch"] * p["accumulation"] * 8 == 10**18 for p in out["plans"])


def test_divisor_search_is_bounded_and_complete_up_to_the_cap_squared():
    for n in range(1, 400):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    for n in (*range(1, 400), 720720, 5040, MICRO_BATCH_SCAN**2 - 1, MICRO_BATCH_SCAN**2):
        assert divisors(n, scan=MICRO_BATCH_SCAN) == divisors(n)  # complete up to the cap squared
        assert micro_batch_choices(n) == (divisors(n), "")
    t0 = time.perf_counter()
    mbs, note = micro_batch_choices(10**18)
    assert time.perf_counter() - t0 < 0.5
    assert len(mbs) <= 2 * MICRO_BATCH_SCAN and all(10**18 % m == 0 for m in mbs)
    assert 4096 in mbs and 10**18 // 4096 in mbs and note
    prime = 2**61 - 1  # no divisor to find below the cap: 1 and itself
    assert micro_batch_choices(prime)[0] == [1, prime]


def test_normal_batches_try_every_divisor_as_before():
    space = SearchSpace(global_batch=96, devices=2, memory_bytes=2**30)
    assert sorted({c.micro_batch for c in candidates(space)}) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]


def test_explain_batch_is_bounded_for_huge_numbers():
    t0 = time.perf_counter()
    text = explain_batch(10**20, 10**19 + 7)
    assert time.perf_counter() - t0 < 1
    assert "nearest valid global batches" in text
    assert "keep 30 on 2 or 3 or 5 devices" in explain_batch(30, 4)  # small numbers: as before


def test_huge_global_batch_that_does_not_split_is_refused_fast(capsys):
    t0 = time.perf_counter()
    _refused(capsys, ["plan", "--global-batch", str(10**20), "--devices", str(10**19 + 7), "--device-memory",
                      "80GiB"], "global-batch")
    assert time.perf_counter() - t0 < 5


# -- 2. numeric flags --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["0.5", "0.5B", "0", "-1", "nan", "inf", "1e400", "abc", ""])
def test_device_memory_below_one_byte_or_not_a_size_names_the_flag(capsys, no_search, text):
    msg = _refused(capsys, ["plan", "--global-batch", "8", "--device-memory", text], "device-memory")
    assert f"device-memory={text!r}" in msg and "memory-bytes" not in msg and "at least 1 byte" in msg


def test_parse_bytes_is_exact_and_bounded():
    assert parse_bytes("x", "4.35MB") == 4_350_000  # float arithmetic gives 4349999
    assert parse_bytes("x", "1.5GiB") == 3 * 2**29 and parse_bytes("x", "1.9") == 1
    assert parse_bytes("x", "16777216TiB") == 2**64
    for bad in ("16777217TiB", "9" * 500, "0.999", 0, True):
        with pytest.raises(ConfigError, match="^x="):
            parse_bytes("x", bad)


@pytest.mark.parametrize("flag, text, field", [
    ("--headroom", "nan", "headroom"), ("--headroom", "inf", "headroom"), ("--headroom", "-inf", "headroom"),
    ("--headroom", "-0.1", "headroom"), ("--headroom", "1", "headroom"), ("--headroom", "abc", "headroom"),
    ("--top", "0", "top"), ("--top", "-3", "top"), ("--top", "x", "top"),
    ("--devices", "0", "devices"), ("--devices", "-8", "devices"), ("--devices", "2.5", "devices"),
    ("--nodes", "0", "nodes"), ("--nodes", "-1", "nodes"), ("--nodes", "2.5", "nodes"),
    ("--bandwidth-intra", "0GB/s", "bandwidth-intra"), ("--bandwidth-intra", "-5GB/s", "bandwidth-intra"),
    ("--bandwidth-intra", "fast", "bandwidth-intra"), ("--bandwidth-intra", "1e400GB/s", "bandwidth-intra"),
    ("--bandwidth-intra", "0.5B/s", "bandwidth-intra"), ("--bandwidth-inter", "nan", "bandwidth-inter"),
    ("--bandwidth-inter", "inf", "bandwidth-inter"),
    ("--seq", "1", "seq"), ("--seq", "0", "seq"), ("--seq", "x", "seq"),
    ("--global-batch", "0", "global-batch"), ("--global-batch", "-5", "global-batch"),
    ("--global-batch", "1.5", "global-batch"),
    ("--precisions", "", "precisions"), ("--strategies", ",", "strategies"),
])
def test_plan_numeric_flags_are_range_checked_naming_the_flag(capsys, no_search, flag, text, field):
    base = _base_without(flag) if flag in BASE else BASE
    msg = _refused(capsys, [*base, f"{flag}={text}"], field)  # "=": argparse reads -inf as a value
    assert f"{field}={text!r}" in msg


def test_top_is_checked_before_the_plan_is_made(capsys, no_search):
    _refused(capsys, [*BASE, "--top", "0", "--model", "llama-70b"], "top")


# -- 3. model-config overrides -----------------------------------------------------------------------------------------
def _peak(capsys, *extra) -> int:
    return _json(capsys, [*BASE, *extra])["plans"][0]["peak_bytes_per_device"]


def test_plan_applies_every_model_config_override(capsys):
    assert shape_of("llama-7b", "num_hidden_layers=1").n_params < shape_of("llama-7b").n_params
    assert shape_of("gpt-tiny", "n_layer=1").n_params < shape_of("gpt-tiny").n_params
    assert _peak(capsys, "--model", "llama-7b", "--model-config", "num_hidden_layers=1") < \
        _peak(capsys, "--model", "llama-7b")
    assert _peak(capsys, "--model-config", "n_layer=1") < _peak(capsys)


@pytest.mark.hf
def test_llama_shape_applies_head_dim_biases_and_tied_embeddings():
    transformers = pytest.importorskip("transformers")
    conf = dict(vocab_size=64, num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=16)
    for extra in ({}, {"head_dim": 6}, {"attention_bias": True}, {"mlp_bias": True},
                  {"tie_word_embeddings": True}, {"head_dim": 12, "attention_bias": True, "mlp_bias": True,
                                                  "tie_word_embeddings": True}):
        with torch.device("meta"):
            params = list(transformers.LlamaForCausalLM(transformers.LlamaConfig(**conf, **extra)).parameters())
        spec = ",".join(f"{k}={str(v).lower()}" for k, v in {**conf, **extra}.items())
        shape = shape_of("hf:LlamaForCausalLM", spec)
        assert shape.n_params == sum(p.numel() for p in params), extra
        assert shape.n_tensors == len(params), extra


@pytest.mark.parametrize("model, override", [
    ("gpt-tiny", "n_heads=2"), ("gpt-tiny", "bogus=1"), ("gpt-small", "num_hidden_layers=1"),
    pytest.param("llama-7b", "bogus=1", marks=pytest.mark.hf),
    pytest.param("hf:LlamaForCausalLM", "hidden_sise=64", marks=pytest.mark.hf),
    pytest.param("llama-70b", "n_layer=1", marks=pytest.mark.hf),
])
def test_plan_refuses_unknown_model_config_keys_naming_them(capsys, no_search, model, override):
    if model.startswith(("hf:", "llama")):
        pytest.importorskip("transformers")
    key = override.split("=")[0]
    msg = _refused(capsys, [*BASE, "--model", model, "--model-config", override], f"model_config.{key}")
    assert "allowed: a field of" in msg


@pytest.mark.hf
def test_llama_keys_the_shape_does_not_model_are_accepted_and_named(capsys):
    pytest.importorskip("transformers")
    out = _json(capsys, [*BASE, "--model", "llama-7b", "--model-config", "rms_norm_eps=1e-5,hidden_act=gelu"])
    assert any("does not model" in n and "rms_norm_eps" in n and "hidden_act" in n for n in out["notes"])


@pytest.mark.parametrize("model, override, field", [
    ("gpt-tiny", "n_head=3", "model_config.n_head"),  # d_model=256 is not divisible by 3
    ("gpt-tiny", "n_layer=2.5", "model_config.n_layer"),
    ("gpt-tiny", "n_layer=-1", "model_config.n_layer"),
    ("gpt-tiny", "dropout=abc", "model_config.dropout"),
    ("gpt-tiny", "vocab_size=5", "model_config.vocab_size"),  # train's token rules need 11 ids
    ("gpt-tiny", "x", "model_config"),
    ("gpt-tiny", "=", "model_config"),
    ("llama-7b", "num_hidden_layers=2.5", "model_config.num_hidden_layers"),
    ("llama-7b", "num_hidden_layers=0", "model_config.num_hidden_layers"),
    ("llama-7b", "hidden_size=abc", "model_config.hidden_size"),
    ("llama-7b", "num_attention_heads=5", "model_config.num_attention_heads"),
    ("llama-7b", "num_key_value_heads=5", "model_config.num_key_value_heads"),
    ("llama-7b", "hidden_size=4064", "model_config.hidden_size"),  # 127 per head: RoPE needs an even width
    ("llama-7b", "vocab_size=5", "model_config.vocab_size"),
    ("llama-70b", "num_attention_heads=4", "model_config.num_attention_heads"),  # the preset's 8 KV heads: not 4
    ("hf:LlamaForCausalLM", "hidden_size=30,num_attention_heads=4", "model_config.num_attention_heads"),
    ("hf:LlamaForCausalLM", "tie_word_embeddings=maybe", "model_config.tie_word_embeddings"),
])
def test_plan_refuses_a_model_train_would_refuse_before_search(capsys, no_search, model, override, field):
    _refused(capsys, [*BASE, "--model", model, "--model-config", override], field)


def test_plan_refuses_a_bad_model_before_writing(capsys, tmp_path, no_search):
    target = tmp_path / "p.toml"
    msg = _refused(capsys, [*BASE, "--model-config", "n_head=3", "--write", str(target)], "model_config.n_head")
    assert "model_config.n_head=3" in msg and "d_model=256" in msg
    assert not target.exists()


def test_llama_positions_follow_seq_unless_set(capsys, tmp_path):
    planned = plan_model("hf:LlamaForCausalLM", "", seq_len=4096)  # LlamaConfig's default holds 2048 positions
    assert "max_position_embeddings=4096" in planned.model_config and not planned.check_task
    assert any("max_position_embeddings=4096 added" in n for n in planned.notes)
    # the presets carry their published context (Llama 2: 4096, Llama 3: 8192): nothing added
    assert plan_model("llama-70b", "", seq_len=4096).model_config.count("max_position_embeddings") == 1
    assert plan_model("llama-7b", "", seq_len=2048).model_config.count("max_position_embeddings") == 1
    _refused(capsys, [*BASE, "--model", "llama-7b", "--seq", "4096", "--model-config",
                      "max_position_embeddings=2048"], "seq")


def test_paper_scale_llama_plans_need_no_transformers(monkeypatch):
    def unavailable(spec):
        return None  # as where transformers is not installed

    planned = plan_model("llama-70b", "num_hidden_layers=2", seq_len=4096, config_keys=unavailable)
    assert planned.shape.n_layer == 2 and not planned.check_task
    with pytest.raises(ConfigError, match=r"^model_config\.rms_norm_eps=.*install it"):
        plan_model("llama-70b", "rms_norm_eps=1e-5", seq_len=64, config_keys=unavailable)
    shape = plan_model("llama-70b", "tie_word_embeddings=true", config_keys=unavailable).shape
    assert shape.tied_embeddings  # keys the shape models are checked here, without transformers


@pytest.mark.hf
def test_plan_refuses_unknown_keys_of_hf_models_without_a_shape(capsys, no_search):
    pytest.importorskip("transformers")
    _refused(capsys, [*BASE, "--model", "hf:BertForMaskedLM", "--model-config", "hidden_sise=32"],
             "model_config.hidden_sise")


@pytest.mark.hf
def test_hf_values_transformers_refuses_are_refused_naming_the_key(capsys, no_search):
    pytest.importorskip("transformers")
    _refused(capsys, [*BASE, "--model", "llama-7b", "--model-config", "rms_norm_eps=abc"], "model_config.rms_norm_eps")


@pytest.mark.hf
def test_an_hf_model_without_a_shape_that_cannot_be_built_is_refused_naming_the_key(capsys, tmp_path):
    """Without an analytic shape the basis comes from the estimator, which builds the model: a config
    transformers refuses only then (heads that do not divide) is still one line, and nothing is written."""
    pytest.importorskip("transformers")
    target = tmp_path / "p.toml"
    _refused(capsys, [*BASE, "--model", "hf:BertForMaskedLM", "--model-config", "hidden_size=30,num_attention_heads=4,"
                      "num_hidden_layers=1,intermediate_size=16", "--write", str(target)], "model_config.hidden_size")
    assert not target.exists()


def test_plan_refuses_an_unknown_model_before_search(capsys, no_search):
    _refused(capsys, [*BASE, "--model", "nonexistent"], "model")
    _refused(capsys, [*BASE, "--model", "cnn", "--model-config", "channels=0"], "model_config.channels")


# -- 4. outputs --------------------------------------------------------------------------------------------------------
def _plan_args(tmp_path, *extra):
    memory = [] if "--device-memory" in extra else ["--device-memory", "64MiB"]  # each flag once (issue 35, row 12)
    return ["plan", "--model-config", TINY, "--global-batch", "8", "--seq", "16", *memory, "--device", "cpu", *extra]


def test_write_refuses_an_existing_file_without_force_before_any_work(capsys, tmp_path, monkeypatch):
    target = tmp_path / "mine.toml"
    target.write_text("# mine\n")
    with monkeypatch.context() as m:
        m.setattr(plan_cmd, "search", lambda *a, **kw: pytest.fail("the search ran"))
        msg = _refused(capsys, _plan_args(tmp_path, "--write", str(target)), "write")
    assert "--force" in msg and target.read_text() == "# mine\n"
    assert main(_plan_args(tmp_path, "--write", str(target), "--force")) == 0
    capsys.readouterr()
    assert "micro_batch" in target.read_text()


@pytest.mark.parametrize("name, why", [("plan.txt", ".toml"), ("adir.toml", "directory"), ("afile/p.toml", "parent")])
def test_write_target_is_checked_before_any_work(capsys, tmp_path, no_search, name, why):
    (tmp_path / "adir.toml").mkdir()
    (tmp_path / "afile").write_text("x")
    msg = _refused(capsys, _plan_args(tmp_path, "--write", str(tmp_path / name)), "write")
    assert why in msg


def test_nothing_is_written_when_nothing_fits(capsys, tmp_path):
    target = tmp_path / "p.toml"
    assert main(_plan_args(tmp_path, "--device-memory", "1KiB", "--write", str(target), "--report",
                           "--run-dir", str(tmp_path / "run"))) == 2
    assert "nothing fits" in capsys.readouterr().err
    assert not target.exists() and not (tmp_path / "run").exists()


def test_report_refuses_a_run_dir_of_the_users_files_before_any_work(capsys, tmp_path, no_search):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes\n")
    _refused(capsys, _plan_args(tmp_path, "--report", "--run-dir", str(mine)), "run_dir")
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_report_claims_its_run_dir(capsys, tmp_path):
    run = tmp_path / "run"
    assert main(_plan_args(tmp_path, "--report", "--run-dir", str(run), "--json")) == 0
    json.loads(capsys.readouterr().out)
    assert (run / MARKER).is_file() and (run / "plan.json").is_file()


def test_json_output_is_strict_even_with_non_finite_numbers(capsys, tmp_path, monkeypatch):
    real = plan_cmd.search

    def search(*a, **kw):
        res = real(*a, **kw)
        res.entries[0] = type(res.entries[0])(**{**res.entries[0].to_dict(), "step_s": math.inf,
                                                 "scaling_efficiency": math.nan})
        return res

    monkeypatch.setattr(plan_cmd, "search", search)
    out = _json(capsys, _plan_args(tmp_path))
    assert out["plans"][0]["step_s"] is None and out["plans"][0]["scaling_efficiency"] is None
    assert "plans[0].step_s=inf" in out["non_finite"]
