"""A prepared directory is checked to the last id (issue 27, row 4): no edit of prepared.json and no token file
whose checksums were updated to match reaches the model. Each tamper is refused by ``train --data DIR`` in one
stderr line naming the sidecar field, exit 2, before anything is written."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

from tests.data.conftest import STDLIB_JSON
from tests.reliability.cli_harness import check_promise, cli, snapshot
from trainfit.tasks.prepared import open_prepared

FAST = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq-len", "32", "--micro-batch", "2",
        "--accumulation", "1", "--steps", "1"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The stdlib json package (5 documents) prepared with the byte tokenizer, copied per test."""
    out = tmp_path_factory.mktemp("prep") / "p"
    r = cli(["prepare", "--data", str(STDLIB_JSON / "*.py"), "--out", str(out)])
    assert r.rc == 0, r.err
    return out


@pytest.fixture
def prep(prepared, tmp_path):
    out = tmp_path / "p"
    shutil.copytree(prepared, out)
    return out


def _edit(out, **changes):
    side = json.loads((out / "prepared.json").read_text())
    side.update(changes)
    (out / "prepared.json").write_text(json.dumps(side))


def _rewrite(out, name, array, **changes):
    """Replace ``name`` by ``array`` and update its size and sha256 in the sidecar (a careful tamper)."""
    data = array.tobytes()
    (out / name).write_bytes(data)
    side = json.loads((out / "prepared.json").read_text())
    side["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    side.update(changes)
    (out / "prepared.json").write_text(json.dumps(side))


def _refused(tmp_path, out, *words):
    """train --data OUT: exit 2, exactly one line on stderr holding every word, nothing written."""
    before = snapshot(tmp_path)
    r = cli(["train", "--data", str(out), "--run-dir", str(tmp_path / "run"), *FAST])
    check_promise(r, tmp_path, before)
    lines = r.err.strip().splitlines()
    assert r.rc == 2 and len(lines) == 1, r.err[-2000:]
    for w in words:
        assert w in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_vocab_size_edited_up_is_refused(tmp_path, prep):
    _edit(prep, vocab_size=300)  # still uint16, ids still below it: a silently larger model before
    _refused(tmp_path, prep, "vocab_size=300", "vocab_size=257")


def test_vocab_size_edited_below_the_ids_is_refused(tmp_path, prep):
    _edit(prep, vocab_size=200)  # ids up to 256: an IndexError mid-training before
    _refused(tmp_path, prep, "vocab_size=200")


def test_eod_id_outside_the_vocabulary_is_refused(tmp_path, prep):
    _edit(prep, eod_id=400)
    _refused(tmp_path, prep, "eod_id=400", "outside the vocabulary")


def test_eod_id_edited_inside_the_vocabulary_is_refused(tmp_path, prep):
    _edit(prep, eod_id=10)  # the byte tokenizer's EOD is 256
    _refused(tmp_path, prep, "eod_id=10")


def test_ids_beyond_the_vocabulary_with_checksums_updated_are_refused(tmp_path, prep):
    tokens = np.fromfile(prep / "tokens.bin", dtype="<u2")
    tokens[100] = 300  # vocabulary 257
    _rewrite(prep, "tokens.bin", tokens)
    _refused(tmp_path, prep, "largest id is 300", "max_id=256")


def test_ids_beyond_the_vocabulary_with_checksums_and_max_id_updated_are_refused(tmp_path, prep):
    tokens = np.fromfile(prep / "tokens.bin", dtype="<u2")
    tokens[100] = 300
    _rewrite(prep, "tokens.bin", tokens, max_id=300)
    _refused(tmp_path, prep, "max_id=300", "outside the vocabulary")


def test_an_understated_max_id_is_refused(tmp_path, prep):
    _edit(prep, max_id=255)  # the file holds 256 (EOD)
    _refused(tmp_path, prep, "max_id=255")


def test_dtype_not_the_one_of_the_vocabulary_is_refused(tmp_path, prep):
    tokens = np.fromfile(prep / "tokens.bin", dtype="<u2").astype("<u4")
    _rewrite(prep, "tokens.bin", tokens, dtype="uint32")  # sizes and sha256 consistent, dtype not
    _refused(tmp_path, prep, "dtype='uint32'", "uint16")


def test_a_document_without_its_end_of_document_id_is_refused(tmp_path, prep):
    tokens = np.fromfile(prep / "tokens.bin", dtype="<u2")
    offsets = np.fromfile(prep / "documents.bin", dtype="<u8")
    tokens[offsets[2] - 1] = ord("x")  # document 1 loses its EOD; checksum updated
    _rewrite(prep, "tokens.bin", tokens)
    _refused(tmp_path, prep, "document 1", "eod_id=256")


def test_a_count_of_the_wrong_type_is_refused(tmp_path, prep):
    _edit(prep, skipped_documents="many")  # a ValueError traceback formatting the data line before
    _refused(tmp_path, prep, "skipped_documents='many'", "an integer >= 0")


def test_a_count_that_is_a_bool_is_refused(tmp_path, prep):
    _edit(prep, skipped_documents=True)
    _refused(tmp_path, prep, "skipped_documents=True")


def _prepared_with_own_tokenizer(tmp_path, bpe_dir):
    """A copy of the BPE tokenizer directory and a directory prepared with it: (tokenizer dir, prepared dir)."""
    tok = tmp_path / "tok"
    shutil.copytree(bpe_dir, tok)
    out = tmp_path / "p"
    r = cli(["prepare", "--data", str(STDLIB_JSON / "__init__.py"), "--tokenizer", str(tok), "--out", str(out)])
    assert r.rc == 0, r.err
    return tok, out


def test_a_tokenizer_changed_since_prepare_is_refused(tmp_path, bpe_dir):
    tok, out = _prepared_with_own_tokenizer(tmp_path, bpe_dir)
    spec = json.loads((tok / "tokenizer.json").read_text())  # one more added token: vocabulary 301, not 300
    spec["added_tokens"].append({**spec["added_tokens"][0], "id": 300, "content": "<|extra|>"})
    (tok / "tokenizer.json").write_text(json.dumps(spec))
    _refused(tmp_path, out, "tokenizer.json's sha256")


def test_a_missing_tokenizer_directory_is_refused(tmp_path, bpe_dir):
    tok, out = _prepared_with_own_tokenizer(tmp_path, bpe_dir)
    shutil.rmtree(tok)
    _refused(tmp_path, out, "tokenizer=", "is missing")


def test_an_untouched_directory_loads_and_its_max_id_is_the_files(prep):
    store, side = open_prepared(prep)
    tokens = np.fromfile(prep / "tokens.bin", dtype="<u2")
    assert side["max_id"] == int(tokens.max()) == 256 and store.n_tokens == len(tokens)
