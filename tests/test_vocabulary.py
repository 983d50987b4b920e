"""The vocabulary's rows agree with what torch and the implementations do (checked against torch, by hand)."""

import pytest
import torch

from trainfit.config import RunConfig, dump_toml, load_toml, make_config
from trainfit.errors import ConfigError
from trainfit.levers.precision import make_precision
from trainfit.plan.shapes import shape_of
from trainfit.presets import HF_PRESETS, resolve_model
from trainfit.vocabulary import (
    DISTRIBUTED,
    PRECISIONS,
    STRATEGIES,
    PrecisionName,
    StrategyName,
    check_compatible,
    refusal,
)

# Written out by hand from the precision table in the README (not read from the vocabulary).
EXPECTED = {  # name: (weights dtype, autocast dtype, loss scaling, FSDP2 (param, reduce) dtypes)
    "fp32": (torch.float32, None, False, (None, None)),
    "bf16-mixed": (torch.float32, torch.bfloat16, False, (torch.bfloat16, torch.float32)),
    "fp16-mixed": (torch.float32, torch.float16, True, (torch.float16, torch.float32)),
    "bf16-true": (torch.bfloat16, None, False, (None, None)),
    "fp16-true": (torch.float16, None, True, (None, None)),
}


def test_every_precision_has_a_row_and_only_those():
    assert set(PRECISIONS) == set(EXPECTED) == set(PrecisionName)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_policy_built_from_its_row_does_what_the_table_says(name):
    weights, autocast, scaling, fsdp = EXPECTED[name]
    p = make_precision(name)
    model = torch.nn.Linear(4, 4)
    p.prepare(model)
    assert model.weight.dtype == weights
    assert p.autocast_dtype == autocast and p.scales_loss is scaling
    assert p.fsdp_policy() == fsdp
    assert p.loss_scale == (2.0**16 if scaling else 1.0)  # GradScaler's default initial scale, or none
    with p.autocast("cpu"):
        out = model(torch.randn(2, 4, dtype=weights))
    assert out.dtype == (autocast or weights)  # what torch itself computes in under the policy


def test_master_copy_rows_are_the_ones_whose_optimizer_updates_fp32_copies():
    for name, facts in PRECISIONS.items():
        p = make_precision(name)
        model = torch.nn.Linear(4, 4)
        p.prepare(model)
        masters = p.optimizer_params(model)
        assert facts.master_copy == any(m is not w for m, w in zip(masters, model.parameters()))
        assert all(m.dtype == torch.float32 for m in masters)


def test_strategies_shard_what_the_zero_paper_says():
    shards = {s.name: set(s.shards) for s in STRATEGIES.values()}
    assert shards == {"single": set(), "ddp": set(), "zero1": {"optimizer"}, "zero2": {"optimizer", "grads"},
                      "zero3": {"optimizer", "grads", "params"}}
    assert set(DISTRIBUTED) == {"ddp", "zero1", "zero2", "zero3"} and set(StrategyName) == set(STRATEGIES)


def test_the_one_compatibility_rule():
    refused = {(s, p) for s in STRATEGIES for p in PRECISIONS if refusal(s, p)}
    assert refused == {("zero2", "bf16-true"), ("zero2", "fp16-true"), ("zero3", "bf16-true"), ("zero3", "fp16-true")}
    with pytest.raises(ConfigError, match="use fp16-mixed: under zero3"):
        check_compatible("zero3", "fp16-true")


def test_config_stores_typed_names_and_writes_plain_strings(tmp_path):
    cfg = make_config({"precision": "bf16-mixed", "strategy": "zero2", "nproc": 2})  # nproc: the old key
    assert cfg.precision is PrecisionName.BF16_MIXED and cfg.strategy is StrategyName.ZERO2 and cfg.devices == 2
    d = cfg.to_dict()
    assert type(d["precision"]) is str and d["precision"] == "bf16-mixed"
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(cfg))
    assert 'precision = "bf16-mixed"' in path.read_text()
    assert make_config(load_toml(path)) == cfg


def test_a_preset_is_the_same_name_in_every_command():
    spec, cfg = resolve_model("llama-7b", "num_hidden_layers=2")
    assert spec == "hf:LlamaForCausalLM" and cfg.endswith(",num_hidden_layers=2")  # the user's key wins (last)
    # Llama 2 7B by hand: 32 layers x (4 x 4096^2 attention + 3 x 4096 x 11008 MLP + 2 x 4096 norms)
    # + 2 x 32000 x 4096 (embedding, head) + 4096 (final norm) = 6,738,415,616 parameters.
    assert shape_of("llama-7b").n_params == 6_738_415_616
    assert shape_of("llama-7b", "num_hidden_layers=2").n_layer == 2
    assert set(HF_PRESETS) == {"llama-7b", "llama-70b"}
    assert RunConfig(model="llama-7b").model == "llama-7b"
