"""A throwaway strategy, added as one row and nothing else: zero3's facts under a new name, registered through
``vocabulary.register_strategy`` (no other file edited). From its row alone it plans, trains 2 steps on 2 gloo
ranks (against plain PyTorch), offloads by its row's rules and is written for another tool (checked by the tool's
own objects) -- the "adding a strategy" walk-through of docs/architecture.md, end to end.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

import trainfit.plan.search  # noqa: F401 -- loaded before the row exists, as in a session that planned before it
from trainfit.errors import ConfigError
from trainfit.vocabulary import STRATEGIES, register_strategy, strategy_facts, unregister_strategy

ROW = "zero3-copy"
STEPS = 2


def install_row() -> None:
    """The row, once per process (the spawned ranks call it too: a row lives in the process that registered it)."""
    if ROW not in STRATEGIES:
        register_strategy(dataclasses.replace(STRATEGIES["zero3"], name=ROW, label="a copy of zero3's facts"))


@pytest.fixture
def row():
    install_row()
    yield ROW
    unregister_strategy(ROW)


# ---- it plans ------------------------------------------------------------------------------------------------
def _plan(devices: int = 2):
    from trainfit.plan.cost import Basis, Links
    from trainfit.plan.rules import Context
    from trainfit.plan.search import SearchSpace, search

    def basis(precision, checkpointing):  # 1000 fp32 parameters in 4 blocks, AdamW (8 bytes of state each)
        return Basis(precision=precision, checkpointing=checkpointing, n_params=1000, n_blocks=4, params_bytes=4000.0,
                     grads_bytes=4000.0, grads_at_peak_bytes=4000.0, optimizer_bytes=8000.0,
                     compute_bytes_per_param=4.0, act_fixed_bytes=100.0, act_per_sample_bytes=1000.0,
                     temp_fixed_bytes=0.0, temp_per_sample_bytes=50.0, step_temp_bytes=0.0,
                     model_flops_per_sample=6e6, hardware_flops_per_sample=6e6, grad_comm_bytes=4000.0,
                     param_comm_bytes=4000.0, source="test")

    space = SearchSpace(global_batch=8, devices=devices, memory_bytes=10**9, precisions=("fp32", "bf16-true"),
                        checkpointings=("none",), offloads=("", "optimizer"))
    result = search(space, ctx=Context(devices=devices, dtypes=("fp32", "bf16")), basis=basis,
                    links=lambda p, c: Links(flops_per_s=1e9, bandwidth_bytes_per_s=1e8, host_bytes_per_s=1e9))
    return space, result


def _key(e):
    return (e.precision, e.micro_batch, e.grad_sync, e.offload)


def test_the_row_is_searched_and_sharded_by_its_facts(row):
    space, result = _plan()
    assert row in space.strategies  # the default search space reads the table when built
    mine = {_key(e): e for e in result.entries if e.strategy == row}
    zero3 = {_key(e): e for e in result.entries if e.strategy == "zero3"}
    assert mine and mine.keys() == zero3.keys()
    # By hand, 2 devices, 4 blocks of 1000 fp32 parameters: params 4000/2 sharded + one block (1000) gathered at
    # the peak; AdamW state 8000/2; zero3's optimizer offload moves the parameters with it (its row names params).
    resident = mine[("fp32", 2, "deferred", "")]
    assert resident.parts["params"] == 4000 / 2 + 4000 / 4 and resident.parts["optimizer"] == 8000 / 2
    offloaded = mine[("fp32", 2, "deferred", "optimizer,params")]
    assert offloaded.parts["optimizer"] == 0 and offloaded.parts["params"] == 4000 / 4
    assert {e.peak_bytes_per_device for e in mine.values()} and all(
        mine[k].peak_bytes_per_device == zero3[k].peak_bytes_per_device for k in mine)
    # the rules read the row too: a master-copy precision is refused under FSDP2, per-micro-batch sync allowed
    assert not any(k[0] == "bf16-true" for k in mine)
    assert any(k[2] == "per-micro-batch" for k in mine)
    assert any(f"strategy={row} + precision=bf16-true" in why for why in result.excluded)


def test_the_rows_step_time_prices_its_collectives(row):
    _, result = _plan()
    mine = {_key(e): e.exposed_comm_s for e in result.entries if e.strategy == row}
    zero3 = {_key(e): e.exposed_comm_s for e in result.entries if e.strategy == "zero3"}
    assert mine == zero3 and max(mine.values()) > 0


# ---- offload reads the row ------------------------------------------------------------------------------------
def test_offload_rules_read_the_row(row):
    from trainfit.levers.offload_rules import offload_choices, offload_price, plan_offload

    assert offload_choices(row) == ("", "optimizer,params", "activations", "activations,optimizer,params")
    with pytest.raises(ConfigError, match=f"optimizer and params together under {row}"):
        plan_offload("optimizer", row)
    plan = plan_offload("optimizer,params", row)
    assert plan.fsdp_cpu_offload and not plan.host_optimizer
    # by hand: 1000 params on 2 ranks, 2 micro-batches: fp32 shard of 500 down once, up twice per micro-batch
    price = offload_price(parts=plan.parts, strategy=row, n_params=1000, world_size=2, accumulation=2)
    assert [(t.part, t.down_bytes, t.up_bytes, t.frees_device_bytes) for t in price.traffic] == [
        ("optimizer,params", 4 * 500, 4 * 500 * 2 * 2, (4 + 4 + 8) * 500)]


# ---- it trains on 2 gloo ranks --------------------------------------------------------------------------------
def _cfg(root, name, **kw):
    from distributed.harness import BASE

    from trainfit.config import make_config

    return make_config({**BASE, "steps": STEPS, "run_dir": str(root / name), "strategy": ROW, **kw})


def train_the_row(rank, root) -> None:
    """Inside each rank: install the row, train it 2 steps resident and with its optimizer and parameters
    offloaded, and say which strategy class the row built and whether the parameters are sharded."""
    from torch.distributed.tensor import DTensor

    from trainfit.run import build_run
    from trainfit.train import train

    install_row()
    train(_cfg(root, "resident"), progress=False)
    train(_cfg(root, "offloaded", offload="optimizer,params"), progress=False)
    run = build_run(_cfg(root, "probe"))
    params = list(run.model.parameters())
    if rank == 0:
        (root / "probe.json").write_text(json.dumps({
            "class": type(run.strategy).__name__, "name": run.strategy.name,
            "sharded": all(isinstance(p, DTensor) for p in params),
            "local": sum(p.to_local().numel() for p in params), "whole": sum(p.numel() for p in params)}))


@pytest.mark.distributed
@pytest.mark.slow
def test_the_row_trains_on_two_gloo_ranks_as_plain_pytorch(tmp_path):
    from distributed.harness import errors, max_rel_err, read_dcp_model, reference_params, spawn

    codes = spawn(train_the_row, tmp_path)
    assert codes == [0, 0], errors(tmp_path)
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["class"] == "FSDP" and probe["name"] == ROW and probe["sharded"]
    assert probe["local"] < probe["whole"]  # this rank holds a shard of the parameters, not all of them
    reference = reference_params(STEPS)[STEPS]  # plain PyTorch, one process, the 8-sample batch per step
    for name in ("resident", "offloaded"):
        got = read_dcp_model(tmp_path / name / "checkpoints" / f"step-{STEPS:08d}.dcp")
        assert max_rel_err(got, reference) < 1e-5, name


# ---- it is written for another tool ---------------------------------------------------------------------------
def test_the_row_is_written_for_accelerate_and_lightning(row, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType
    from lightning.pytorch.cli import instantiate_class
    from lightning.pytorch.strategies import FSDPStrategy

    from trainfit.config import make_config
    from trainfit.integrations.export_plan import export_plan

    cfg = make_config({"strategy": row, "devices": 2, "micro_batch": 2, "accumulation": 2,
                       "offload": "optimizer,params"})
    acc = export_plan("accelerate", cfg)
    (tmp_path / "acc.yaml").write_text(acc.text)
    loaded = load_config_from_file(str(tmp_path / "acc.yaml"))  # accelerate's own loader
    assert loaded.distributed_type == DistributedType.FSDP and loaded.num_processes == 2
    assert loaded.fsdp_config["fsdp_reshard_after_forward"] is True  # zero3's facts: parameters resharded
    assert loaded.fsdp_config["fsdp_offload_params"] is True
    light = export_plan("lightning", cfg)
    built = instantiate_class((), light.values["trainer"]["strategy"])  # Lightning's own strategy object
    assert isinstance(built, FSDPStrategy)
    assert built.sharding_strategy.name == "FULL_SHARD" and built.cpu_offload.offload_params is True
    # On CPU processes no tool runs FSDP: refused in one line, naming the row
    with pytest.raises(ConfigError) as e:
        export_plan("lightning", cfg, cpu=True)
    assert "\n" not in str(e.value) and row in str(e.value) and "CUDA" in str(e.value)


def test_the_row_is_gone_after_unregistering():
    install_row()
    unregister_strategy(ROW)
    with pytest.raises(ValueError):
        strategy_facts(ROW)
    with pytest.raises(ConfigError):
        from trainfit.config import make_config

        make_config({"strategy": ROW})


def test_registering_leaves_the_enum_as_defined_and_config_lists_the_row():
    from trainfit.config import make_config
    from trainfit.vocabulary import StrategyName

    built_in = list(StrategyName)
    install_row()
    try:
        assert list(StrategyName) == built_in  # the enum's own members are untouched
        member = StrategyName(ROW)  # found by value through Enum's _missing_ hook
        assert isinstance(member, StrategyName) and member == ROW and member.value == ROW
        assert make_config({"strategy": ROW}).strategy is member
        with pytest.raises(ConfigError) as e:
            make_config({"strategy": "zero9"})
        assert ROW in str(e.value) and "zero3" in str(e.value)  # the refusal lists the added row among the allowed
    finally:
        unregister_strategy(ROW)
    assert list(StrategyName) == built_in
