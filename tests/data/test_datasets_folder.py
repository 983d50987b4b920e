"""``--data`` naming a ``datasets`` ``save_to_disk`` folder (issue 35, row 4): its rows are the documents, read
through the ``datasets`` library, its text column chosen as for Parquet; a ``DatasetDict``'s validation split is
the job's validation data unless ``--val-data`` or ``--val-fraction`` says otherwise. Before, such a folder was
trained on as its JSON metadata, the ``.arrow`` files skipped. The class is closed: a file no reader takes is
refused naming it, never skipped into training on the rest.

References: ``datasets.load_from_disk`` (the library's own reading of the folder), the UTF-8 bytes of each row
(the byte tokenizer) and the ``tokenizers`` library's own encode (a BPE).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.reliability.cli_harness import check_promise, cli, error_lines, snapshot

from trainfit.errors import ConfigError
from trainfit.tasks.corpus import FORMATS, TABLE_SUFFIXES, TEXT_SUFFIXES, find_sources
from trainfit.tasks.files import DataSpec, load_text_data

datasets = pytest.importorskip("datasets")

E = 256  # the byte tokenizer's end-of-document id
FAST = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq-len", "16", "--micro-batch", "2",
        "--accumulation", "1"]
TRAIN = ["def f(x):\n    return x + 1\n", "naïve café — 日本語", "", "the quick brown fox " * 5, "jumps over"]
VALID = ["the lazy dog\n" * 3, "a validation row"]


def _save(obj, path: Path, **kw) -> Path:
    obj.save_to_disk(str(path), **kw)
    return path


@pytest.fixture
def dataset_dir(tmp_path) -> Path:
    """A Dataset saved in 2 shards, the text in column ``body`` beside an int column."""
    ds = datasets.Dataset.from_dict({"id": list(range(len(TRAIN))), "body": TRAIN})
    return _save(ds, tmp_path / "ds", num_shards=2)


@pytest.fixture
def dict_dir(tmp_path) -> Path:
    """A DatasetDict of a train and a validation split, the text in column ``text``."""
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TRAIN}),
                               "validation": datasets.Dataset.from_dict({"text": VALID})})
    return _save(dd, tmp_path / "dd")


def stream(texts) -> list[int]:
    """The packed byte stream of ``texts`` as the docs state it: each non-empty document's UTF-8 bytes, then EOD."""
    return [i for t in texts if t for i in [*t.encode(), E]]


def packed(ds, T: int) -> list[int]:
    """The tokens a packed dataset's rows hold, in order (row i: inputs, then the last label)."""
    out = []
    for i in range(len(ds)):
        out += ds[i]["input_ids"].tolist()
    return out + [ds[len(ds) - 1]["labels"].tolist()[-1]] if len(ds) else out


def test_a_dataset_folder_trains_on_its_rows_column_chosen_as_for_parquet(dataset_dir):
    rows = datasets.load_from_disk(str(dataset_dir))["body"]  # the library's own reading: shards in order
    assert len(list(dataset_dir.glob("*.arrow"))) == 2
    T = 8
    data = load_text_data(DataSpec(data=str(dataset_dir), text_field="body", seq_len=T))
    want = stream(rows)
    n_rows = (len(want) - 1) // T
    assert len(data.train) == n_rows and packed(data.train, T) == want[: n_rows * T + 1]
    assert data.description.startswith(f"{dataset_dir}: 4 documents, {len(want)} tokens")
    assert data.val is None
    with pytest.raises(ConfigError, match=r"text_field='text'.*one of the columns: id, body"):
        load_text_data(DataSpec(data=str(dataset_dir), seq_len=T))


def test_a_dataset_dict_trains_on_train_and_validates_on_its_validation_split(dict_dir, tmp_path):
    ref = datasets.load_from_disk(str(dict_dir))
    data = load_text_data(DataSpec(data=str(dict_dir), seq_len=4))
    train, val = stream(ref["train"]["text"]), stream(ref["validation"]["text"])
    assert packed(data.train, 4) == train[: len(data.train) * 4 + 1]
    assert packed(data.val, 4) == val[: len(data.val) * 4 + 1] and len(data.val) == (len(val) - 1) // 4
    assert f"validation {dict_dir / 'validation'}" in data.description
    other = tmp_path / "other.txt"
    other.write_text("held out by hand, " * 3)
    given = load_text_data(DataSpec(data=str(dict_dir), val_data=str(other), seq_len=4))  # --val-data wins
    assert packed(given.val, 4) == stream([other.read_text()])[: len(given.val) * 4 + 1]
    split = load_text_data(DataSpec(data=str(dict_dir), val_fraction=0.25, seq_len=4))  # so does --val-fraction
    assert packed(split.val, 4) == stream(ref["train"]["text"][-1:])[: len(split.val) * 4 + 1]


def test_train_with_eval_every_on_a_dataset_dict_end_to_end(dict_dir, tmp_path):
    before = snapshot(tmp_path)
    r = cli(["train", "--data", str(dict_dir), "--steps", "2", "--eval-every", "1", "--run-dir",
             str(tmp_path / "run"), *FAST])
    check_promise(r, tmp_path, before)
    assert r.rc == 0, r.err[-2000:]
    n_tokens = len(stream(TRAIN))
    assert f"{dict_dir}: 4 documents, {n_tokens} tokens" in r.err and "metadata" not in r.err, r.err
    assert f"validation {dict_dir / 'validation'}" in r.err, r.err
    metrics = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in m or "eval_loss" in m for m in metrics), metrics[-3:]
    assert snapshot(dict_dir) == {k.removeprefix("dd/"): v for k, v in before.items() if k.startswith("dd/")}


def test_prepare_a_dataset_folder_holds_the_tokenizer_ids_of_its_rows(dataset_dir, tmp_path, bpe_dir):
    from tokenizers import Tokenizer

    r = cli(["prepare", "--data", str(dataset_dir), "--text-field", "body", "--tokenizer", str(bpe_dir),
             "--out", str(tmp_path / "p"), "--json"])
    assert r.rc == 0, r.err
    ref = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    eod = ref.token_to_id("<|endoftext|>")
    rows = [t for t in datasets.load_from_disk(str(dataset_dir))["body"] if t]
    want = [i for t in rows for i in [*ref.encode(t, add_special_tokens=False).ids, eod]]
    side = json.loads((tmp_path / "p" / "prepared.json").read_text())
    tokens = np.fromfile(tmp_path / "p" / "tokens.bin", dtype=np.dtype(side["dtype"]).newbyteorder("<"))
    assert tokens.tolist() == want and side["n_documents"] == len(rows)
    assert sorted(s["path"] for s in side["sources"]) == sorted(str(p) for p in dataset_dir.glob("*.arrow"))


REFUSED = {  # name: (how to spoil a datasets folder or what to pass, what the one line must say)
    "metadata but no state.json": ("nostate", "data-00000-of-00001.arrow"),
    "a dict without a train split": ("notrain", "its splits are validation"),
    "the metadata file itself": ("metadata", "it is the metadata of the datasets folder"),
    "a text column that does not exist": ("column", "one of the columns: text"),
    "a state.json naming a missing file": ("missing", "state.json lists it, but it is missing"),
}


def _spoiled(how: str, dict_dir: Path) -> tuple[str, list[str]]:
    """The --data value and extra flags of a case of :data:`REFUSED`."""
    train = dict_dir / "train"
    if how == "nostate":  # what the issue reported: dataset_info.json was trained on, the .arrow skipped
        (train / "state.json").unlink()
        return str(train), []
    if how == "notrain":
        (dict_dir / "dataset_dict.json").write_text(json.dumps({"splits": ["validation"]}))
        return str(dict_dir), []
    if how == "metadata":
        return str(train / "state.json"), []
    if how == "column":
        return str(dict_dir), ["--text-field", "body"]
    state = json.loads((train / "state.json").read_text())
    state["_data_files"].append({"filename": "data-00001-of-00002.arrow"})
    (train / "state.json").write_text(json.dumps(state))
    return str(dict_dir), []


@pytest.mark.parametrize("command", ["train", "prepare"])
@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_a_folder_that_cannot_be_read_as_data_is_refused_in_one_line(dict_dir, tmp_path, case, command):
    how, says = REFUSED[case]
    data, extra = _spoiled(how, dict_dir)
    before = snapshot(tmp_path)
    out = ["--out", str(tmp_path / "p")] if command == "prepare" else ["--run-dir", str(tmp_path / "run"),
                                                                       "--steps", "1", *FAST]
    r = cli([command, "--data", data, *extra, *out])
    check_promise(r, tmp_path, before)
    assert r.rc == 2, r.err[-2000:]
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0], r.err[-2000:]


def test_without_the_datasets_library_a_folder_is_refused_naming_the_extra(dict_dir, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    before = snapshot(tmp_path)
    r = cli(["prepare", "--data", str(dict_dir), "--out", str(tmp_path / "p")])
    check_promise(r, tmp_path, before)
    assert r.rc == 2 and "trainfit[datasets]" in error_lines(r.err)[0], r.err


def test_prepare_text_field_on_text_files_is_refused(tmp_path):
    """Row 12: ``--text-field`` where every source is a text file (one document each) would be ignored."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("abc " * 20)
    before = snapshot(tmp_path)
    r = cli(["prepare", "--data", str(tmp_path / "in"), "--text-field", "body", "--out", str(tmp_path / "p")])
    check_promise(r, tmp_path, before)
    assert r.rc == 2 and "text_field='body'" in error_lines(r.err)[0] and "ignored" in error_lines(r.err)[0], r.err


KNOWN = [s for s in TEXT_SUFFIXES + TABLE_SUFFIXES if s not in (".parquet", ".csv")]
names = st.tuples(st.sampled_from(["a", "b/c", "d/e/f", ".hid", "__pycache__/g", "h", "b/i"]),
                  st.sampled_from(KNOWN + [".bin", ".arrow", ".docx", "", ".pdf", ".TXT"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=st.lists(names, min_size=1, max_size=6, unique_by=lambda t: t[0]))
def test_a_directory_is_read_whole_or_refused_naming_the_file_no_reader_takes(tmp_path_factory, files):
    """Any directory: every visible file is read, or the first one no reader takes (sorted order) is refused,
    naming it and the formats; no file is skipped into training on the others."""
    root = tmp_path_factory.mktemp("dir")
    for stem, suffix in files:
        p = root / f"{stem}{suffix}"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text('{"text": "x"}\n')
    visible = sorted(p for p in root.rglob("*") if p.is_file()
                     and not any(q.startswith(".") or q == "__pycache__" for q in p.relative_to(root).parts))
    unreadable = [p for p in visible if p.suffix.lower() not in (*TEXT_SUFFIXES, *TABLE_SUFFIXES)]
    try:
        found = find_sources(str(root))
    except ConfigError as e:
        if unreadable:
            assert str(e).startswith(f"data={str(unreadable[0])!r}") and FORMATS in str(e), str(e)
        else:
            assert not visible and "holds no file" in str(e), str(e)
        return
    assert not unreadable and [s.path for s in found.files] == [str(p) for p in visible]


def test_a_datasets_folder_inside_a_directory_is_read_as_rows_its_other_splits_never(dict_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("a note")
    found = find_sources(str(tmp_path))
    assert [Path(s.path).relative_to(tmp_path).parts[:2] for s in found.files] == [("dd", "train"), ("notes.txt",)]
    assert {s.kind for s in found.files} == {"arrow", "text"} and os.path.isfile(found.files[0].path)
