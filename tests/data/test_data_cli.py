"""``--data`` through the CLI: every bad input is one line, exit 2, nothing written; short real runs."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet
import pytest

from tests.data.conftest import STDLIB_JSON
from tests.reliability.cli_harness import check_promise, cli, error_lines, snapshot

GLOB = str(STDLIB_JSON / "*.py")
FAST = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq-len", "32", "--micro-batch", "2",
        "--accumulation", "1"]


def _write(tmp_path, name: str, content) -> str:
    path = tmp_path / "in" / name
    path.parent.mkdir(exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        pa.parquet.write_table(content, path)
    return str(path)


BAD = {  # name: (files to write, flags, what the one line must say)
    "missing path": ({}, ["--data", "{tmp}/nope.txt"], "data="),
    "glob matching nothing": ({}, ["--data", "{tmp}/*.md"], "a glob matching at least one file"),
    "all documents empty": ({"e.jsonl": '{"text": ""}\n'}, ["--data", "{in}/e.jsonl"], "non-empty document"),
    "jsonl line not json": ({"d.jsonl": '{"text": "a"}\n{oops\n'}, ["--data", "{in}/d.jsonl"], "d.jsonl:2"),
    "jsonl without the field": ({"d.jsonl": '{"body": "a"}\n'}, ["--data", "{in}/d.jsonl"], "text_field='text'"),
    "field not a string": ({"d.jsonl": '{"text": 3}\n'}, ["--data", "{in}/d.jsonl"], "d.jsonl:1 holds a JSON int"),
    "not utf-8": ({"b.txt": b"abc\xc3("}, ["--data", "{in}/b.txt"], "byte offset 3"),
    "unknown extension": ({"x.docx": "a"}, ["--data", "{in}/x.docx"], ".jsonl, .parquet, .csv"),
    "tokenizer without tokenizer.json": ({"a.txt": "abc"}, ["--data", "{in}/a.txt", "--tokenizer", "{in}"],
                                         "a directory holding tokenizer.json"),
    "parquet without the column": ({"t.parquet": pa.table({"body": ["a"], "id": [1]})},
                                   ["--data", "{in}/t.parquet"], "one of the columns: body, id"),
    "csv without the column": ({"t.csv": "body,id\nhello,1\n"}, ["--data", "{in}/t.csv"], "body, id"),
}


def _run(tmp_path, files, flags, command):
    for name, content in files.items():
        _write(tmp_path, name, content)
    (tmp_path / "in").mkdir(exist_ok=True)
    flags = [f.format(tmp=tmp_path, **{"in": tmp_path / "in"}) for f in flags]
    before = snapshot(tmp_path)
    out = ["--out", str(tmp_path / "prepared")] if command == "prepare" else ["--run-dir", str(tmp_path / "run"),
                                                                                "--steps", "1"]
    r = cli([command, *flags, *out])
    check_promise(r, tmp_path, before)
    return r


@pytest.mark.parametrize("command", ["train", "prepare"])
@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_data_is_one_line_exit_2_nothing_written(tmp_path, case, command):
    files, flags, says = BAD[case]
    r = _run(tmp_path, files, flags, command)
    assert r.rc == 2, r.err
    line = [ln for ln in error_lines(r.err) if ln.startswith("trainfit: error:")][0]
    assert says in line, line


MODEL_BAD = {
    "vocab below the tokenizer's": (["--model-config", "vocab_size=100"], "model_config.vocab_size=100"),
    "seq_len above max positions": (["--model", "hf:LlamaForCausalLM", "--model-config",
                                     "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,"
                                     "num_key_value_heads=2,max_position_embeddings=16", "--seq-len", "32"],
                                    "seq_len=32"),
    "a model that reads no files": (["--model", "cnn"], "data files feed"),
    "a non-causal hf head": (["--model", "hf:BertForSequenceClassification", "--model-config",
                              "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2"],
                             "data files feed"),
    "val_fraction holding out everything": (["--val-fraction", "0.9"], "val_fraction=0.9"),
}


@pytest.mark.parametrize("case", list(MODEL_BAD), ids=list(MODEL_BAD))
def test_data_the_model_cannot_take_is_refused(tmp_path, case):
    flags, says = MODEL_BAD[case]
    r = _run(tmp_path, {"a.txt": "abc " * 40}, ["--data", "{in}/a.txt", *flags], "train")
    assert r.rc == 2 and says in error_lines(r.err)[-1], r.err


def test_train_on_stdlib_text_then_on_its_prepared_directory(tmp_path):
    r = cli(["train", "--data", GLOB, "--steps", "3", "--run-dir", str(tmp_path / "raw"), "--val-fraction", "0.2",
             *FAST])
    assert r.rc == 0, r.err
    assert "gpt-tiny vocab_size=257 from tokenizer byte" in r.err and "packed into" in r.err
    losses = [json.loads(ln)["loss"] for ln in (tmp_path / "raw" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in ln]
    assert len(losses) >= 3 and all(loss == loss for loss in losses)
    r = cli(["prepare", "--data", GLOB, "--out", str(tmp_path / "p")])
    assert r.rc == 0 and "5 documents" in r.out, r.err
    r = cli(["train", "--data", str(tmp_path / "p"), "--steps", "2", "--packing", "off",
             "--run-dir", str(tmp_path / "prep"), *FAST])
    assert r.rc == 0, r.err
    assert "one per row padded per micro-batch" in r.err
