"""Issue 17, the model side: a bad ``--model-config`` or a user model that breaks the protocol is one
line on stderr naming the key (or the callable and the rule it broke) and exit 2, never a traceback.

Every command builds the task the same way (``tasks.make.make_task``), so the cases are spread over
``train``, ``memory`` and ``verify``.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from trainfit.cli import main
from trainfit.errors import ConfigError, ModelError
from trainfit.presets import CNN_MAX_CLASSES, CNNConfig, GPTConfig
from trainfit.tasks.make import make_task


PROGRESS = re.compile(r"^\s*\d+%\|.*step/s")


def _cli(capsys, tmp_path, command: str, *args: str) -> str:
    """Run a command in-process; return its one error line (after asserting exit 2 and one line)."""
    flags = {"train": ["train", "--steps", "1", "--seq", "16", "--run-dir", str(tmp_path / "r")],
             "memory": ["memory", "--estimate", "--batch", "1", "--seq", "16"],
             "memory-measure": ["memory", "--measure", "--batch", "2", "--seq", "16"],
             "verify": ["verify", "--micro-batch", "2", "--accumulation", "2", "--seq", "16"]}[command]
    rc = main([*flags, *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    # train's progress bar (stderr) may have started when the first step fails; it is not an error line
    lines = [ln for ln in err.splitlines() if ln.strip() and not PROGRESS.search(ln)]
    assert len(lines) == 1 and lines[0].startswith("trainfit: error:"), err
    return lines[0]


# ---- 1. the built-in GPT ---------------------------------------------------------------------------

@pytest.mark.parametrize("command, mc, needle", [
    ("train", "dropout=abc", "model_config.dropout='abc' is not valid; allowed: a number in [0, 1)"),  # TypeError
    ("train", "dropout=false", "model_config.dropout=False is not valid; allowed: a number in [0, 1)"),
    ("memory", "dropout=1", "model_config.dropout=1 is not valid; allowed: a number in [0, 1)"),
    ("train", "n_layer=2.5", "model_config.n_layer=2.5 is not valid; allowed: an integer >= 1"),
    ("train", "n_layer=true", "model_config.n_layer=True is not valid; allowed: an integer >= 1"),
    ("memory", "n_layer=-1", "model_config.n_layer=-1 is not valid; allowed: an integer >= 1"),
    ("train", "d_model=0", "model_config.d_model=0 is not valid; allowed: an integer >= 1"),
    ("verify", "mlp_ratio=abc", "model_config.mlp_ratio='abc' is not valid; allowed: an integer >= 1"),
    ("train", "max_seq_len=0", "model_config.max_seq_len=0 is not valid; allowed: an integer >= 1"),
    ("verify", "n_head=3", "model_config.n_head=3 is not valid; allowed: a divisor of d_model=256"),
    # the generated token rules' minimum, named with the key, also below GPTConfig's own minimum of 1
    ("train", "vocab_size=5", "model_config.vocab_size=5 is not valid; allowed: an integer >= 11"),
    ("memory", "vocab_size=0", "model_config.vocab_size=0 is not valid; allowed: an integer >= 11"),
    ("train", "vocab_size=12.0", "model_config.vocab_size=12.0 is not valid; allowed: an integer >= 11"),
])
def test_gpt_model_config_values_name_the_key(capsys, tmp_path, command, mc, needle):
    assert needle in _cli(capsys, tmp_path, command, "--model-config", mc)
    assert not (tmp_path / "r").exists()


def test_gpt_unknown_key_lists_the_gptconfig_fields(capsys, tmp_path):
    line = _cli(capsys, tmp_path, "train", "--model-config", "n_layers=2")
    assert "model_config='n_layers'" in line and "not a field of GPTConfig" in line
    assert "n_layer, vocab_size" in line


def test_gptconfig_checks_types_without_raising_type_errors():
    with pytest.raises(ConfigError, match=r"model_config\.dropout"):
        GPTConfig(dropout="0.1")
    assert GPTConfig(dropout=0).dropout == 0  # an int in range is a number


# ---- 2. the built-in CNN ---------------------------------------------------------------------------

@pytest.mark.parametrize("command, mc, needle", [
    ("train", "channels=0", "model_config.channels=0 is not valid; allowed: an integer >= 1"),  # was RuntimeError
    ("train", "n_classes=0", "model_config.n_classes=0 is not valid; allowed: an integer >= 2"),  # was RuntimeError
    ("memory", "n_classes=1", "model_config.n_classes=1 is not valid; allowed: an integer >= 2"),
    ("verify", "channels=2.5", "model_config.channels=2.5 is not valid; allowed: an integer >= 1"),
    ("memory", "channels=true", "model_config.channels=True is not valid; allowed: an integer >= 1"),
    ("train", f"n_classes={CNN_MAX_CLASSES + 1}", f"allowed: an integer in [2, {CNN_MAX_CLASSES}]"),
    ("memory", "in_channels=1", "model_config='in_channels' is not valid; allowed: one of: channels, n_classes"),
])
def test_cnn_model_config_values_name_the_key(capsys, tmp_path, command, mc, needle):
    assert needle in _cli(capsys, tmp_path, command, "--model", "cnn", "--model-config", mc)


def test_cnn_config_reaches_the_model_and_the_generated_images():
    assert CNNConfig() == CNNConfig(channels=32, n_classes=10)
    task = make_task("cnn", model_config="channels=4,n_classes=3", dataset_size=64)
    model = task.build_model()
    assert model.head.out_features == 3 and model.blocks[0].conv.out_channels == 4
    assert int(task.dataset().labels.max()) <= 2
    loss_sum, count = task.loss(model, task.example_batch(4))
    assert loss_sum.dim() == 0 and count == 4


# ---- 3. hf: models -----------------------------------------------------------------------------------

BERT = ("hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,vocab_size=64,"
        "max_position_embeddings=32")
LLAMA = "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,vocab_size=64"
GPT2 = "n_embd=32,n_head=2,n_layer=1,vocab_size=64,n_positions=32,bos_token_id=1,eos_token_id=1"


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.hf
@pytest.mark.parametrize("command, model, mc, needle", [
    # was ZeroDivisionError (exit 1)
    ("train", "hf:BertForSequenceClassification", f"{BERT},num_labels=0",
     "model_config.num_labels=0 is not valid; allowed: an integer >= 2"),
    ("memory", "hf:BertForSequenceClassification", f"{BERT},num_labels=2.5",
     "model_config.num_labels=2.5 is not valid; allowed: an integer >= 2"),
    ("memory", "hf:ViTForImageClassification", "hidden_size=32,intermediate_size=64,num_hidden_layers=1,"
     "num_attention_heads=2,image_size=8,patch_size=4,num_labels=0", "model_config.num_labels=0"),
    # transformers' StrictDataclass validation errors (two lines) -> one line naming the key
    ("train", "hf:LlamaForCausalLM", LLAMA.replace("num_hidden_layers=1", "num_hidden_layers=2.5"),
     "model_config.num_hidden_layers=2.5 is not valid; allowed: an integer >= 1"),
    ("memory", "hf:LlamaForCausalLM", LLAMA.replace("hidden_size=32", "hidden_size=30").replace(
        "num_attention_heads=2", "num_attention_heads=4"),
     "model_config.hidden_size=30 is not valid; allowed: a value LlamaConfig accepts (transformers: "
     "ValueError: The hidden size (30) is not a multiple of the number of attention heads (4)"),
    ("memory", "hf:LlamaForCausalLM", LLAMA.replace("vocab_size=64", "vocab_size=abc"),
     "model_config.vocab_size='abc' is not valid"),
    ("memory", "hf:LlamaForCausalLM", f"{LLAMA},rms_norm_eps=abc", "model_config.rms_norm_eps='abc' is not valid; "
                                                                  "allowed: a number"),
    # negative and zero sizes: were RuntimeError / ZeroDivisionError at model construction
    ("train", "hf:LlamaForCausalLM", LLAMA.replace("hidden_size=32", "hidden_size=-32"),
     "model_config.hidden_size=-32 is not valid; allowed: an integer >= 1"),
    ("memory", "hf:LlamaForCausalLM", LLAMA.replace("intermediate_size=64", "intermediate_size=-64"),
     "model_config.intermediate_size=-64 is not valid; allowed: an integer >= 1"),
    ("memory", "hf:GPT2LMHeadModel", GPT2.replace("n_embd=32", "n_embd=0"), "model_config.n_embd=0"),
    ("verify", "hf:GPT2LMHeadModel", GPT2.replace("n_positions=32", "n_positions=-3"),
     "model_config.n_positions=-3 is not valid; allowed: an integer >= 1"),
    ("memory", "hf:T5ForConditionalGeneration", "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=0,"
     "d_kv=16,vocab_size=64", "model_config.num_heads=0 is not valid; allowed: an integer >= 1"),
    # a config that passes the config class but not the model's constructor (GPT-2 checks heads there)
    ("memory", "hf:GPT2LMHeadModel", GPT2.replace("n_embd=32", "n_embd=30").replace("n_head=2", "n_head=4"),
     "model_config.n_embd=30 is not valid; allowed: a value GPT2LMHeadModel accepts (transformers: ValueError: "
     "`embed_dim` must be divisible by num_heads"),
    ("memory", "hf:LlamaForCausalLM", f"{LLAMA},hidden_act=nope",
     "model_config.hidden_act='nope' is not valid; allowed: a value LlamaForCausalLM accepts (transformers: KeyError"),
    # a config that fails only in the forward pass (grouped-query attention)
    ("train", "hf:LlamaForCausalLM", f"{LLAMA},num_key_value_heads=3",
     "model_config.num_key_value_heads=3 is not valid; allowed: a divisor of num_attention_heads=2"),
])
def test_hf_configs_transformers_rejects_name_the_key(capsys, tmp_path, transformers, command, model, mc, needle):
    assert needle in _cli(capsys, tmp_path, command, "--model", model, "--model-config", mc)


@pytest.mark.hf
@pytest.mark.parametrize("content, kind", [([1, 2], "list"), ("abc", "str"), (3, "int")])
def test_hf_json_config_that_is_not_an_object(capsys, tmp_path, transformers, content, kind):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    line = _cli(capsys, tmp_path, "memory", "--model", "hf:BertForSequenceClassification", "--model-config",
                str(path))
    assert f"model_config='{path}' is not valid; allowed: a JSON file holding one object" in line
    assert f"it holds a JSON {kind}" in line


@pytest.mark.hf
def test_hf_json_config_values_are_checked_like_overrides(capsys, tmp_path, transformers):
    path = tmp_path / "bert.json"
    path.write_text(json.dumps({"hidden_size": 30, "num_attention_heads": 4, "num_hidden_layers": 1,
                                "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 32}))
    line = _cli(capsys, tmp_path, "train", "--model", "hf:BertForMaskedLM", "--model-config", str(path))
    assert "model_config.hidden_size=30" in line and "not a multiple of the number of attention heads" in line


@pytest.mark.hf
def test_hf_a_valid_tiny_config_still_builds(transformers):
    task = make_task("hf:GPT2LMHeadModel", model_config=GPT2, seq_len=16)
    model = task.build_model()
    loss_sum, count = task.loss(model, task.example_batch(2))
    assert loss_sum.dim() == 0 and int(count) > 0
    task = make_task("hf:LlamaForCausalLM", model_config=f"{LLAMA},num_key_value_heads=1", seq_len=16)
    assert task.build_model().config.num_key_value_heads == 1


@pytest.mark.hf
def test_hf_first_forward_error_is_the_configs_later_ones_pass_through(transformers):
    task = make_task("hf:LlamaForCausalLM", model_config=LLAMA, seq_len=16)
    batch = task.example_batch(2)
    with pytest.raises(ConfigError, match="allowed: a config LlamaForCausalLM's forward pass accepts") as e:
        task.loss(torch.nn.Linear(2, 2), batch)  # no input_ids keyword: TypeError in the forward
    assert "\n" not in str(e.value) and "transformers: TypeError" in str(e.value)
    model = task.build_model()
    task.loss(model, batch)  # one success: later errors are not the config's
    with pytest.raises(TypeError):
        task.loss(torch.nn.Linear(2, 2), batch)


# ---- 4. a user's module:callable that breaks the protocol during the first step ---------------------

USER = '''
import torch
from torch.nn import functional as F


def _batch(n):
    return {"x": torch.randn(n, 4), "y": torch.randint(0, 2, (n,))}


def _sum(m, b):
    return F.cross_entropy(m(b["x"]), b["y"], reduction="sum"), len(b["y"])


def per_item():
    return {"model": torch.nn.Linear(4, 2), "batch": _batch,
            "loss": lambda m, b: (F.cross_entropy(m(b["x"]), b["y"], reduction="none"), len(b["y"]))}


def no_params():
    return {"model": torch.nn.ReLU(), "batch": _batch, "loss": lambda m, b: (m(b["x"]).sum(), len(b["y"]))}


def frozen():
    net = torch.nn.Linear(4, 2).requires_grad_(False)
    return {"model": net, "batch": _batch, "loss": _sum}


def constant():
    return {"model": torch.nn.Linear(4, 2), "batch": _batch, "loss": lambda m, b: (torch.tensor(1.0), len(b["y"]))}


def detached():
    return {"model": torch.nn.Linear(4, 2), "batch": _batch,
            "loss": lambda m, b: (_sum(m, b)[0].detach(), len(b["y"]))}


def no_batch():
    return {"model": torch.nn.Linear(4, 2), "batch": lambda n: None, "loss": _sum}


def raising():
    def loss(m, b):
        raise KeyError("logits")
    return {"model": torch.nn.Linear(4, 2), "batch": _batch, "loss": loss}


def model_raises():
    def build():
        raise ValueError("no such layer")
    return {"model": build, "batch": _batch, "loss": _sum}


def bad_count():
    return {"model": torch.nn.Linear(4, 2), "batch": _batch, "loss": lambda m, b: (_sum(m, b)[0], torch.ones(3))}


def full_task_per_item(seq_len=16, seed=0):
    from trainfit.tasks.builtin import gpt_task
    task = gpt_task("gpt-tiny", seq_len=seq_len, seed=seed, dataset_size=8, overrides="n_layer=1,d_model=32,n_head=2")
    inner = task.loss
    task.loss = lambda m, b: (inner(m, b)[0].reshape(1).expand(3), 1)
    return task


def oom():
    def loss(m, b):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    return {"model": torch.nn.Linear(4, 2), "batch": _batch, "loss": loss}


def data_dependent():
    def loss(m, b):
        raise RuntimeError("cannot run on meta (simulated)")
    return {"model": torch.nn.Linear(4, 2), "batch": _batch, "loss": loss}
'''
DOC = "docs/memory.md, section Models"
LOSS_RULE = "loss(model, batch) must return (loss_sum tensor, count): a scalar sum that requires grad"
MODEL_RULE = "model must be an nn.Module (or a factory returning one) with parameters that require grad"
BATCH_RULE = "batch(n) must return a micro-batch of n samples"


@pytest.fixture
def usermod(tmp_path, monkeypatch):
    name = "tf_protocol_models"
    (tmp_path / f"{name}.py").write_text(USER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("command, fn, what, rule", [
    ("train", "per_item", "loss(model, batch) returned a sum of shape (8,) (per-item losses? return their .sum())",
     LOSS_RULE),
    ("memory-measure", "per_item", "returned a sum of shape (2,)", LOSS_RULE),
    ("train", "no_params", "its ReLU has no parameters to train", MODEL_RULE),
    ("memory", "frozen", "its Linear has no parameters to train (2 parameters, none requires grad)", MODEL_RULE),
    ("train", "constant", "returned a sum that does not require grad (a constant, or detached", LOSS_RULE),
    ("verify", "detached", "returned a sum that does not require grad", LOSS_RULE),
    ("train", "no_batch", "batch(n) returned None", BATCH_RULE),
    ("memory", "no_batch", "batch(n) returned None", BATCH_RULE),
    ("train", "raising", "loss(model, batch) raised KeyError: 'logits' (at tf_protocol_models.py:", LOSS_RULE),
    ("verify", "model_raises", "building the model raised ValueError: no such layer (at tf_protocol_models.py:",
     MODEL_RULE),
    ("train", "bad_count", "returned a count of shape (3,)", LOSS_RULE),
    ("train", "full_task_per_item", "returned a sum of shape (3,)", LOSS_RULE),
])
def test_user_model_breaking_the_protocol_is_one_line(capsys, tmp_path, usermod, command, fn, what, rule):
    line = _cli(capsys, tmp_path, command, "--model", f"{usermod}:{fn}")
    assert f"model='{usermod}:{fn}'" in line
    assert what in line and rule in line and DOC in line


def test_user_loss_out_of_memory_and_meta_errors_pass_through(usermod):
    """auto-fit re-cuts a step on OutOfMemoryError; FLOP counting falls back to CPU on a meta error."""
    task = make_task(f"{usermod}:oom")
    model = task.build_model()
    with pytest.raises(torch.OutOfMemoryError):
        task.loss(model, task.collate([0, 1]))
    task = make_task(f"{usermod}:data_dependent")
    with torch.device("meta"):
        model = task.build_model()
    batch = {k: v.to("meta") for k, v in task.collate([0, 1]).items()}
    with pytest.raises(RuntimeError, match="simulated"):
        task.loss(model, batch)
    with pytest.raises(ModelError, match="raised RuntimeError: cannot run on meta"):  # a real step: the user's
        task.loss(task.build_model(), task.collate([0, 1]))


def test_user_loss_under_no_grad_needs_no_grad(usermod):
    task = make_task(f"{usermod}:detached")
    model = task.build_model()
    with torch.no_grad():
        loss_sum, count = task.loss(model, task.collate([0, 1, 2]))
    assert loss_sum.dim() == 0 and count == 3


def test_a_full_task_is_checked_in_place_once(usermod):
    task = make_task(f"{usermod}:full_task_per_item")
    assert task.loss._trainfit_checked and task.build_model._trainfit_checked
    from trainfit.tasks.user import check_task

    loss = task.loss
    assert check_task("x:y", task).loss is loss  # not wrapped twice
