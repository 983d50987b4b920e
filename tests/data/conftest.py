"""Small corpora and a tiny BPE tokenizer, made here from stdlib text (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainfit.tasks.files import clear_cache

STDLIB_JSON = Path(json.__file__).parent
"""The stdlib's own json package: five .py files of real text."""


@pytest.fixture(autouse=True)
def fresh_data_cache():
    """Each test sees a fresh process's data cache and notes (a command prints its notes once)."""
    clear_cache()
    yield
    clear_cache()


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """Four documents in sorted order a, b, c (empty), d; plus files the reader must skip (hidden, __pycache__)."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("abc")
    (root / "b.txt").write_text("de")
    (root / "sub" / "c.txt").write_text("")
    (root / "sub" / "d.txt").write_text("fghij")
    (root / ".hidden.txt").write_text("never read")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.txt").write_text("never read")
    return root


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory) -> Path:
    """A 300-id byte-level BPE trained on the stdlib json package, saved as DIR/tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))], trainer=trainer)
    out = tmp_path_factory.mktemp("bpe")
    tok.save(str(out / "tokenizer.json"))
    return out
