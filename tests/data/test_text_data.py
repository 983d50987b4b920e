"""Rows from files against hand calculations: packing, padding, the validation split, the readers, tokenizers."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet
import pytest
import torch

from tests.data.conftest import STDLIB_JSON
from trainfit.errors import ConfigError
from trainfit.tasks.builtin import gpt_count
from trainfit.tasks.files import DataSpec, load_text_data
from trainfit.tasks.synthetic import IGNORE_INDEX, collate_tokens
from trainfit.tasks.tokenizer import load_tokenizer

E = 256  # the byte tokenizer's end-of-document id


def ids(text: str) -> list[int]:
    return list(text.encode())


def rows(ds) -> list[tuple[list[int], list[int]]]:
    return [(ds[i]["input_ids"].tolist(), ds[i]["labels"].tolist()) for i in range(len(ds))]


def test_byte_tokenizer_round_trips_any_text():
    tok = load_tokenizer("byte")
    text = "naïve café — 日本語 \U0001F600\n\ttabs"
    got = tok.encode(text)
    assert got.tolist() == list(text.encode("utf-8")) and got.max() < 256
    assert tok.decode(got.tolist() + [E]) == text
    assert (tok.vocab_size, tok.eod_id) == (257, 256)


def test_packing_by_hand(corpus):
    # documents in sorted order: "abc", "de", "" (skipped), "fghij"; each followed by EOD
    stream = ids("abc") + [E] + ids("de") + [E] + ids("fghij") + [E]  # 13 tokens
    data = load_text_data(DataSpec(data=str(corpus), seq_len=5))
    assert data.source == "raw-packed" and data.longest == 5 and data.vocab_size == 257
    # (13 - 1) // 5 = 2 rows; row i = stream[5i : 5i + 6]; 13 - (2*5 + 1) = 2 tokens dropped
    assert rows(data.train) == [(stream[0:5], stream[1:6]), (stream[5:10], stream[6:11])]
    assert "2 rows of 5 (tail of 2 tokens dropped)" in data.description
    assert "1 empty document(s) skipped" in data.description
    batch = collate_tokens([data.train[0], data.train[1]])
    assert gpt_count(batch) == 10  # every label is a real token


def test_padding_by_hand(corpus):
    data = load_text_data(DataSpec(data=str(corpus), seq_len=3, packing=False))
    assert data.source == "raw-on-the-fly"
    expected = [(ids("abc"), ids("bc") + [E]),            # abc+EOD: 4 tokens = T + 1
                (ids("de"), ids("e") + [E]),               # de+EOD: 3 tokens
                (ids("fgh"), ids("ghi"))]                  # fghij+EOD truncated to 4 tokens
    assert rows(data.train) == expected
    assert data.longest == 3 and "1 truncated to 4 tokens" in data.description
    batch = data.collate([data.train[i] for i in range(3)])
    assert batch["labels"][1].tolist() == [ord("e"), E, IGNORE_INDEX]  # padding is not counted
    assert gpt_count(batch) == 3 + 2 + 3


def test_validation_fraction_holds_out_the_last_documents_exactly(tmp_path):
    lines = [json.dumps({"text": f"document {i:02d}"}) for i in range(10)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(lines) + "\n\n")  # a blank line is no document
    data = load_text_data(DataSpec(data=str(path), seq_len=4, packing=False, val_fraction=0.3))
    # ceil(0.3 * 10) = 3 (in floating point 0.3 * 10 = 3.0000000000000004 would give 4)
    assert len(data.train) == 7 and len(data.val) == 3
    assert bytes(data.val[0]["input_ids"].tolist()) == b"docu"
    assert data.train[6]["input_ids"].tolist() == ids("docu")
    with pytest.raises(ConfigError, match="val_fraction"):
        load_text_data(DataSpec(data=str(path), seq_len=4, val_fraction=0.95))


def test_jsonl_parquet_csv_and_text_give_the_same_documents(tmp_path):
    texts = ["first, with a comma", "second \"quoted\"", "third\nline"]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": t, "n": 1}) + "\n" for t in texts))
    table = pa.table({"n": [1, 2, 3], "body": texts})
    pa.parquet.write_table(table, tmp_path / "d.parquet")
    pa.csv.write_csv(table, tmp_path / "d.csv")
    got = {}
    for name in ("d.jsonl", "d.parquet", "d.csv"):
        data = load_text_data(DataSpec(data=str(tmp_path / name), text_field="body", seq_len=40, packing=False))
        got[name] = [bytes(r[0]).decode() for r in rows(data.train)]
    assert got["d.jsonl"] == got["d.parquet"] == got["d.csv"] == texts


def test_glob_reads_one_document_per_file_in_sorted_order():
    files = sorted(STDLIB_JSON.glob("*.py"))
    data = load_text_data(DataSpec(data=str(STDLIB_JSON / "*.py"), seq_len=64))
    n_tokens = sum(len(f.read_bytes()) + 1 for f in files)
    assert f"{len(files)} documents, {n_tokens:,} tokens" in data.description
    assert len(data.train) == (n_tokens - 1) // 64
    first = files[0].read_bytes()
    assert bytes(data.train[0]["input_ids"].tolist()) == first[:64]


def test_text_errors_strict_names_the_offset_replace_reads_u_fffd(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"ok \xff end")
    with pytest.raises(ConfigError, match=r"bad.txt.*byte offset 3.*--text-errors replace"):
        load_text_data(DataSpec(data=str(tmp_path / "bad.txt"), seq_len=4))
    data = load_text_data(DataSpec(data=str(tmp_path / "bad.txt"), seq_len=40, packing=False, text_errors="replace"))
    assert data.train[0]["input_ids"].tolist() == ids("ok \ufffd end")


def test_hf_tokenizer_rows_are_the_tokenizers_own_ids(bpe_dir):
    from tokenizers import Tokenizer  # the reference: the library itself

    ref = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    eod = ref.token_to_id("<|endoftext|>")
    files = sorted(STDLIB_JSON.glob("*.py"))
    stream = []
    for f in files:
        stream += ref.encode(f.read_text(), add_special_tokens=False).ids + [eod]
    data = load_text_data(DataSpec(data=str(STDLIB_JSON / "*.py"), tokenizer=str(bpe_dir), seq_len=32))
    assert (data.vocab_size, data.eod_id, data.tokenizer_dir) == (ref.get_vocab_size(with_added_tokens=True), eod,
                                                                  str(bpe_dir))
    assert len(data.train) == (len(stream) - 1) // 32
    for i in (0, 7, len(data.train) - 1):
        assert data.train[i]["input_ids"].tolist() == stream[32 * i : 32 * i + 32]
        assert data.train[i]["labels"].tolist() == stream[32 * i + 1 : 32 * i + 33]
    padded = load_text_data(DataSpec(data=str(STDLIB_JSON / "*.py"), tokenizer=str(bpe_dir), seq_len=32,
                                     packing=False))
    first = ref.encode(files[0].read_text(), add_special_tokens=False).ids
    assert padded.train[0]["input_ids"].tolist() == first[:32] and padded.longest == 32


def test_tokenizer_without_end_of_document_is_refused(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"tokenizer=.*end-of-document"):
        load_tokenizer(str(tmp_path))


def test_example_batch_is_the_longest_row_every_label_counted(corpus):
    data = load_text_data(DataSpec(data=str(corpus), seq_len=4, packing=False))
    batch = data.example_batch(3)
    # "fghij" is the longest: 5 tokens + EOD, truncated to 4 -> 4 input tokens
    assert batch["input_ids"].shape == (3, 4) and gpt_count(batch) == 12
    assert int(batch["input_ids"].max()) < 257 and batch["input_ids"].dtype == torch.long
    assert np.array_equal(batch["input_ids"][:, 1:].numpy(), batch["labels"][:, :-1].numpy())
