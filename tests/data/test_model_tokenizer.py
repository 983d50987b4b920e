"""The model's own tokenizer by default (issue 27, rows 2, 3 and 11): ``--model hf:DIR`` reads its data with
DIR's tokenizer.json; a prepared directory's tokenizer must be the one the job uses; config.toml records the one
used; an eos_token the vocabulary lacks is refused. References: the ``tokenizers`` library's own encode."""

from __future__ import annotations

import contextlib
import io
import json
import tomllib
from pathlib import Path

import pytest

from trainfit.cli import main
from trainfit.config import RunConfig
from trainfit.errors import ConfigError
from trainfit.tasks.files import clear_cache, load_text_data
from trainfit.tasks.spec import DataSpec
from trainfit.tasks.tokenizer import load_tokenizer

from .conftest import STDLIB_JSON

EOS = "<|endoftext|>"
TEXT = "def encode(obj):\n    return JSONEncoder().encode(obj)  # the quick brown fox jumps over the lazy dog\n" * 4


def cli(*args: str) -> tuple[int, str]:
    """``trainfit ARGS`` in this process: (exit status, stderr)."""
    clear_cache()
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = e.code
    return int(rc or 0), err.getvalue()


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def bpe(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p.read_text() for p in sorted(STDLIB_JSON.glob("*.py"))], trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved with save_pretrained beside its own 280-id BPE (tokenizer.json, tokenizer_config.json)."""
    transformers = pytest.importorskip("transformers")
    import torch

    tok = bpe(280)
    out = tmp_path_factory.mktemp("ckpt") / "llama"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(out)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, eos_token_id=tok.token_to_id(EOS))
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


TRAIN = ("--seq-len", "16", "--micro-batch", "2", "--accumulation", "1", "--steps", "1")


def recorded_tokenizer(run: Path) -> str:
    return tomllib.loads((run / "config.toml").read_text())["data"]["tokenizer"]


def test_row2_hf_dir_reads_its_own_tokenizer(model_dir, corpus, tmp_path):
    """Row 2: the directory's tokenizer.json was ignored; the model was fine-tuned on byte ids."""
    from tokenizers import Tokenizer

    rc, err = cli("train", "--model", f"hf:{model_dir}", "--data", str(corpus), *TRAIN, "--run-dir",
                  str(tmp_path / "run"))
    assert rc == 0, err
    assert recorded_tokenizer(tmp_path / "run") == str(model_dir)
    assert (tmp_path / "run" / "model" / "tokenizer.json").is_file()  # exported beside the model it feeds
    reference = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = reference.encode(TEXT, add_special_tokens=False).ids + [reference.token_to_id(EOS)]
    data = load_text_data(DataSpec.from_config(RunConfig(model=f"hf:{model_dir}", data=str(corpus), seq_len=16)))
    assert data.train[0]["input_ids"].tolist() == ids[:16]
    assert data.train[1]["labels"].tolist() == ids[17:33]


def test_row2_an_explicit_tokenizer_says_otherwise(model_dir, corpus):
    spec = DataSpec.from_config(RunConfig(model=f"hf:{model_dir}", data=str(corpus), tokenizer="byte"))
    assert spec.tokenizer == "byte"
    assert load_text_data(spec).train[0]["input_ids"].tolist() == list(TEXT.encode()[:64])


def test_row2_data_prepared_with_another_tokenizer_than_the_models_is_refused(model_dir, corpus, tmp_path):
    """Row 2: byte ids prepared earlier fed a BPE model without a word."""
    assert cli("prepare", "--data", str(corpus), "--out", str(tmp_path / "prep"))[0] == 0
    rc, err = cli("train", "--model", f"hf:{model_dir}", "--data", str(tmp_path / "prep"), *TRAIN, "--run-dir",
                  str(tmp_path / "run"))
    line = one_line(err)
    assert rc == 2 and line.startswith(f"trainfit: error: tokenizer='{model_dir}'") and "prepared with (byte)" in line
    assert not (tmp_path / "run").exists()


def test_row2_data_prepared_with_the_models_tokenizer_trains(model_dir, corpus, tmp_path):
    assert cli("prepare", "--data", str(corpus), "--tokenizer", str(model_dir), "--out", str(tmp_path / "prep"))[0] == 0
    rc, err = cli("train", "--model", f"hf:{model_dir}", "--data", str(tmp_path / "prep"), *TRAIN, "--run-dir",
                  str(tmp_path / "run"))
    assert rc == 0, err
    assert recorded_tokenizer(tmp_path / "run") == str(model_dir)


def test_row3_explicit_tokenizer_other_than_the_prepared_dirs_is_refused(bpe_dir, corpus, tmp_path):
    """Row 3: ``--tokenizer byte`` on a BPE-prepared directory trained with BPE and recorded "byte"."""
    assert cli("prepare", "--data", str(corpus), "--tokenizer", str(bpe_dir), "--out", str(tmp_path / "prep"))[0] == 0
    rc, err = cli("train", "--data", str(tmp_path / "prep"), "--tokenizer", "byte", *TRAIN,
                  "--run-dir", str(tmp_path / "run"))
    line = one_line(err)
    assert rc == 2 and line.startswith("trainfit: error: tokenizer='byte'") and f"prepared with ({bpe_dir})" in line
    assert not (tmp_path / "run").exists()


def test_row3_config_records_the_prepared_dirs_tokenizer(bpe_dir, corpus, tmp_path):
    assert cli("prepare", "--data", str(corpus), "--tokenizer", str(bpe_dir), "--out", str(tmp_path / "prep"))[0] == 0
    rc, err = cli("train", "--data", str(tmp_path / "prep"), "--model-config", "n_layer=1,d_model=16,n_head=2",
                  *TRAIN, "--run-dir", str(tmp_path / "run"))
    assert rc == 0, err
    prepared = json.loads((tmp_path / "prep" / "prepared.json").read_text())["tokenizer"]["name"]
    assert recorded_tokenizer(tmp_path / "run") == prepared == str(bpe_dir.resolve())


def test_row11_eos_token_outside_the_vocabulary_is_refused(corpus, tmp_path):
    """Row 11: tokenizer_config.json's eos_token missing from the vocabulary fell back to another id (0 here)."""
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    bpe(270).save(str(tok_dir / "tokenizer.json"))  # holds <|endoftext|> at id 0
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s-not-here>"}))
    with pytest.raises(ConfigError, match=r"tokenizer=.*eos_token='</s-not-here>'"):
        load_tokenizer(str(tok_dir))
    rc, err = cli("train", "--data", str(corpus), "--tokenizer", str(tok_dir), *TRAIN, "--run-dir",
                  str(tmp_path / "run"))
    assert rc == 2 and "eos_token='</s-not-here>'" in one_line(err)


def test_a_tokenizer_larger_than_the_models_embeddings_is_refused(model_dir, bpe_dir, corpus, tmp_path):
    assert load_tokenizer(str(bpe_dir)).vocab_size > load_tokenizer(str(model_dir)).vocab_size  # 300 > 280
    rc, err = cli("train", "--model", f"hf:{model_dir}", "--data", str(corpus), "--tokenizer", str(bpe_dir), *TRAIN,
                  "--run-dir", str(tmp_path / "run"))
    line = one_line(err)
    assert rc == 2 and line.startswith(f"trainfit: error: tokenizer='{bpe_dir}'") and "at most 280 ids" in line
