"""Frozen weights and LoRA under ddp, zero1, zero2 and zero3 on 2 gloo ranks; the export gathers the whole model."""

from __future__ import annotations

import shutil

import pytest
import torch

from distributed.harness import errors, spawn

from .conftest import save_llama
from .workers import CASES, train_and_export

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.hf]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("weights-dist")
    save_llama(root / "llama")
    assert spawn(train_and_export, root) == [0, 0], errors(root)
    return root


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_strategies_train_around_frozen_weights_and_export_the_whole_model(job, name):
    seen = torch.load(job / f"{name}.pt", weights_only=True)
    assert seen["n_frozen"] > 0 and seen["n_moved"] > 0
    assert seen["grads_of_frozen"] == [] and seen["state_of_frozen"] == [] and seen["moved_frozen"] == []
    exported = transformers.AutoModelForCausalLM.from_pretrained(job / name / "model")
    with torch.no_grad():
        got = exported(input_ids=seen["ids"]).logits
    torch.testing.assert_close(got, seen["logits"], atol=1e-5 if "lora" in name else 1e-6, rtol=0)


def test_init_from_a_sharded_checkpoint(job, tmp_path):
    """The zero3 run's DCP checkpoint, read whole by one process, holds what its export holds."""
    from trainfit.config import make_config
    from trainfit.run import build_run

    shutil.copytree(job / "zero3-freeze" / "checkpoints", tmp_path / "source" / "checkpoints")
    run = build_run(make_config(dict(model=f"hf:{job / 'llama'}", seq_len=16, init_from=str(tmp_path / "source"),
                                     run_dir=str(tmp_path / "run"))))
    want = transformers.AutoModelForCausalLM.from_pretrained(job / "zero3-freeze" / "model").state_dict()
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, want[k]), k
