"""An ``hf:DIR`` whose config.json does not match its weights is refused in one line before a model is built
(issue 35, rows 11 and 12, the model part): a config saying 100,000 layers over weights for 2 is refused in
well under a second with little memory, and ``plan`` refuses exactly what ``train`` refuses (one check, asked by
both). The reference is transformers' own loading: ``from_pretrained(..., output_loading_info=True)`` reports a
missing, mismatched or unexpected tensor exactly where trainfit refuses.
"""

from __future__ import annotations

import json
import shutil
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.reliability.cli_harness import check_promise, cli, error_lines, snapshot

from trainfit.errors import ConfigError

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf

from trainfit.tasks.make import make_task  # noqa: E402

LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)
PLAN = ["--device", "cpu", "--device-memory", "1GiB", "--seq-len", "8", "--global-batch", "2", "--precisions", "fp32",
        "--checkpointings", "none", "--strategies", "single", "--top", "1", "--json"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A 2-layer Llama saved by save_pretrained (config.json + model.safetensors), random weights."""
    import torch

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("pretrained") / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(d)
    return d


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFIT_CACHE_DIR", str(tmp_path / "cache"))  # plan's basis cache: this test's own


def edited(src, dst, **changes):
    """A copy of ``src`` whose config.json has ``changes`` (the weights untouched)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def transformers_refuses(d) -> bool:
    """transformers' own verdict: loading ``d`` reports a missing, mismatched or unexpected tensor, or fails
    (train's loader refuses both)."""
    try:
        _, info = transformers.LlamaForCausalLM.from_pretrained(d, output_loading_info=True,
                                                                ignore_mismatched_sizes=True)
    except Exception:  # e.g. tying embeddings of two shapes: transformers' own error
        return True
    return any(info.get(k) for k in ("missing_keys", "mismatched_keys", "unexpected_keys"))


def refusal(d) -> str:
    """trainfit's refusal of ``hf:d`` as a task (what train and plan build), or "" when it is accepted."""
    try:
        make_task("hf:" + str(d), seq_len=8)
    except ConfigError as e:
        return str(e)
    return ""


def test_a_config_of_100000_layers_over_weights_for_2_is_refused_at_once(llama_dir, tmp_path):
    d = edited(llama_dir, tmp_path / "deep", num_hidden_layers=100_000)
    before = snapshot(tmp_path)
    for command in (["train", "--steps", "1", "--seq-len", "8", "--run-dir", str(tmp_path / "run")],
                    ["plan", *PLAN]):
        cli([command[0], "--model", f"hf:{d}", *command[1:]])  # imports the command's modules: not timed
        tracemalloc.start()
        start = time.perf_counter()
        r = cli([command[0], "--model", f"hf:{d}", *command[1:]])
        took, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
        tracemalloc.stop()
        check_promise(r, tmp_path, before)
        assert r.rc == 2, r.err[-2000:]
        line = error_lines(r.err)[0]
        assert "num_hidden_layers=100,000" in line and "2 block(s)" in line, line
        assert took < 2 and peak < 50 * 2**20, (command[0], took, peak)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(depth=st.one_of(st.integers(3, 10**6), st.integers(10**6, 2**63 - 1)))
def test_any_depth_above_the_weights_is_refused_in_bounded_time_and_memory(llama_dir, tmp_path_factory, depth):
    """The class of row 11: whatever depth config.json claims above the 2 layers the weights hold, the refusal
    comes from the headers alone -- in well under a second, with a few megabytes -- and names both numbers."""
    d = edited(llama_dir, tmp_path_factory.mktemp("deep") / "m", num_hidden_layers=depth)
    tracemalloc.start()
    start = time.perf_counter()
    said = refusal(d)
    took, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert f"num_hidden_layers={depth:,}" in said and "2 block(s)" in said, said
    assert took < 1 and peak < 20 * 2**20, (took, peak)


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(
    st.sampled_from(["num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_key_value_heads",
                     "tie_word_embeddings"]),
    st.integers(1, 4), max_size=3))
def test_refused_exactly_where_transformers_loading_reports_a_mismatch(llama_dir, tmp_path_factory, changes):
    """Any edit of config.json's shape keys: trainfit refuses iff transformers' loading reports a tensor missing,
    of another shape or left over (the class of config/weights mismatches, not one instance)."""
    values = {"num_hidden_layers": lambda n: n, "hidden_size": lambda n: 8 * n, "intermediate_size": lambda n: 16 * n,
              "vocab_size": lambda n: 32 * n, "num_key_value_heads": lambda n: 1 + n % 2,
              "tie_word_embeddings": lambda n: n % 2 == 0}
    d = edited(llama_dir, tmp_path_factory.mktemp("edit") / "m", **{k: values[k](n) for k, n in changes.items()})
    said = refusal(d)
    assert bool(said) == transformers_refuses(d), (changes, said)
    if said:
        assert "\n" not in said and "weights matching config.json" in said, said


def test_a_base_model_checkpoint_under_a_head_class_is_refused_as_transformers_reports(tmp_path):
    """LlamaModel's weights (no lm_head) named as LlamaForCausalLM: the head is missing; transformers agrees."""
    d = tmp_path / "base"
    transformers.LlamaModel(transformers.LlamaConfig(**LLAMA)).save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    assert transformers_refuses(d)
    assert "lack lm_head.weight" in refusal(d)


@pytest.mark.parametrize("family", ["gpt2", "bert", "t5", "mixtral", "qwen2"])
def test_a_saved_model_of_each_family_is_accepted(family, tmp_path):
    """No false refusal: a model saved by save_pretrained, untouched, passes the check (tied embeddings, a
    sequence-to-sequence pair of stacks, experts, a family with a conversion mapping)."""
    tf = transformers
    made = {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2,
                                                         n_positions=64, bos_token_id=0, eos_token_id=0)),
        "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                                         num_attention_heads=2, intermediate_size=32)),
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32,
                                                                num_layers=2, num_decoder_layers=3, num_heads=2)),
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=True)),
    }
    made[family]().save_pretrained(tmp_path / family)
    assert refusal(tmp_path / family) == ""


def test_plan_refuses_what_train_refuses(llama_dir, tmp_path):
    """Weights that do not match config.json (hidden_size edited): train, plan and verify --framework all exit 2
    with one line, the same one; before, plan built the model on the meta device from config.json alone and planned
    it, and verify --framework checked only that weight files existed."""
    d = edited(llama_dir, tmp_path / "wide", hidden_size=32)
    before = snapshot(tmp_path)
    lines = []
    for command in (["train", "--steps", "1", "--seq-len", "8", "--run-dir", str(tmp_path / "run")], ["plan", *PLAN],
                    ["verify", "--framework", "hf-trainer", "--seq-len", "8", "--micro-batch", "2"]):
        r = cli([command[0], "--model", f"hf:{d}", *command[1:]])
        check_promise(r, tmp_path, before)
        assert r.rc == 2, (command[0], r.err[-2000:])
        lines.append(error_lines(r.err)[0])
    assert lines[0] == lines[1] == lines[2] and "model.embed_tokens.weight is (64, 16) in the weights" in lines[0], lines


def test_a_config_json_past_the_gate_is_refused_in_one_line(llama_dir, tmp_path):
    """config.json is read through the bounded reader: nested 10,000 deep, it is refused naming the file."""
    d = tmp_path / "nested"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg)[:-1] + ', "x": ' + "[" * 10_000 + "]" * 10_000 + "}")
    before = snapshot(tmp_path)
    r = cli(["train", "--model", f"hf:{d}", "--steps", "1", "--seq-len", "8", "--run-dir", str(tmp_path / "run")])
    check_promise(r, tmp_path, before)
    assert r.rc == 2 and "config.json" in error_lines(r.err)[0], r.err[-2000:]
