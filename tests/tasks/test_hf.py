"""hf: tasks build from a config with random weights, no hub access; the loss is a sum over items."""

import json

import pytest
import torch
from torch.nn import functional as F

from trainfit.errors import ConfigError

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")

from trainfit.tasks.make import make_task  # noqa: E402

LLAMA = ("hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=1,"
         "vocab_size=64,max_position_embeddings=32")


def test_causal_lm_loss_is_the_sum_plain_pytorch_gives():
    task = make_task("hf:LlamaForCausalLM", model_config=LLAMA, seq_len=16, seed=1)
    model = task.build_model()
    assert isinstance(model, transformers.LlamaForCausalLM) and model.config.num_hidden_layers == 2
    batch = task.collate([task.dataset()[i] for i in range(3)])
    loss_sum, count = task.loss(model, batch)
    logits = model(input_ids=batch["input_ids"]).logits
    ref = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss_sum, ref)
    assert int(count) == task.count(batch) == int((batch["labels"] != -100).sum())
    assert task.block_names(model) == ["model.layers.0", "model.layers.1"]
    assert (task.depth_key, task.depth) == ("num_hidden_layers", 2)


def test_same_seed_same_weights():
    a = make_task("hf:LlamaForCausalLM", model_config=LLAMA, seq_len=16, seed=3).build_model()
    b = make_task("hf:LlamaForCausalLM", model_config=LLAMA, seq_len=16, seed=3).build_model()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_json_config_then_overrides(tmp_path):
    path = tmp_path / "bert.json"
    path.write_text(json.dumps({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                                "num_attention_heads": 2, "vocab_size": 64, "max_position_embeddings": 32}))
    task = make_task("hf:BertForMaskedLM", model_config=f"{path},num_hidden_layers=1", seq_len=16)
    model = task.build_model()
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32
    batch = task.example_batch(2)
    loss_sum, count = task.loss(model, batch)
    assert torch.isfinite(loss_sum) and int(count) == (batch["labels"] != -100).sum() > 0


@pytest.mark.parametrize("arch, mc", [
    ("T5ForConditionalGeneration", "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,vocab_size=64"),
    ("ViTForImageClassification", "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,"
                                   "image_size=8,patch_size=4,num_labels=3"),
    ("BertForSequenceClassification", "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,"
                                      "vocab_size=64,max_position_embeddings=32,num_labels=3"),
])
def test_other_heads_give_a_finite_summed_loss(arch, mc):
    task = make_task(f"hf:{arch}", model_config=mc, seq_len=8)
    model = task.build_model()
    batch = task.example_batch(2)
    loss_sum, count = task.loss(model, batch)
    assert loss_sum.dim() == 0 and torch.isfinite(loss_sum)
    assert int(count) == task.count(batch) > 0
    loss_sum.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad and p.grad is not None)


@pytest.mark.parametrize("model, mc, needle", [
    ("hf:LlamaForCausalLm", "", "check the class name's spelling"),
    ("hf:LlamaModel", "", "ends with one of: ForCausalLM"),
    ("hf:LlamaForCausalLM", "hidden_sise=32", "hidden_sise"),
    ("hf:LlamaForCausalLM", "no/such/config.json", "an existing JSON config file"),
    ("hf:LlamaForCausalLM", LLAMA.replace("max_position_embeddings=32", "max_position_embeddings=8"),
     "add max_position_embeddings=16"),
])
def test_bad_hf_specs(model, mc, needle):
    with pytest.raises(ConfigError, match=None) as e:
        make_task(model, model_config=mc, seq_len=16)
    assert needle in str(e.value)


def test_a_llama_preset_builds_in_memory_as_it_plans(capsys):
    """``--model llama-7b`` is the same name in memory as in plan (it was refused outside plan)."""
    from trainfit.cli import main

    small = "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=4," \
            "vocab_size=256"
    assert main(["memory", "--model", "llama-7b", "--model-config", small, "--seq", "32", "--batch", "2",
                 "--estimate", "--devices", "2", "--strategy", "zero3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # By hand: 2 x (4 x 64^2 attention + 3 x 64 x 128 MLP + 2 x 64 norms) + 2 x 256 x 64 + 64 = 115,008.
    assert out["n_params"] == 115_008
    task = make_task("llama-7b", model_config=small, seq_len=32)
    assert isinstance(task.build_model(), transformers.LlamaForCausalLM)
