"""Issue 35, row 1: a run's data fingerprint sees every byte, and a resume onto any change is refused naming the file.

Before, a raw file's fingerprint hashed its first, middle and last 64 KiB: 63 bytes edited in the middle of a 1 MB
text file (size kept) resumed, and rewrote the run directory. Now each file is hashed whole (streamed), the sums
cached by path, size, inode, device, mtime and ctime -- so an edit that puts the modification time back with
``os.utime`` still misses the cache (the kernel sets ctime on every write and every utime).

The property test draws the offset and length of an in-place edit of the 1 MB file (size and inode kept, mtime put
back), with the checksum cache warm (the original file's sum cached first, as by an earlier resume): every edit is
refused with exit 2 in one stderr line naming the file, the run directory byte for byte unchanged, in bounded time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.data.conftest import STDLIB_JSON
from tests.reliability.cli_harness import Result, snapshot
from tests.reliability.cli_harness import cli as harness_cli

from trainfit.tasks import identity
from trainfit.tasks.files import clear_cache

SIZE = 10**6
BASE = """model = "gpt-tiny"
model_config = "n_layer=1,d_model=16,n_head=2"
seq_len = 8
micro_batch = 2
accumulation = 1
steps = 2
lr = 0.01
"""
REFUSAL_S = 20
"""The most a refused resume may take (hashing 1 MB and comparing; ~1 s here, the rest is import and load)."""


def cli(*args: str, traced: bool = False) -> Result:
    """``trainfit train ARGS`` in this process, as a fresh process would (no in-memory data or identity cache);
    ``traced``: its time and peak Python allocation measured too (:func:`tests.reliability.cli_harness.cli`)."""
    clear_cache()
    identity._CACHE.clear()
    return harness_cli(["train", *args], traced=traced)


def text_of(size: int) -> bytes:
    block = "".join(p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))).encode()
    return (block * (size // len(block) + 1))[:size]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, bpe_dir) -> dict:
    """One run trained on a 1 MB text file with a BPE tokenizer (a copy this module may edit)."""
    root = tmp_path_factory.mktemp("every-byte")
    data, tok, run = root / "corpus.txt", root / "tok", root / "run"
    data.write_bytes(text_of(SIZE))
    shutil.copytree(bpe_dir, tok)
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    toml = root / "base.toml"
    toml.write_text(BASE + f'data = "{data}"\ntokenizer = "{tok}"\n')
    r = cli(str(toml), "--run-dir", str(run))
    rc, err = r.rc, r.err
    assert rc == 0, err
    return _Files(root=root, data=data, tok=tok, run=run, toml=toml, original=data.read_bytes())


class _Files(dict):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)

    def __repr__(self) -> str:  # hypothesis prints its arguments: not a megabyte of text
        return f"<trained run {self['run']}>"


def _restore(path: Path, content: bytes) -> None:
    with open(path, "r+b") as f:
        f.write(content)


def _refused(trained: dict, run: Path, naming: str) -> str:
    before = snapshot(run)
    r = cli(str(trained["toml"]), "--run-dir", str(run), "--resume", "--steps", "3", traced=True)
    rc, err, took = r.rc, r.err, r.seconds
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("trainfit: error: checkpoint "), err
    assert naming in lines[0], lines[0]
    assert snapshot(run) == before and took < REFUSAL_S, took
    assert r.peak_bytes < 256 * 2**20, r.peak_bytes  # bounded whatever the edit (imports included)
    return lines[0]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, SIZE - 1), length=st.integers(1, 4096), mask=st.integers(1, 255))
def test_any_edit_in_place_with_mtime_put_back_is_refused_naming_the_file(trained, tmp_path, offset, length, mask):
    data, run = trained["data"], Path(tempfile.mkdtemp(dir=tmp_path)) / "run"
    shutil.copytree(trained["run"], run)
    _restore(data, trained["original"])
    with mock.patch.object(identity, "RACY_NS", 0, create=True):  # cache the sum of a file written a moment ago (as if older)
        time.sleep(0.02)
        identity._CACHE.clear()
        assert identity.sources_identity(str(data), field="data")["sha256"]  # the checksum cache is warm
        info = os.stat(data)
        length = min(length, SIZE - offset)
        edited = bytes(b ^ mask for b in trained["original"][offset:offset + length])
        with open(data, "r+b") as f:  # in place: the same inode and size
            f.seek(offset)
            f.write(edited)
        os.utime(data, ns=(info.st_atime_ns, info.st_mtime_ns))  # the modification time put back
        after = os.stat(data)
        assert (after.st_size, after.st_ino, after.st_mtime_ns) == (info.st_size, info.st_ino, info.st_mtime_ns)
        try:
            line = _refused(trained, run, str(data))
        finally:
            _restore(data, trained["original"])
    assert "with data=" in line and "changed" in line, line


def test_an_unchanged_file_is_read_once_then_served_from_the_cache(trained, tmp_path, monkeypatch):
    """A resume does not re-read unchanged data; a changed ctime alone (os.utime) re-reads it."""
    data = tmp_path / "d.txt"
    data.write_bytes(text_of(SIZE))
    reads = []
    real = identity.sha256_file
    monkeypatch.setattr(identity, "sha256_file", lambda p: reads.append(p) or real(p))
    monkeypatch.setattr(identity, "RACY_NS", 0)
    time.sleep(0.02)
    first = []
    for _ in range(3):
        identity._CACHE.clear()  # a new process each time: only the cache on disk is left
        first.append(identity.sources_identity(str(data), field="data"))
    assert len(reads) == 1 and first[0] == first[1] == first[2]
    assert first[0]["sha256"] != "" and first[0]["listed"][0][2] == hashlib.sha256(data.read_bytes()).hexdigest()
    info = os.stat(data)
    os.utime(data, ns=(info.st_atime_ns, info.st_mtime_ns))  # same times, but ctime moves
    identity._CACHE.clear()
    identity.sources_identity(str(data), field="data")
    assert len(reads) == 2


def test_a_file_written_a_moment_ago_is_not_cached(tmp_path, monkeypatch):
    """Racy: a second edit in the same clock tick would keep every time stamp, so a fresh file is hashed again."""
    data = tmp_path / "d.txt"
    data.write_bytes(b"x" * 1000)
    reads = []
    real = identity.sha256_file
    monkeypatch.setattr(identity, "sha256_file", lambda p: reads.append(p) or real(p))
    for _ in range(2):
        identity._CACHE.clear()
        identity.sources_identity(str(data), field="data")
    assert len(reads) == 2


@pytest.mark.parametrize("file", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_changed_in_place_is_refused_naming_it(trained, tmp_path, file):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    path = trained["tok"] / file
    original = path.read_bytes()
    info = os.stat(path)
    doc = json.loads(original)
    doc["model_max_length" if file == "tokenizer_config.json" else "truncation"] = (
        4096 if file == "tokenizer_config.json" else {"max_length": 4096, "strategy": "LongestFirst", "stride": 0,
                                                      "direction": "Right"})
    path.write_text(json.dumps(doc))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    try:
        line = _refused(trained, run, str(path))
    finally:
        path.write_bytes(original)
    assert "with tokenizer=" in line, line


def test_the_same_data_still_resumes(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    r = cli(str(trained["toml"]), "--run-dir", str(run), "--resume", "--steps", "3")
    assert r.rc == 0, r.err


def _old_fingerprint(path: Path) -> dict:
    """The identity trainfit recorded before (first, middle and last 64 KiB of each file), computed here."""
    data, k = path.read_bytes(), 64 * 1024
    sample = data if len(data) <= 3 * k else data[:k] + data[(len(data) - k) // 2:][:k] + data[-k:]
    entry = json.dumps([str(path.absolute()), len(data), hashlib.sha256(sample).hexdigest()]).encode()
    return {"path": str(path.absolute()), "files": 1, "bytes": len(data), "sha256": hashlib.sha256(entry).hexdigest()}


def test_a_record_of_the_older_sampled_fingerprint_is_compared_as_it_was_made(tmp_path):
    """Checkpoints written before this change still resume on the same data (and not on other data)."""
    data = tmp_path / "d.txt"
    data.write_bytes(text_of(SIZE))
    old = _old_fingerprint(data)
    now = identity.sources_identity(str(data), field="data")
    assert identity.same("data", old, now)
    with open(data, "r+b") as f:
        f.write(b"#")  # the first byte: inside the old sample
    identity._CACHE.clear()
    assert not identity.same("data", old, identity.sources_identity(str(data), field="data"))
