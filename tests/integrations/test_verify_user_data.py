"""verify --framework hf-trainer on the user's own setup: their checkpoint and tokenizer (hf:DIR), their rows
(``--data`` CSV / JSON Lines with text and labels), their collator (``--collator``) and their Trainer subclass
(``--trainer``), for heads other than causal LM.

Every expectation is computed here by hand, in plain PyTorch: the file read with ``csv``/``json``, the text
tokenized by the ``tokenizers`` library from the directory's tokenizer.json, each row alone through the
checkpoint's weights, the per-target cross-entropy summed from the logits. The masked LM's masks are replayed
with transformers' own ``DataCollatorForLanguageModeling``, each row alone under the documented seed
(``hf_window.row_seed``: the run's seed + the row's index), so the reference sees the masks the Trainer saw.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from torch.nn import functional as F

from tests.reliability.cli_harness import cli
from trainfit.config import RunConfig
from trainfit.errors import ConfigError
from trainfit.integrations.frameworks import verify_framework
from trainfit.probes.verify import rel_error

WORDS = "the a cat dog sat ran on mat big small red fast slow house tree bird sun blue".split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT = dict(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=64, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=0)
M, K, SEED = 2, 3, 0
THIS = "tests.integrations.test_verify_user_data"
WORD_COUNTS = (9, 7, 6, 4, 3, 2)  # distinct: the micro-batches' target counts are unambiguous


# ----------------------------------------------------------------- the user's Trainer subclasses

def _ce(outputs, labels, smoothing: float = 0.0) -> torch.Tensor:
    logits = outputs.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum", label_smoothing=smoothing)


class SumOverItemsTrainer(tf.Trainer):
    """The fix: the loss sum over the window's count the Trainer passes."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = _ce(outputs, labels) / num_items_in_batch
        return (loss, outputs) if return_outputs else loss


class OwnMeanTrainer(tf.Trainer):
    """The planted bug: each micro-batch divided by its own target count (the Trainer does not divide by K)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = _ce(outputs, labels) / (labels != -100).sum()
        return (loss, outputs) if return_outputs else loss


class SmoothedTrainer(tf.Trainer):
    """Exact accumulation, another loss by design: label smoothing 0.1 over num_items_in_batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = _ce(outputs, labels, 0.1) / num_items_in_batch
        return (loss, outputs) if return_outputs else loss


def mlm_collator(tokenizer):
    """A user's collator factory (``--collator module:mlm_collator``): its own seeded generator, 30% masked."""
    return tf.DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=True, mlm_probability=0.3, seed=11)


# ----------------------------------------------------------------- checkpoints, tokenizer, files

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                      sep_token="[SEP]", mask_token="[MASK]")
    out = {}
    for name, cls in (("sequence", tf.BertForSequenceClassification), ("token", tf.BertForTokenClassification),
                      ("masked", tf.BertForMaskedLM)):
        torch.manual_seed(0)
        model = cls(tf.BertConfig(**BERT))
        assert sum(p.numel() for p in model.parameters()) < 20_000  # tiny
        model.save_pretrained(root / name)
        fast.save_pretrained(root / name)
        out[name] = str(root / name)
    g = torch.Generator().manual_seed(1)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g)) for n in WORD_COUNTS]
    with open(root / "reviews.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i, t in enumerate(texts):
            w.writerow([t, (i * 2 + 1) % 3])
    with open(root / "ner.jsonl", "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": t, "labels": [(i + j) % 3 for j in range(len(t.split()))]}) + "\n")
    with open(root / "sentences.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    with open(root / "no_label.csv", "w") as f:
        f.write("text,score\n" + "".join(f"{t},1\n" for t in texts))
    out["root"] = root
    return out


def _cfg(path: str, data, **kw) -> RunConfig:
    return RunConfig(model=f"hf:{path}", data=str(data), seq_len=24, micro_batch=M, accumulation=K, seed=SEED, **kw)


# ----------------------------------------------------------------- the hand-made references

def _model(path: str):
    arch = json.loads(open(f"{path}/config.json").read())["architectures"][0]
    model = getattr(tf, arch).from_pretrained(path)
    model.train()
    return model


def _hand(path: str, rows: list[tuple[list[int], torch.Tensor]], *, smoothing: float = 0.0):
    """Rows (ids, labels) in file order -> (token-mean gradient, mean-of-micro-batch-means gradient, the
    micro-batches' target counts), the rows sorted by targets (longest first, ties in file order) and cut in K."""
    model = _model(path)

    def loss_and_count(ids, labels):
        logits = model(input_ids=torch.tensor([ids])).logits[0]
        if labels.dim() == 0:
            logits, labels = logits[None], labels[None]
        return (F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum", label_smoothing=smoothing),
                int((labels != -100).sum()))

    order = sorted(rows, key=lambda r: -int((r[1].reshape(-1) != -100).sum()))
    groups = [order[i * M:(i + 1) * M] for i in range(K)]
    counts = [sum(int((lab.reshape(-1) != -100).sum()) for _, lab in g) for g in groups]
    grads = []
    for mean_of_means in (False, True):
        model.zero_grad()
        for g, n in zip(groups, counts):
            for ids, lab in g:
                loss, _ = loss_and_count(ids, lab)
                (loss / n / K if mean_of_means else loss / sum(counts)).backward()
        grads.append(torch.cat([p.grad.reshape(-1).double() for p in model.parameters()]))
    return grads[0], grads[1], counts


def _tokenizer(path: str) -> Tokenizer:
    return Tokenizer.from_file(f"{path}/tokenizer.json")


def _sequence_rows(path: str, csv_path) -> list[tuple[list[int], torch.Tensor]]:
    tok = _tokenizer(path)
    with open(csv_path, newline="") as f:
        return [(tok.encode(r["text"]).ids, torch.tensor(int(r["label"]))) for r in csv.DictReader(f)]


def _token_rows(path: str, jsonl) -> list[tuple[list[int], torch.Tensor]]:
    tok = _tokenizer(path)
    out = []
    for line in open(jsonl):
        r = json.loads(line)
        enc = tok.encode(r["text"])  # one token per word (WordLevel); [CLS] and [SEP] unlabelled
        assert len(enc.ids) == len(r["labels"]) + 2
        out.append((enc.ids, torch.tensor([-100, *r["labels"], -100])))
    return out


def _masked_rows(path: str, jsonl, factory=None) -> list[tuple[list[int], torch.Tensor]]:
    tok, fast = _tokenizer(path), tf.AutoTokenizer.from_pretrained(path)
    collator = factory(fast) if factory else tf.DataCollatorForLanguageModeling(tokenizer=fast, mlm=True)
    out = []
    for i, line in enumerate(open(jsonl)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED + i)  # the documented per-row seed
            b = collator([{"input_ids": tok.encode(json.loads(line)["text"]).ids}])
        out.append((b["input_ids"][0].tolist(), b["labels"][0]))
    return out


# ----------------------------------------------------------------- the tests

def test_sequence_classification_from_csv_with_the_users_padding_collator(setup):
    path, data = setup["sequence"], setup["root"] / "reviews.csv"
    ref, mom, counts = _hand(path, _sequence_rows(path, data))
    smooth, _, _ = _hand(path, _sequence_rows(path, data), smoothing=0.1)
    cfg = _cfg(path, data)
    collator = "transformers:DataCollatorWithPadding"

    fixed = verify_framework(cfg, framework="hf-trainer", collator=collator, trainer=f"{THIS}:SumOverItemsTrainer")
    assert fixed.passed and fixed.loss_tokens == tuple(counts) == (M,) * K
    assert fixed.accumulation_error.rel_error < 1e-5 and fixed.normalisation.rel_error < 1e-5
    assert any("DataCollatorWithPadding" in s and "reviews.csv" in s for s in fixed.settings)

    # the model's own loss (transformers 5.25 BERT): a CrossEntropyLoss mean that never reads num_items_in_batch
    own = verify_framework(cfg, framework="hf-trainer", collator=collator)
    assert not own.passed and abs(own.accumulation_error.norm_ratio - K) < 1e-4  # equal counts: exactly K x
    assert abs(own.accumulation_error.rel_error - rel_error(K * mom, ref)) < 1e-4

    # label smoothing done right: a normalisation difference of the size computed here, and a pass
    smoothed = verify_framework(cfg, framework="hf-trainer", collator=collator, trainer=f"{THIS}:SmoothedTrainer")
    expected = rel_error(smooth, ref)
    assert expected > 1e-3
    assert smoothed.passed and not smoothed.accumulation_error.found and smoothed.normalisation.found
    assert abs(smoothed.normalisation.rel_error - expected) < 1e-3 * expected
    assert "SmoothedTrainer.compute_loss" in smoothed.normalisation.cause


def test_token_classification_planted_accumulation_bug_exits_1(setup, tmp_path):
    path, data = setup["token"], setup["root"] / "ner.jsonl"
    ref, mom, counts = _hand(path, _token_rows(path, data))
    assert len(set(counts)) == K  # uneven micro-batches
    expected = rel_error(K * mom, ref)
    assert expected > 0.1
    r = cli(["verify", "--framework", "hf-trainer", "--model", f"hf:{path}", "--data", str(data), "--seq-len", "24",
             "--micro-batch", str(M), "--accumulation", str(K), "--trainer", f"{THIS}:OwnMeanTrainer", "--json"],
            cwd=tmp_path)
    assert r.rc == 1, r.err
    d = json.loads(r.out)
    assert d["loss_tokens"] == counts and d["accumulation_error"]["found"] and not d["passed"]
    assert abs(d["accumulation_error"]["rel_error"] - expected) < 1e-4 * expected
    assert d["normalisation"]["rel_error"] < 1e-5  # its 1 x KM loss is the token mean
    assert "OwnMeanTrainer.compute_loss" in d["accumulation_error"]["cause"]
    assert "num_items_in_batch" in d["accumulation_error"]["fix"]

    fixed = verify_framework(_cfg(path, data), framework="hf-trainer", trainer=f"{THIS}:SumOverItemsTrainer")
    assert fixed.passed and fixed.accumulation_error.rel_error < 1e-5 and fixed.normalisation.rel_error < 1e-5


def test_masked_lm_with_transformers_mlm_collator(setup):
    path, data = setup["masked"], setup["root"] / "sentences.jsonl"
    rows = _masked_rows(path, data)
    ref, mom, counts = _hand(path, rows)
    assert sum(counts) > 0 and len(set(counts)) > 1
    cfg = _cfg(path, data)
    own = verify_framework(cfg, framework="hf-trainer", collator="transformers:DataCollatorForLanguageModeling")
    assert own.loss_tokens == tuple(counts)  # the same masks as replayed here
    expected = rel_error(K * mom, ref)  # BertForMaskedLM's mean never reads num_items_in_batch
    assert not own.passed and abs(own.accumulation_error.rel_error - expected) < 1e-4 * expected
    assert own.normalisation.rel_error < 1e-5
    # no --collator: transformers' MLM collator by default, the same masks
    fixed = verify_framework(cfg, framework="hf-trainer", trainer=f"{THIS}:SumOverItemsTrainer")
    assert fixed.loss_tokens == tuple(counts)
    assert fixed.passed and fixed.normalisation.rel_error < 1e-5


def test_a_collator_factory_of_the_tokenizer_with_its_own_generator(setup):
    path, data = setup["masked"], setup["root"] / "sentences.jsonl"
    ref, mom, counts = _hand(path, _masked_rows(path, data, mlm_collator))  # each row once, in file order
    r = verify_framework(_cfg(path, data), framework="hf-trainer", collator=f"{THIS}:mlm_collator")
    assert r.loss_tokens == tuple(counts) and any("mlm_collator" in s for s in r.settings)
    expected = rel_error(K * mom, ref)
    assert not r.passed and abs(r.accumulation_error.rel_error - expected) < 1e-4 * expected


def test_a_missing_field_is_one_line_naming_it_the_file_and_the_head(setup, tmp_path):
    path, data = setup["sequence"], setup["root"] / "no_label.csv"
    with pytest.raises(ConfigError) as e:
        verify_framework(_cfg(path, data), framework="hf-trainer")
    msg = str(e.value)
    assert "'label'" in msg and "no_label.csv" in msg and "sequence classification" in msg and "\n" not in msg
    r = cli(["verify", "--framework", "hf-trainer", "--model", f"hf:{setup['token']}", "--data", str(data),
             "--seq-len", "24", "--micro-batch", str(M), "--accumulation", str(K)], cwd=tmp_path)
    assert r.rc == 2 and r.out == "" and len(r.err.strip().splitlines()) == 1, r.err
    assert r.err.startswith("trainfit: error: ") and "'labels'" in r.err and "token classification" in r.err
