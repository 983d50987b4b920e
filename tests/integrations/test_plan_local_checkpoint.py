"""``plan --model hf:DIR`` (issue 28, row 4): a local ``save_pretrained`` checkpoint is planned wherever
``train --model hf:DIR`` and ``memory --estimate --model hf:DIR`` take it -- with ``--lora``/``--freeze`` and
with ``--from FILE``. The plan builds the model on the meta device (shapes only), so the weights are not read.

The reference for the parameter count is transformers' own model built from DIR (``from_pretrained``).
"""

from __future__ import annotations

import json

import pytest

from tests.reliability.cli_harness import cli

transformers = pytest.importorskip("transformers")
BASE = ["--device", "cpu", "--device-memory", "1GiB", "--seq-len", "16", "--precisions", "fp32",
        "--checkpointings", "none", "--strategies", "single", "--top", "1", "--json"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import torch

    d = tmp_path_factory.mktemp("ckpt") / "model"
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    return d


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFIT_CACHE_DIR", str(tmp_path / "cache"))  # traced now, not read from an older run


def _n_params(d) -> int:
    return sum(p.numel() for p in transformers.GPT2LMHeadModel.from_pretrained(d).parameters())


def test_plan_a_local_checkpoint_with_freeze(ckpt):
    r = cli(["plan", "--model", f"hf:{ckpt}", "--global-batch", "4", *BASE, "--freeze", "transformer.wpe.*"])
    assert r.rc == 0, r.err
    row = json.loads(r.out)["plans"][0]
    assert row["fits"] and row["micro_batch"] * row["accumulation"] == 4
    assert row["peak_bytes_per_device"] > 4 * _n_params(ckpt)  # at least the checkpoint's fp32 weights


def test_plan_a_local_checkpoint_with_lora_from_a_training_arguments_file(ckpt, tmp_path):
    pytest.importorskip("peft")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3}))
    r = cli(["plan", "--model", f"hf:{ckpt}", "--from", str(args), *BASE, "--lora", "r=2,alpha=4,targets=c_attn"])
    assert r.rc == 0, r.err
    row = json.loads(r.out)["plans"][0]
    assert row["fits"] and row["micro_batch"] * row["accumulation"] == 6  # the file's global batch
