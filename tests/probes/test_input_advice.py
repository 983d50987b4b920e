"""Input-bound advice for data read from files: `trainfit prepare` first, then workers, then pinned memory."""

import json
import sysconfig
from pathlib import Path

import pytest

from tests.reliability.cli_harness import cli
from trainfit.config import MAX_WORKERS
from trainfit.probes.advice import Findings, advise, suggested_workers

BASE = dict(comm_exposed_frac=0.0, h2d_frac=0.01, device_type="cpu", world_size=1, strategy="single",
            micro_batch=4, scaling_note="scale out with ddp: 2: 1.9x", batch_gain=0.01)


def _input(adv):
    return [a for a in adv if a["kind"] == "input"]


@pytest.mark.parametrize("source", ["raw-on-the-fly", "raw-packed"])
def test_raw_text_names_prepare_first_then_workers_then_pinned_memory(source):
    f = Findings(data_wait_frac=0.63, loader_workers=0, data_source=source, data="/tmp/docs.jsonl", cpu_count=16,
                 **BASE)
    b, adv = advise(f)
    assert b == "input"
    items = _input(adv)
    assert [a["fix"] for a in items] == ["prepare", "workers", "pin_memory"]
    assert "`trainfit prepare --data /tmp/docs.jsonl --out DIR`" in items[0]["text"]
    assert source in items[0]["text"] and "63%" in items[0]["text"]
    # 16 CPUs: one per CPU left after the training process, at most 8
    assert items[1]["loader_workers"] == 8 and "`--loader-workers 8`" in items[1]["text"]
    assert "pin_memory" in items[2]["text"] and "applies on CUDA" in items[2]["text"]
    assert adv[-1]["kind"] == "scale-out" and adv[-1]["text"].startswith("after the fixes above")


def test_generated_data_keeps_its_advice_without_prepare():
    b, adv = advise(Findings(data_wait_frac=0.42, loader_workers=0, cpu_count=16, **BASE))
    assert b == "input"
    texts = [a["text"] for a in _input(adv)]
    assert "prepare" not in " ".join(texts)
    assert texts[0].startswith("raise loader_workers from 0 to 2")


def test_a_prepared_file_is_not_told_to_store_samples_as_a_memmap():
    texts = [a["text"] for a in _input(advise(Findings(data_wait_frac=0.3, loader_workers=0,
                                                       data_source="prepared", **BASE))[1])]
    assert texts and not any("memory-mapped" in t or "trainfit prepare" in t for t in texts)


def test_below_the_threshold_no_input_advice_for_raw_text():
    b, adv = advise(Findings(data_wait_frac=0.04, loader_workers=0, data_source="raw-on-the-fly", **BASE))
    assert b == "compute" and not _input(adv)


@pytest.mark.parametrize(("current", "cpus", "expected"), [
    (0, 2, 1),        # a 2-core machine: one worker beside the training process
    (0, 16, 8),       # capped at 8
    (2, 16, 8),
    (8, 16, 16),      # already at the cap of spare CPUs: doubled
    (0, 0, 2),        # CPUs unknown: the old doubling rule (0 -> 2)
    (3, 0, 6),
])
def test_suggested_workers_by_hand(current, cpus, expected):
    assert suggested_workers(current, cpus) == min(expected, MAX_WORKERS)


def test_suggested_workers_never_exceed_what_a_run_may_start():
    assert suggested_workers(MAX_WORKERS, 1024) == MAX_WORKERS


def _stdlib_docs(path, n_docs: int, chars: int) -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if p.stat().st_size >= chars)[:n_docs]
    texts = [p.read_text(encoding="utf-8", errors="replace")[:chars] for p in files]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def _bpe(texts: list[str], out: Path, vocab: int = 512) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return out


def test_profile_of_on_the_fly_bpe_finds_the_input_and_names_prepare(tmp_path, one_thread):
    """A real `trainfit profile` of a tiny GPT (1 block, d_model 32) on 24 stdlib modules of 20,000 characters,
    --packing off with a BPE tokenizer.json trained here: every row tokenizes its whole document (~20k chars) to
    keep 33 tokens, which takes far longer than the model's step (a data wait of ~90%+ on 2 loaded cores), so the
    0.10 threshold is crossed by a wide margin."""
    docs = tmp_path / "docs.jsonl"
    texts = _stdlib_docs(docs, 24, 20_000)
    assert len(texts) == 24
    tok = _bpe(texts[:8], tmp_path / "bpe")
    r = cli(["profile", "--model", "gpt-tiny", "--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "32",
             "--micro-batch", "4", "--accumulation", "1", "--data", str(docs), "--packing", "off", "--tokenizer",
             str(tok), "--steps", "3", "--warmup", "1", "--no-batch-probe", "--no-precision-probe", "--json",
             "--run-dir", str(tmp_path / "run")])
    assert r.rc == 0, r.err
    rep = json.loads(r.out)
    assert rep["bottleneck"] == "input" and rep["data_wait_frac"] > 0.5
    first, second = rep["advice"][:2]
    assert first["fix"] == "prepare" and f"trainfit prepare --data {docs}" in first["text"]
    assert second["fix"] == "workers" and "--loader-workers" in second["text"]
