"""``trainfit prepare``: deterministic, atomic, checked on load; its rows equal the raw data's."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from tests.data.conftest import STDLIB_JSON
from tests.reliability.cli_harness import check_promise, cli, snapshot
from trainfit.errors import ConfigError
from trainfit.tasks.files import DataSpec, load_text_data
from trainfit.tasks.prepared import open_prepared

GLOB = str(STDLIB_JSON / "*.py")


def _prepare(out, *extra):
    r = cli(["prepare", "--data", GLOB, "--out", str(out), "--json", *extra])
    assert r.rc == 0, r.err
    return json.loads(r.out)


def test_prepare_is_deterministic_and_holds_what_the_sidecar_says(tmp_path):
    a, b = _prepare(tmp_path / "a"), _prepare(tmp_path / "b")
    assert a["n_documents"] == b["n_documents"] == 5
    for name in ("tokens.bin", "documents.bin", "prepared.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    files = sorted(STDLIB_JSON.glob("*.py"))
    expected = np.concatenate([np.append(np.frombuffer(f.read_bytes(), np.uint8), 256) for f in files])
    tokens = np.fromfile(tmp_path / "a" / "tokens.bin", dtype="<u2")
    assert np.array_equal(tokens, expected) and a["n_tokens"] == len(expected) and a["dtype"] == "uint16"
    offsets = np.fromfile(tmp_path / "a" / "documents.bin", dtype="<u8")
    assert offsets.tolist() == np.cumsum([0] + [len(f.read_bytes()) + 1 for f in files]).tolist()
    side = json.loads((tmp_path / "a" / "prepared.json").read_text())
    assert side["files"]["tokens.bin"]["sha256"] == hashlib.sha256(tokens.tobytes()).hexdigest()
    assert [s["path"] for s in side["sources"]] == [str(f) for f in files]


@pytest.mark.parametrize("packing", [True, False])
def test_prepared_rows_equal_raw_rows(tmp_path, packing, bpe_dir):
    _prepare(tmp_path / "p", "--tokenizer", str(bpe_dir))
    raw = load_text_data(DataSpec(data=GLOB, tokenizer=str(bpe_dir), seq_len=16, packing=packing, val_fraction=0.2))
    prep = load_text_data(DataSpec(data=str(tmp_path / "p"), seq_len=16, packing=packing, val_fraction=0.2))
    assert prep.source == "prepared" and prep.tokenizer_dir == str(bpe_dir.resolve())
    assert (prep.vocab_size, prep.eod_id, prep.longest) == (raw.vocab_size, raw.eod_id, raw.longest)
    for a, b in ((raw.train, prep.train), (raw.val, prep.val)):
        assert len(a) == len(b)
        for i in (0, len(a) // 2, len(a) - 1):
            assert a[i]["input_ids"].tolist() == b[i]["input_ids"].tolist()
            assert a[i]["labels"].tolist() == b[i]["labels"].tolist()


def test_a_failed_prepare_leaves_no_directory(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(300)) + "{not json\n")
    before = snapshot(tmp_path)
    r = cli(["prepare", "--data", str(data), "--out", str(tmp_path / "out")])
    check_promise(r, tmp_path, before)
    assert r.rc == 2 and "d.jsonl:301" in r.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]  # no out, no out.tmp-<pid>


@pytest.mark.parametrize("tamper", ["flip a token", "truncate", "edit the sidecar", "drop a key"])
def test_a_changed_token_file_is_refused(tmp_path, tamper):
    out = tmp_path / "p"
    _prepare(out)
    if tamper == "flip a token":
        raw = bytearray((out / "tokens.bin").read_bytes())
        raw[100] ^= 1
        (out / "tokens.bin").write_bytes(bytes(raw))
    elif tamper == "truncate":
        (out / "tokens.bin").write_bytes((out / "tokens.bin").read_bytes()[:-2])
    else:
        side = json.loads((out / "prepared.json").read_text())
        if tamper == "drop a key":
            del side["eod_id"]
        else:
            side["n_tokens"] -= 1
        (out / "prepared.json").write_text(json.dumps(side))
    with pytest.raises(ConfigError, match="re-run trainfit prepare"):
        open_prepared(out)
    before = snapshot(tmp_path)
    r = cli(["train", "--data", str(out), "--steps", "1", "--run-dir", str(tmp_path / "run")])
    check_promise(r, tmp_path, before)
    assert r.rc == 2 and "re-run trainfit prepare" in r.err


def test_prepare_refuses_an_existing_directory_without_force(tmp_path):
    out = tmp_path / "p"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    before = snapshot(tmp_path)
    r = cli(["prepare", "--data", GLOB, "--out", str(out)])
    check_promise(r, tmp_path, before)
    assert r.rc == 2 and "--force" in r.err
    _prepare(out, "--force")
    assert (out / "mine.txt").read_text() == "keep me" and open_prepared(out)[0].n_documents == 5


def test_a_different_tokenizer_than_the_prepared_one_is_refused(tmp_path, bpe_dir):
    _prepare(tmp_path / "p")  # byte
    with pytest.raises(ConfigError, match=r"tokenizer=.*prepared with \(byte\)"):
        load_text_data(DataSpec(data=str(tmp_path / "p"), tokenizer=str(bpe_dir)))
