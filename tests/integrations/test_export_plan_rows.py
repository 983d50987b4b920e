"""The other tools' spellings in the strategy and precision rows (what ``plan --write-for`` writes) are names those
tools define, checked against the tools' own objects: accelerate's enums, Lightning's registries, torch's FSDP1
sharding strategies."""

from __future__ import annotations

import typing

import pytest

from trainfit.vocabulary import PRECISIONS, STRATEGIES, Dtype


@pytest.mark.parametrize("name", list(STRATEGIES), ids=str)
def test_a_strategy_rows_tool_names_are_the_tools_own(name):
    from accelerate.utils import DistributedType
    from lightning.pytorch.strategies import StrategyRegistry
    from torch.distributed.fsdp import ShardingStrategy

    s = STRATEGIES[name]
    kind = DistributedType(s.accelerate_distributed_type)
    assert (kind == DistributedType.NO) == (not s.distributed) and (kind == DistributedType.FSDP) == s.fsdp
    assert s.lightning_strategy == "auto" if not s.distributed else s.lightning_strategy in StrategyRegistry
    if s.fsdp:
        # FSDP1's names for the ZeRO stages (torch's ShardingStrategy docs): FULL_SHARD frees the gathered
        # parameters after forward (zero3), SHARD_GRAD_OP keeps them until backward is done (zero2).
        assert ShardingStrategy[s.fsdp_sharding_strategy] == (
            ShardingStrategy.FULL_SHARD if s.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP)
    else:
        assert s.fsdp_sharding_strategy == ""


@pytest.mark.parametrize("name", list(PRECISIONS), ids=str)
def test_a_precision_rows_tool_names_are_the_tools_own(name):
    from accelerate.utils import PrecisionType
    from lightning.fabric.connector import _PRECISION_INPUT_STR

    p = PRECISIONS[name]
    lightning = typing.get_args(_PRECISION_INPUT_STR)
    assert p.lightning in lightning
    # Lightning spells the dtype first and autocast as "-mixed", its own half weights as "-true"
    assert p.lightning.startswith({Dtype.FP32: "32", Dtype.BF16: "bf16", Dtype.FP16: "16"}[p.compute])
    assert p.lightning.endswith("-mixed") == (p.autocast is not None)
    if p.master_copy:
        assert p.accelerate is None  # accelerate has no master-copy mode: such a row is refused, not written
    else:
        assert PrecisionType(p.accelerate) == {Dtype.FP32: PrecisionType.NO, Dtype.BF16: PrecisionType.BF16,
                                               Dtype.FP16: PrecisionType.FP16}[p.compute]
