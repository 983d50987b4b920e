"""Which precision each strategy can run, and why not (pure: no torch, no process group).

One table, read by the strategies before anything is built, so a bad combination fails
with its reason before the first step.
"""

from __future__ import annotations

from trainfit.errors import ConfigError

DISTRIBUTED = ("ddp", "zero1", "zero2", "zero3")
FSDP_STRATEGIES = ("zero2", "zero3")

_FSDP_TRUE_HALF = (
    "the fp32 master copies of {precision} live outside the model, so FSDP2 cannot shard them "
    "(every rank would hold all of them) and the half weights it would shard are not what the optimizer updates; "
    "use {mixed}: under {strategy} FSDP2 keeps the weights sharded in fp32 (the master copy, sharded) and computes "
    "in {half} (MixedPrecisionPolicy param_dtype={half}, reduce_dtype=float32){scaler}"
)

UNSUPPORTED: dict[tuple[str, str], str] = {
    (s, p): _FSDP_TRUE_HALF.format(
        precision=p, strategy=s, mixed=p.replace("-true", "-mixed"), half=p.split("-")[0],
        scaler=", with a loss scaler that checks each rank's gradient shard and agrees on overflow across ranks"
        if p.startswith("fp16") else "")
    for s in FSDP_STRATEGIES for p in ("bf16-true", "fp16-true")
}
"""(strategy, precision) -> why the pair is refused."""

FSDP_DTYPES: dict[str, tuple[str | None, str | None]] = {
    "fp32": (None, None),
    "bf16-mixed": ("bfloat16", "float32"),
    "fp16-mixed": ("float16", "float32"),
}
"""precision -> FSDP2 MixedPrecisionPolicy (param_dtype, reduce_dtype). Gradients are always
reduced in fp32: a bf16 reduce-scatter over many ranks loses the low bits of the sum."""


def check_precision(strategy: str, precision: str) -> None:
    """Raise ConfigError when ``strategy`` cannot run ``precision``."""
    why = UNSUPPORTED.get((strategy, precision))
    if why:
        raise ConfigError("precision", precision, f"fp32, bf16-mixed or fp16-mixed with strategy={strategy}", why)


def resolve_accumulation(*, global_batch: int, micro_batch: int, accumulation: int, world_size: int) -> int:
    """Micro-batches per step on each rank so the world processes ``global_batch`` samples per step.

    ``global_batch=0`` keeps ``accumulation`` as configured (the global batch then grows with the world).
    """
    if global_batch == 0:
        return accumulation
    per_rank, rest = divmod(global_batch, world_size)
    if rest:
        raise ConfigError("global_batch", global_batch, f"a multiple of the world size {world_size}",
                          f"each of the {world_size} ranks must take the same number of samples per step")
    acc, rest = divmod(per_rank, micro_batch)
    if rest or acc < 1:
        raise ConfigError("global_batch", global_batch,
                          f"a multiple of world_size x micro_batch = {world_size} x {micro_batch} = {world_size * micro_batch}",
                          f"each rank's {per_rank} samples per step must split into micro-batches of {micro_batch}")
    return acc
