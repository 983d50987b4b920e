"""verify --framework hf-trainer on the user's own checkpoints (hf:DIR, save_pretrained here), heads beyond causal LM.

transformers 5.25's Trainer: a BERT head's forward takes ``**kwargs``, so the Trainer passes
``num_items_in_batch`` and skips its division by ``gradient_accumulation_steps`` -- but BERT's token- and
sequence-classification losses are a plain ``CrossEntropyLoss()`` mean that never reads it. The gradient at
K micro-batches is K x the mean of the micro-batch means: a real accumulation error. GPT-2's Trainer
accumulation is exact; its loss counts each row's first label (never predicted): a normalisation difference.

The references are written here in plain PyTorch: every row alone, unpadded, through the checkpoint's weights,
the per-target cross-entropy summed from the logits.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from tests.reliability.cli_harness import cli
from torch.nn import functional as F

from trainfit.config import RunConfig
from trainfit.integrations.frameworks import verify_framework
from trainfit.probes.verify import rel_error

BERT = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
M, K = 2, 3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, make in (("token", lambda: tf.BertForTokenClassification(tf.BertConfig(**BERT))),
                       ("sequence", lambda: tf.BertForSequenceClassification(tf.BertConfig(**BERT))),
                       ("gpt2", lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                                                          n_positions=64, bos_token_id=1,
                                                                          eos_token_id=1)))):
        torch.manual_seed(0)
        model = make()
        assert sum(p.numel() for p in model.parameters()) < 10_000  # tiny
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def _cfg(path: str) -> RunConfig:
    return RunConfig(model=f"hf:{path}", seq_len=24, micro_batch=M, accumulation=K)


def _rows(cfg: RunConfig):
    from trainfit.integrations.hf_window import hf_model, hf_rows  # the rows the tool ran (data, not math)

    return hf_rows(cfg, hf_model(cfg.section("model"), cfg.section("run"))).groups


def _hand(path: str, groups, *, shift: bool, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-mean gradient, mean-of-micro-batch-means gradient), each row alone through the saved weights."""
    arch = json.loads(open(f"{path}/config.json").read())["architectures"][0]
    model = getattr(tf, arch).from_pretrained(path)
    model.train()

    def loss_and_count(r):
        logits = model(input_ids=r["input_ids"][None]).logits[0]
        if per_row:
            return F.cross_entropy(logits[None], r["labels"][None], reduction="sum"), 1
        logits, labels = (logits[:-1], r["labels"][1:]) if shift else (logits, r["labels"])
        return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"), int((labels != -100).sum())

    counts = [sum(loss_and_count(r)[1] for r in g) for g in groups]
    out = []
    for mean_of_means in (False, True):
        model.zero_grad()
        for g, n in zip(groups, counts):
            for r in g:
                loss, _ = loss_and_count(r)
                (loss / n / len(groups) if mean_of_means else loss / sum(counts)).backward()
        out.append(torch.cat([p.grad.reshape(-1).double() for p in model.parameters()]))
    return out[0], out[1]


def test_bert_token_classification_accumulation_error_is_k_times_the_mean_of_means(ckpts):
    cfg = _cfg(ckpts["token"])
    r = verify_framework(cfg, framework="hf-trainer")
    groups = _rows(cfg)
    ref, mom = _hand(ckpts["token"], groups, shift=False, per_row=False)
    assert len(set(r.loss_tokens)) == K  # unequal targets per micro-batch
    expected = rel_error(K * mom, ref)  # the Trainer's K x M gradient is K x the mean of means; 1 x KM is exact
    assert expected > 1.0
    assert not r.passed and r.accumulation_error.found
    assert abs(r.accumulation_error.rel_error - expected) < 1e-4 * expected
    assert abs(r.accumulation_error.norm_ratio - float((K * mom).norm() / ref.norm())) < 1e-4
    assert r.normalisation.rel_error < 1e-5 and not r.normalisation.found  # its 1 x KM loss is the token mean
    assert "never reads num_items_in_batch" in r.accumulation_error.cause
    assert "compute_loss_func" in r.accumulation_error.fix and "accepts_loss_kwargs" in r.accumulation_error.fix


def test_bert_sequence_classification_gradient_is_k_times_too_large(ckpts):
    cfg = _cfg(ckpts["sequence"])
    r = verify_framework(cfg, framework="hf-trainer")
    ref, _ = _hand(ckpts["sequence"], _rows(cfg), shift=False, per_row=True)
    assert r.loss_tokens == (M,) * K and r.head.startswith("sequence classification")
    assert not r.passed and abs(r.accumulation_error.norm_ratio - K) < 1e-4  # equal counts: exactly K x
    assert abs(r.accumulation_error.rel_error - (K - 1)) < 1e-4
    assert r.normalisation.rel_error < 1e-5
    assert ref.norm() > 0


def test_gpt2_is_a_normalisation_difference_not_a_failure(ckpts):
    cfg = _cfg(ckpts["gpt2"])
    r = verify_framework(cfg, framework="hf-trainer")
    assert r.passed  # before: FAIL, the Trainer's count of each row's first label taken for an accumulation error
    groups = _rows(cfg)
    ref, _ = _hand(ckpts["gpt2"], groups, shift=True, per_row=False)
    targets = sum(int((row["labels"][1:] != -100).sum()) for g in groups for row in g)
    labels = sum(int((row["labels"] != -100).sum()) for g in groups for row in g)
    assert labels > targets  # the first label of each row
    assert r.passed and not r.accumulation_error.found and r.accumulation_error.rel_error < 1e-5
    assert r.normalisation.found
    assert abs(r.normalisation.norm_ratio - targets / labels) < 1e-5  # counted from the rows, by hand
    assert abs(r.normalisation.rel_error - (1 - targets / labels)) < 1e-5  # a pure scale of the token mean
    assert f"num_items_in_batch is {labels}" in r.normalisation.cause and "loss_type" in r.normalisation.fix
    assert ref.norm() > 0


def test_cli_reads_training_arguments_and_exits_1_only_for_accumulation(ckpts, tmp_path):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": "out", "per_device_train_batch_size": M,
                                "gradient_accumulation_steps": K, "bf16": False, "max_grad_norm": 1.0,
                                "learning_rate": 5e-5}))
    r = cli(["verify", "--framework", "hf-trainer", "--model", f"hf:{ckpts['token']}", "--seq-len", "24",
             "--from", str(args), "--json"], cwd=tmp_path)
    d = json.loads(r.out)
    assert r.rc == 1 and d["micro_batch"] == M and d["accumulation"] == K, r.err
    assert d["accumulation_error"]["found"] and not d["passed"]
    assert any("gradient_accumulation_steps" in s for s in d["settings"])
    assert any("max_grad_norm=0.0 (file: 1.0)" in s for s in d["settings"])  # what the check replaced, said
    r = cli(["verify", "--framework", "hf-trainer", "--model", f"hf:{ckpts['gpt2']}", "--seq-len", "24",
             "--from", str(args)], cwd=tmp_path)
    assert r.rc == 0 and "normalisation diff." in r.out and "PASS" in r.out, r.err
