"""Faults in the user's own code named as theirs (issue 35, row 9): ``verify --framework hf-trainer`` with a collator
that returns the wrong thing or raises, a Trainer whose ``compute_loss`` raises or returns a vector, rows of
``--data`` outside the vocabulary -- each is one line on stderr naming the object (``collator='mods:fn'``), exit 2,
from the command line; a ConfigError from the Python front door.

The class is generated (hypothesis): a collator that returns a good batch and then breaks it one way -- a field of
strings, floats or bools, a value outside ``[0, vocab)`` (or outside ``-100`` and ``[0, vocab)`` for labels), a
wrong shape, a missing field, no mapping at all, an exception. The reference for "good" is the model's own config
(``vocab_size``, ``num_labels``), read here.

Also here (row 14): ``verify --framework`` says each of its runs as it goes, not all at once at the end; ``--quiet``
says nothing.
"""

from __future__ import annotations

import importlib
import io
import json
import sys

import pytest
import torch
import transformers as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.reliability.cli_harness import cli
from tokenizers import Tokenizer, models, pre_tokenizers

from trainfit.errors import ConfigError
from trainfit.front.verify import verify_framework

THIS = "tests.integrations.test_verify_faults"
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "big", "small", "red", "fast"]
SPECIAL = ["[PAD]", "[UNK]"]
VOCAB = len(SPECIAL) + len(WORDS)
M, K = 2, 3
FAULT: dict = {}
"""How :func:`faulty` breaks the batch it returns (set by each test through :func:`_shared`)."""
SEEN: dict = {}
"""What :class:`WatchingTrainer` saw on stderr when its last run began."""


def _shared():
    """This file as ``--collator``/``--trainer`` import it (``tests.integrations...``): pytest imports it under
    another name, so the state the user's objects read is set on that module."""
    return importlib.import_module(THIS)


# ----------------------------------------------------------------- the user's faulty objects

def _good(features):
    ids = torch.tensor([features[0]["input_ids"]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def faulty(features):
    """A user's collator (``--collator tests...:faulty``): a good causal-LM batch of one row, broken as FAULT says."""
    kind, arg = FAULT.get("kind"), FAULT.get("arg")
    if kind == "raise":
        raise arg[0](arg[1])
    batch = _good(features)
    n = batch["input_ids"].shape[1]
    if kind == "not_mapping":
        return arg
    if kind == "missing":
        del batch[arg]
    elif kind == "strings":
        batch[arg] = [[str(arg) + "x"] * n]
    elif kind == "dtype":
        key, dtype = arg
        batch[key] = batch[key].to(dtype)
    elif kind == "value":
        key, value, at = arg
        batch[key][0, at % n] = value
    elif kind == "length":
        key, extra = arg
        batch[key] = torch.ones(1, max(n + extra, 1), dtype=torch.long) if n + extra != n else batch[key]
    elif kind == "rank":
        key = arg
        batch[key] = batch[key][None, None]
    return batch


class RaisingTrainer(tf.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        raise RuntimeError("my loss is broken")


class VectorTrainer(tf.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return outputs.logits.sum(-1).mean(0)  # one loss per position: a vector


class FloatTrainer(tf.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return float(model(**inputs).loss)


class DetachedTrainer(tf.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss.detach()


class WatchingTrainer(tf.Trainer):
    """The Trainer as it is; at its last run (1 x KM) it records what stderr holds already."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if inputs["input_ids"].shape[0] == M * K:
            SEEN["err"] = SEEN["stream"].getvalue()
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def broken_model(seq_len=8, seed=0):
    """A user's ``module:callable`` model for the other frameworks, whose forward raises."""
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x):
            raise ValueError("my forward is broken")

    return {"model": Broken(), "batch": lambda n: {"x": torch.randn(n, 4), "y": torch.randint(0, 3, (n,))},
            "loss": lambda m, b: (torch.nn.functional.cross_entropy(m(b["x"]), b["y"], reduction="sum"),
                                  len(b["y"]))}


# ----------------------------------------------------------------- the model

@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """A tiny GPT-2 with a word-level tokenizer.json beside it (a collator is given the model's tokenizer)."""
    _shared()  # imported once here, not inside a hypothesis example (its @given would nest)
    d = tmp_path_factory.mktemp("faults") / "gpt"
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)).save_pretrained(d)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(d)
    return str(d)


def _argv(path, *extra):
    return ["verify", "--framework", "hf-trainer", "--model", f"hf:{path}", "--seq-len", "12", "--micro-batch",
            str(M), "--accumulation", str(K), *extra]


def _one_line(r, *needles) -> str:
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and r.out == "" and len(lines) == 1, (r.rc, r.err)
    assert lines[0].startswith("trainfit: error: ") and "Traceback" not in r.err, r.err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ----------------------------------------------------------------- the class, generated

BAD_INT = st.one_of(st.integers(min_value=VOCAB, max_value=2**62), st.integers(min_value=-2**62, max_value=-1))
FAULTS = st.one_of(
    st.tuples(st.just("raise"), st.tuples(st.sampled_from([RuntimeError, ValueError, KeyError, TypeError,
                                                           ZeroDivisionError, IndexError]),
                                          st.text(max_size=40))),
    st.tuples(st.just("not_mapping"), st.sampled_from([None, [1, 2], "batch", 3.5, (torch.zeros(2),)])),
    st.tuples(st.just("missing"), st.sampled_from(["input_ids", "labels"])),
    st.tuples(st.just("strings"), st.sampled_from(["input_ids", "labels", "attention_mask"])),
    st.tuples(st.just("dtype"), st.tuples(st.sampled_from(["input_ids", "labels"]),
                                          st.sampled_from([torch.float32, torch.float16, torch.bool,
                                                           torch.complex64]))),
    st.tuples(st.just("value"), st.tuples(st.just("input_ids"), BAD_INT, st.integers(0, 20))),
    st.tuples(st.just("value"), st.tuples(st.just("labels"), BAD_INT.filter(lambda v: v != -100),
                                          st.integers(0, 20))),
    st.tuples(st.just("value"), st.tuples(st.just("attention_mask"), st.integers(2, 2**40), st.integers(0, 20))),
    st.tuples(st.just("length"), st.tuples(st.sampled_from(["labels", "attention_mask"]),
                                           st.integers(-20, 20).filter(bool))),
    st.tuples(st.just("rank"), st.sampled_from(["input_ids", "labels"])),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fault=FAULTS)
def test_any_faulty_collator_output_is_one_line_naming_the_collator(gpt, tmp_path, fault):
    _shared().FAULT.clear()
    _shared().FAULT.update(kind=fault[0], arg=fault[1])
    r = cli(_argv(gpt, "--collator", f"{THIS}:faulty"), cwd=tmp_path)
    line = _one_line(r, f"collator='{THIS}:faulty'", f"--collator {THIS}:faulty")
    if fault[0] == "raise":
        assert f"raised {fault[1][0].__name__}" in line
    else:
        assert "returned" in line and "for row 0" in line  # the first row already is wrong


@pytest.mark.parametrize("fault, said", [
    (("strings", "labels"), "returned labels of dtype str"),
    (("value", ("labels", 99999, 3)), "returned labels holding 99999"),
    (("value", ("labels", -5, 3)), "returned labels holding -5"),
    (("dtype", ("input_ids", torch.float32)), "returned input_ids of dtype torch.float32"),
])
def test_the_reported_collator_faults(gpt, tmp_path, fault, said):
    _shared().FAULT.clear()
    _shared().FAULT.update(kind=fault[0], arg=fault[1])
    _one_line(cli(_argv(gpt, "--collator", f"{THIS}:faulty"), cwd=tmp_path), f"--collator {THIS}:faulty {said}")
    with pytest.raises(ConfigError) as e:  # the front door: the same, as a ConfigError
        verify_framework(model=f"hf:{gpt}", seq_len=12, micro_batch=M, accumulation=K, framework="hf-trainer",
                         collator=f"{THIS}:faulty")
    assert e.value.field == "collator" and said in str(e.value)


@pytest.mark.parametrize("trainer, said", [
    ("RaisingTrainer", "RaisingTrainer.compute_loss raised RuntimeError: my loss is broken"),
    ("VectorTrainer", "VectorTrainer.compute_loss returned a tensor of shape (13,)"),  # the longest row: seq_len + 1
    ("FloatTrainer", "FloatTrainer.compute_loss returned a float"),
    ("DetachedTrainer", ("DetachedTrainer.compute_loss returned a tensor of shape (), dtype torch.float32, not "
                         "requiring grad")),
])
def test_a_faulty_trainer_is_one_line_naming_it(gpt, tmp_path, trainer, said):
    _one_line(cli(_argv(gpt, "--trainer", f"{THIS}:{trainer}"), cwd=tmp_path), f"trainer='{THIS}:{trainer}'",
              said)


def test_data_rows_outside_the_vocabulary_are_one_line_naming_the_file(tmp_path):
    d = tmp_path / "cls"
    torch.manual_seed(0)
    tf.BertForSequenceClassification(tf.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32,
                                                   max_position_embeddings=32, num_labels=2)).save_pretrained(d)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="[UNK]"))
    tok.save(str(d / "tokenizer.json"))
    data = tmp_path / "rows.jsonl"
    rows = [{"input_ids": [2, 3, 4][: 1 + i % 3] + ([99999] if i == 4 else []), "label": i % 2} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = cli(["verify", "--framework", "hf-trainer", "--model", f"hf:{d}", "--data", str(data), "--seq-len", "12",
             "--micro-batch", str(M), "--accumulation", str(K)], cwd=tmp_path)
    _one_line(r, f"data='{data}'", f"--data {data} holds input_ids holding 99999", f"[0, {VOCAB})")


@pytest.mark.parametrize("framework", ["accelerate", "lightning"])
def test_the_other_frameworks_name_a_faulty_model(tmp_path, framework):
    r = cli(["verify", "--framework", framework, "--model", f"{THIS}:broken_model", "--micro-batch", str(M),
             "--accumulation", str(K)], cwd=tmp_path)
    _one_line(r, f"model='{THIS}:broken_model'", "raised ValueError: my forward is broken")


# ----------------------------------------------------------------- progress as it goes (row 14)

def test_verify_framework_says_each_run_as_it_goes_and_quiet_says_nothing(gpt, tmp_path, monkeypatch):
    stream = io.StringIO()
    seen = _shared().SEEN
    seen.clear()
    seen["stream"] = stream
    monkeypatch.setattr(sys, "stderr", stream)
    from trainfit.cli import main

    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(_argv(gpt, "--trainer", f"{THIS}:WatchingTrainer", "--json")) == 0
    said_by_then = [ln for ln in seen["err"].splitlines() if ln.startswith("trainfit: verify --framework")]
    assert said_by_then == [f"trainfit: verify --framework hf-trainer: {line}" for line in (
        "reading the rows of generated data for a causal LM",
        f"one Trainer step at {M} x {K}",
        f"the plain-PyTorch reference, {M * K} rows one at a time",
        f"one Trainer step at {M * K} x 1")], seen["err"]  # all said while the last run is under way
    assert json.loads(out.getvalue())["framework"] == "hf-trainer"
    stream.truncate(0)
    stream.seek(0)
    assert main(["--quiet", *_argv(gpt, "--json")]) == 0
    assert stream.getvalue() == ""
