"""How a global batch splits over ranks (pure: no torch).

Which precision a strategy can run is the vocabulary's rule (:func:`trainfit.vocabulary.check_compatible`).
"""

from __future__ import annotations

from trainfit.errors import ConfigError


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
