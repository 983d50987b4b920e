"""Each row of issue 17's table as a named regression test (the inputs that broke the bad-input promise).

Every test runs the CLI in this process and checks the whole promise (``cli_harness.check_promise``):
exit 0 or 2, no traceback, stdout empty or one strict JSON object, nothing of the user's changed,
nothing left behind by a refused command -- plus the row's own expectation.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import tomllib

import pytest
import torch

from trainfit.config import RunConfig, dump_toml, make_config
from trainfit.outputs import MARKER, dumps_json

from .cli_harness import check_promise, cli, error_lines, snapshot

TINY = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16", "--micro-batch", "2", "--accumulation", "2"]
TINY_TOML = 'model_config = "n_layer=1,d_model=32,n_head=2"\nseq_len = 16\nmicro_batch = 2\naccumulation = 2\n'


def _run(tmp_path, args):
    before = snapshot(tmp_path)
    r = cli(args, cwd=tmp_path)
    check_promise(r, tmp_path, before, json_mode="--json" in args)
    return r


def _error(r) -> str:
    lines = [ln for ln in error_lines(r.err) if ln.startswith("trainfit: error:")]
    assert r.rc == 2 and len(lines) == 1, r.err
    return lines[0]


def _trained(tmp_path, name="r", steps=2):
    r = cli(["train", *TINY, "--steps", str(steps), "--run-dir", name, "--checkpoint-every", "1"], cwd=tmp_path)
    assert r.rc == 0, r.err
    return tmp_path / name


# -- data loss ---------------------------------------------------------------------------------------------
def test_train_refuses_a_project_directory_of_the_users_own_files(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "config.toml").write_text("# my notes\n" + TINY_TOML + "steps = 1\n")
    (proj / "metrics.jsonl").write_text('{"mine": 1}\n')
    msg = _error(_run(tmp_path, ["train", "proj/config.toml", "--run-dir", "proj"]))
    assert "run_dir='proj'" in msg and MARKER in msg
    assert (proj / "config.toml").read_text().startswith("# my notes")


def test_an_owned_run_directory_is_reused_and_resumed(tmp_path):
    run = _trained(tmp_path)
    assert (run / MARKER).is_file()
    r = _run(tmp_path, ["train", *TINY, "--steps", "3", "--run-dir", "r", "--resume", "--json"])
    assert r.rc == 0 and json.loads(r.out)["steps"] == 3


@pytest.mark.parametrize("command", [
    ["plan", "--global-batch", "8", "--device-memory", "80GiB", "--write", "mine.toml"],
    ["report", "rr", "--out", "mine.toml"],
])
def test_an_existing_output_file_is_not_replaced_without_force(tmp_path, command):
    (tmp_path / "rr").mkdir()
    (tmp_path / "rr" / MARKER).write_text("")
    (tmp_path / "rr" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "loss_scale": 1.0}\n')
    (tmp_path / "mine.toml").write_text("# mine\n")
    msg = _error(_run(tmp_path, command))
    assert "mine.toml" in msg and "--force" in msg
    assert (tmp_path / "mine.toml").read_text() == "# mine\n"
    r = cli([*command, "--force"], cwd=tmp_path)
    assert r.rc == 0, r.err
    assert (tmp_path / "mine.toml").read_text() != "# mine\n"


# -- wrong place ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("run_dir", ["bs\\tdir", 'quote"dir', "sp ace's", "uni-ø"])
def test_config_toml_round_trips_any_run_dir_text(run_dir):
    cfg = make_config({"run_dir": run_dir, "model_config": 'a="b",c=\\d'})
    back = make_config(tomllib.loads(dump_toml(cfg)))
    assert back == cfg


@pytest.mark.distributed
def test_ddp_launch_writes_launch_toml_and_checkpoints_in_the_directory_asked_for(tmp_path):
    r = cli(["train", *TINY, "--steps", "1", "--strategy", "ddp", "--nproc", "2", "--run-dir", 'bs\\t"dir',
             "--json"], cwd=tmp_path)
    assert r.rc == 0, r.err
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == ['bs\\t"dir'], made
    d = tmp_path / 'bs\\t"dir'
    assert (d / "launch.toml").is_file() and (d / "config.toml").is_file() and any((d / "checkpoints").iterdir())
    assert tomllib.loads((d / "config.toml").read_text())["run"]["run_dir"] == 'bs\\t"dir'


@pytest.mark.parametrize("bad", ["tab\there", "new\nline", "bell\x07"])
def test_control_characters_in_a_run_dir_are_refused(tmp_path, bad):
    msg = _error(_run(tmp_path, ["train", *TINY, "--steps", "1", "--run-dir", bad]))
    assert "run_dir=" in msg and "control characters" in msg


# -- wrong result ----------------------------------------------------------------------------------------------
def test_resume_with_steps_at_or_below_the_checkpoint_is_refused_and_json_stays_valid(tmp_path):
    _trained(tmp_path, steps=2)
    r = _run(tmp_path, ["train", *TINY, "--steps", "1", "--resume", "--json", "--run-dir", "r"])
    assert "steps=1" in _error(r) and "step 2" in r.err
    assert r.out == ""


def test_json_never_holds_nan():
    text = dumps_json({"final_loss": float("nan"), "x": [1.0, float("inf")]})
    obj = json.loads(text, parse_constant=lambda t: pytest.fail(f"token {t}"))
    assert obj["final_loss"] is None and obj["x"] == [1.0, None]
    assert obj["non_finite"] == ["final_loss=nan", "x[1]=inf"]


@pytest.mark.parametrize("key, value", [("dataset_size", 16), ("seq_len", 8), ("model_config",
                                                                            "n_layer=2,d_model=32,n_head=2")])
def test_resume_refuses_other_data_or_model_on_the_one_file_path(tmp_path, key, value):
    _trained(tmp_path, steps=2)
    values = tomllib.loads(TINY_TOML) | {key: value, "steps": 3, "run_dir": "r"}
    (tmp_path / "c.toml").write_text(dump_toml(make_config(values)))
    msg = _error(_run(tmp_path, ["train", "c.toml", "--resume"]))
    assert key in msg


# -- ignored / invalid plan ----------------------------------------------------------------------------------------------
def _plan(tmp_path, *extra):
    base = ["--global-batch", "64", "--device-memory", "80GiB", "--devices", "8"]
    base = [a for i, a in enumerate(base) if base[i - i % 2] not in extra]  # each flag once (issue 35, row 12)
    r = _run(tmp_path, ["plan", *base, "--json", *extra])
    return r


def test_plan_applies_preset_overrides(tmp_path):
    full = json.loads(_plan(tmp_path, "--model", "llama-7b").out)
    one = json.loads(_plan(tmp_path, "--model", "llama-7b", "--model-config", "num_hidden_layers=1").out)
    assert one["plans"][0]["peak_bytes_per_device"] < full["plans"][0]["peak_bytes_per_device"]


@pytest.mark.parametrize("model, override", [("llama-7b", "bogus=1"), ("hf:LlamaForCausalLM", "hidden_sise=64"),
                                             ("gpt-tiny", "n_heads=2")])
def test_plan_refuses_unknown_model_config_keys(tmp_path, model, override):
    msg = _error(_plan(tmp_path, "--model", model, "--model-config", override))
    assert "model_config" in msg and override.split("=")[0] in msg


def test_plan_refuses_a_model_train_would_refuse_and_writes_nothing(tmp_path):
    msg = _error(_plan(tmp_path, "--model-config", "n_head=3", "--write", "p.toml"))
    assert "model_config.n_head=3" in msg
    assert not (tmp_path / "p.toml").exists()


# -- overridden / silently off ----------------------------------------------------------------------------------------------
def test_verify_refuses_an_accumulation_the_global_batch_would_change(tmp_path):
    msg = _error(_run(tmp_path, ["verify", "--global-batch", "16", "--micro-batch", "8", "--accumulation", "4",
                                 "--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16"]))
    assert "accumulation=4" in msg and "= 2" in msg


@pytest.mark.parametrize("flags, field", [
    (["--memory-cap", "0.5B"], "memory_cap"),
    (["--nproc", "0"], "devices"),
    (["--devices", "0"], "devices"),
    (["--max-restarts", "-5"], "max_restarts"),
    (["--seed", str(2**64)], "seed"),
    (["--seed", "-1"], "seed"),
])
def test_numeric_flags_are_range_checked(tmp_path, flags, field):
    msg = _error(_run(tmp_path, ["train", *TINY, "--steps", "1", "--run-dir", "r", *flags]))
    assert f"{field}=" in msg


# -- hang ------------------------------------------------------------------------------------------------------------------------
def test_plan_answers_fast_for_a_huge_global_batch(tmp_path):
    t0 = time.perf_counter()
    r = _plan(tmp_path, "--global-batch", str(10**18))
    assert r.rc in (0, 2)
    assert time.perf_counter() - t0 < 10  # < 2 s idle; generous on a loaded 2-core machine


# -- traceback: model configs --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, override, field", [
    ("gpt-tiny", "dropout=abc", "model_config.dropout"),
    ("cnn", "channels=0", "model_config.channels"),
    ("cnn", "n_classes=0", "model_config.n_classes"),
    ("gpt-tiny", "vocab_size=5", "model_config.vocab_size"),
    ("hf:BertForSequenceClassification", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,"
                                         "intermediate_size=64,num_labels=0", "model_config.num_labels"),
    ("hf:LlamaForCausalLM", "hidden_size=30,num_attention_heads=4,num_hidden_layers=1,intermediate_size=64",
     "model_config"),
    ("hf:LlamaForCausalLM", "hidden_size=32,num_attention_heads=2,num_hidden_layers=2.5,intermediate_size=64",
     "model_config.num_hidden_layers"),
])
def test_model_configs_that_cannot_be_built_are_one_line(tmp_path, model, override, field):
    msg = _error(_run(tmp_path, ["train", "--model", model, "--model-config", override, "--steps", "1", "--seq",
                                 "16", "--micro-batch", "2", "--accumulation", "1", "--run-dir", "r"]))
    assert field in msg


def test_an_hf_json_config_that_is_a_list_is_one_line(tmp_path):
    (tmp_path / "c.json").write_text("[1, 2]")
    msg = _error(_run(tmp_path, ["memory", "--model", "hf:LlamaForCausalLM", "--model-config", "c.json"]))
    assert "c.json" in msg


# -- traceback: checkpoints -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["drop-rng", "drop-model", "drop-data", "extra-key"])
def test_a_checkpoint_with_missing_or_extra_keys_is_named(tmp_path, damage):
    run = _trained(tmp_path, steps=2)
    path = run / "checkpoints" / "step-00000002.pt"
    state = torch.load(path, weights_only=True)
    if damage == "extra-key":
        state["surprise"] = torch.zeros(1)
    else:
        del state[damage.removeprefix("drop-")]
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path.write_bytes(data)
    path.with_suffix(".json").write_text(json.dumps({"format": state["format"], "step": 2, "bytes": len(data),
                                                     "sha256": hashlib.sha256(data).hexdigest()}))
    r = _run(tmp_path, ["train", *TINY, "--steps", "3", "--resume", "--run-dir", "r"])
    if damage == "extra-key":
        assert r.rc == 0, r.err  # extra keys are ignored
    else:
        assert damage.removeprefix("drop-") in _error(r)


def test_a_truncated_only_checkpoint_is_one_line_without_a_warning(tmp_path):
    run = _trained(tmp_path, steps=1)
    path = run / "checkpoints" / "step-00000001.pt"
    path.write_bytes(path.read_bytes()[:200])
    r = _run(tmp_path, ["train", *TINY, "--steps", "3", "--resume", "--run-dir", "r"])
    assert "truncated" in _error(r)
    assert "Warning" not in r.err and "warnings.warn" not in r.err


# -- traceback: report inputs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, text", [
    ("metrics.jsonl", '{"step": 1, "loss": 2.0, "loss_scale": "abc"}\n'),
    ("metrics.jsonl", '{"step": 1, "loss": 1e400, "loss_scale": 1}\n'),
    ("memory.json", '{"parts": "many", "peak_bytes": "x"}'),
    ("profile.json", '{"parts": [1, 2], "step_s": {"a": 1}}'),
])
def test_report_skips_malformed_files_with_a_note(tmp_path, name, text):
    (tmp_path / "rr").mkdir()
    (tmp_path / "rr" / name).write_text(text)
    r = _run(tmp_path, ["report", "rr", "--out", "page.html"])
    assert r.rc == 0, r.err
    assert name in (tmp_path / "page.html").read_text()


# -- unclear -------------------------------------------------------------------------------------------------------------
def test_a_run_dir_that_is_a_file_names_the_field(tmp_path):
    (tmp_path / "afile").write_text("mine")
    msg = _error(_run(tmp_path, ["train", *TINY, "--steps", "1", "--run-dir", "afile"]))
    assert "run_dir='afile'" in msg and "is a file" in msg and "checkpoints" not in msg


def test_report_out_a_directory_is_refused_without_a_stray_temp_file(tmp_path):
    (tmp_path / "rr").mkdir()
    (tmp_path / "rr" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "loss_scale": 1.0}\n')
    (tmp_path / "outdir").mkdir()
    msg = _error(_run(tmp_path, ["report", "rr", "--out", "outdir"]))
    assert "outdir" in msg
    assert list((tmp_path / "outdir").iterdir()) == []
    assert [p.name for p in (tmp_path / "rr").iterdir()] == ["metrics.jsonl"]


@pytest.mark.parametrize("flag, make", [("--plot", "dir"), ("--trace", "file")])
def test_profile_output_paths_are_checked_before_profiling(tmp_path, flag, make):
    target = tmp_path / ("x.png" if flag == "--plot" else "trace")
    target.mkdir() if make == "dir" else target.write_text("mine")
    t0 = time.perf_counter()
    msg = _error(_run(tmp_path, ["profile", *TINY, "--steps", "50", flag, target.name]))
    assert flag in msg and target.name in msg
    assert time.perf_counter() - t0 < 5  # refused before 50 profiled steps ran


def test_device_memory_below_one_byte_names_the_flag(tmp_path):
    msg = _error(_run(tmp_path, ["plan", "--global-batch", "8", "--device-memory", "0.5"]))
    assert "device-memory='0.5'" in msg and "memory-bytes" not in msg


# -- noise ---------------------------------------------------------------------------------------------------------------
def test_a_run_refused_after_validation_leaves_no_directory(tmp_path):
    r = _run(tmp_path, ["train", *TINY, "--steps", "1", "--run-dir", "r", "--memory-cap", "1KiB"])
    assert r.rc == 2
    assert not (tmp_path / "r").exists()


def test_defaults_still_construct():
    assert RunConfig().run_dir == "runs/default"
