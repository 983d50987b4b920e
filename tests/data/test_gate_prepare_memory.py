"""Issue 35, row 10: ``prepare`` in bounded memory for any document, whatever the tokenizer.

Before, a document with no whitespace (a base64 blob) was never cut (cuts were tried only at newlines and spaces),
so a BPE tokenizer encoded it whole: about 300 bytes of memory per input byte (a 2 MB blob peaked at ~640 MB, a
20 MB one at 4.9 GB). Now a long document is cut between two of the tokenizer's own pre-tokens (no merge crosses
one), each cut tried against the tokenizer; a run it cannot cut past :data:`MAX_UNIT_BYTES` is refused in one line.

The property test: over random texts (letters, digits, punctuation, apostrophes, whitespace runs, non-ASCII, long
runs of one character), fed in random pieces, the ids of the cut units joined equal the tokenizer's own encoding
of the whole text, for four kinds of BPE built here (byte-level with the GPT-2 split, a Llama-3-style regex split,
one whose pre-tokenizer never splits, one with no pre-tokenizer at all, whose merges cross spaces), with units cut small (UNIT_CHARS patched) so that every
example is cut many times, and with the check window around a cut shrunk too (the pre-token rule carries it).
"""

from __future__ import annotations

import base64
import random
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.data.conftest import STDLIB_JSON
from tests.data.test_prepare_bounded import _peak_mb

from trainfit.tasks import prepared
from trainfit.tasks.tokenizer import load_tokenizer

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


KINDS = ("gpt2", "llama3", "one-word", "none")


def _train(out: Path, kind: str) -> Path:
    """A 400-id BPE of ``kind`` trained on the stdlib json package's source, saved as out/tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif kind == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif kind == "one-word":  # a pre-tokenizer that never splits: the whole text is one word for the model
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    else:  # "none": no pre-tokenizer at all (merges cross spaces); no byte-level alphabet either
        tok.decoder = None
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator([p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))], trainer=trainer)
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return out


class _Tokenizers(dict):
    def __repr__(self) -> str:  # hypothesis prints its arguments: not four vocabularies
        return f"<tokenizers {', '.join(self)}>"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("toks")
    return _Tokenizers({kind: load_tokenizer(str(_train(root / kind, kind))) for kind in KINDS})


_RUN = st.tuples(st.sampled_from(list("aZé9'_=+/-. \n\t😀x")), st.integers(1, 40))
TEXTS = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=400),
    st.lists(_RUN, max_size=30).map(lambda runs: "".join(c * n for c, n in runs)),  # long runs of one character
    st.binary(min_size=1, max_size=300).map(lambda b: base64.b64encode(b).decode()),  # no whitespace at all
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS, kind=st.sampled_from(KINDS), unit=st.integers(8, 64),
       window=st.sampled_from([4, 16, 128]), seed=st.integers(0, 2**16))
def test_cut_units_encode_as_the_whole_document(tokenizers, text, kind, unit, window, seed):
    tok = tokenizers[kind]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]  # the reader's pieces of one document
    with mock.patch.multiple(prepared, create=True, UNIT_CHARS=unit, CUT_WINDOW=window, SCAN_CHARS=4 * window):
        units = list(prepared._units(((p, i == len(pieces) - 1) for i, p in enumerate(pieces)), tok))
        ids = [i for t, _ in units for i in tok.backend.encode(t, add_special_tokens=False).ids]
    assert "".join(t for t, _ in units) == text
    assert ids == tok.backend.encode(text, add_special_tokens=False).ids  # the tokenizer's own, whole


def test_long_runs_are_cut_small_under_byte_level_bpe(tokenizers):
    """Not held whole: a 200 KB base64 blob comes out in units of about UNIT_CHARS."""
    blob = base64.b64encode(random.Random(0).randbytes(150_000)).decode()
    units = [t for t, _ in prepared._units([(blob, True)], tokenizers["gpt2"])]
    assert "".join(units) == blob and max(map(len, units)) <= prepared.UNIT_CHARS + prepared.CUT_WINDOW


BLOB_MB = 2
PEAK_BOUND_MB = 150
"""Peak RSS of a whole prepare process on a 2 MB blob under BPE (start-up ~45 MB; the old code: ~640 MB)."""


def test_a_blob_with_no_whitespace_is_prepared_in_bounded_memory(tmp_path, bpe_dir):
    doc = tmp_path / "blob.txt"
    doc.write_text(base64.b64encode(random.Random(1).randbytes(BLOB_MB * 10**6 * 3 // 4)).decode())
    rc, peak, err = _peak_mb("--data", str(doc), "--tokenizer", str(bpe_dir), "--out", str(tmp_path / "p"))
    print(f"peak RSS on a {BLOB_MB} MB base64 blob under BPE: {peak:.0f} MB")
    assert rc == 0 and peak < PEAK_BOUND_MB, (peak, err)
    tokens = np.fromfile(tmp_path / "p" / "tokens.bin", dtype="<u2")
    head = doc.read_text()[:5000]  # the first cut falls near UNIT_CHARS: its ids are the tokenizer's own
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(bpe_dir / "tokenizer.json")).encode(head, add_special_tokens=False).ids[:-8]
    assert tokens[: len(ref)].tolist() == ref


def test_a_run_no_tokenizer_can_cut_is_refused_in_one_line_in_bounded_memory(tmp_path, bpe_dir):
    """One pre-token of 1.1 M letters: the old code encoded it whole (exit 0, ~280 MB); refused now, nothing left."""
    doc = tmp_path / "data" / "run.txt"
    doc.parent.mkdir()
    doc.write_text("a" * (getattr(prepared, "MAX_UNIT_BYTES", 1 << 20) + 50_000))  # (getattr: also run on old code)
    rc, peak, err = _peak_mb("--data", str(doc), "--tokenizer", str(bpe_dir), "--out", str(tmp_path / "p"))
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("trainfit: error: data=") and "split the" in err, err
    assert peak < PEAK_BOUND_MB, peak
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no out, no temporary directory


def test_a_memory_error_removes_the_temporary_directory_and_answers_in_one_line(tmp_path, monkeypatch):
    from tests.reliability.cli_harness import cli

    def no_memory(*a, **k):
        raise MemoryError

    monkeypatch.setattr(prepared, "_encode", no_memory)
    r = cli(["prepare", "--data", str(STDLIB_JSON / "__init__.py"), "--out", str(tmp_path / "p")])
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1 and "out of memory" in lines[0], r.err
    assert list(tmp_path.iterdir()) == []


RAW_PATH = ("import sys, numpy as np; from trainfit.tasks.prepared import tokenize_documents; "
            "from trainfit.tasks.tokenizer import load_tokenizer; tok = load_tokenizer(sys.argv[2]); "
            "ids = next(iter(tokenize_documents([open(sys.argv[1]).read()], tok)))[0]; print(len(ids))")


def test_the_training_path_tokenizes_a_blob_in_bounded_memory_and_the_same_ids(tmp_path, bpe_dir):
    """``train --data blob.txt`` tokenizes in memory (no prepare): the same cut units, the same ids."""
    import subprocess
    import sys

    from tests.data.test_prepare_bounded import MEASURE

    blob = base64.b64encode(random.Random(2).randbytes(BLOB_MB * 10**6 * 3 // 4)).decode()
    (tmp_path / "blob.txt").write_text(blob)
    r = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-c", RAW_PATH, str(tmp_path / "blob.txt"),
                        str(bpe_dir)], capture_output=True, text=True)
    rc, kib = r.stdout.split()[-2:]
    assert rc == "0" and int(kib) / 1024 < PEAK_BOUND_MB, (int(kib) / 1024, r.stderr)
    tok = load_tokenizer(str(bpe_dir))
    head = blob[: 3 * prepared.UNIT_CHARS + 99]  # several units
    ids = next(iter(prepared.tokenize_documents([head], tok)))[0]
    assert ids[:-1].tolist() == tok.backend.encode(head, add_special_tokens=False).ids and ids[-1] == tok.eod_id


_NO_SPACE = st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc"))


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(alphabet=st.lists(_NO_SPACE, min_size=1, max_size=12, unique=True), seed=st.integers(0, 2**16))
def test_any_whitespace_free_document_is_bounded_or_refused_in_one_line(tmp_path, bpe_dir, alphabet, seed):
    """2 MB drawn from any small alphabet without whitespace (one letter: one pre-token; letters and digits: many;
    non-ASCII too): prepare stays under MEMORY_PER_WORKER_MB, or refuses in one line leaving nothing, in bounded
    time. The code before encoded each such document whole (~600 MB for 2 MB)."""
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    (root / "data").mkdir()
    rng = random.Random(seed)
    text = "".join(rng.choices(alphabet, k=2 * 10**6 // max(len(c.encode()) for c in alphabet)))
    (root / "data" / "doc.txt").write_text(text)
    t = time.monotonic()
    rc, peak, err = _peak_mb("--data", str(root / "data" / "doc.txt"), "--tokenizer", str(bpe_dir), "--out",
                             str(root / "p"))
    took = time.monotonic() - t
    print(f"alphabet {''.join(alphabet)!r}: exit {rc}, peak {peak:.0f} MB, {took:.1f} s")
    assert peak < getattr(prepared, "MEMORY_PER_WORKER_MB", 400) and took < 300, (peak, took, err[-300:])
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("trainfit: error: data=") and "split the" in lines[0], err
        assert sorted(p.name for p in root.iterdir()) == ["data"]
    else:
        assert rc == 0, err
