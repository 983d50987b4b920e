"""Deterministic data order split across ranks."""

from trainfit.data import global_indices, rank_micro_batches
from trainfit.tasks.make import make_task


def test_each_sample_once_per_epoch_across_ranks():
    N, mb, acc, world = 48, 2, 3, 2
    seen = []
    for step in range(N // (mb * acc * world)):
        for rank in range(world):
            for m in rank_micro_batches(step, micro_batch=mb, accumulation=acc, rank=rank, world_size=world,
                                        dataset_size=N, seed=3):
                seen.extend(m)
    assert sorted(seen) == list(range(N))


def test_global_batch_independent_of_world_size():
    a = [i for r in range(2) for m in rank_micro_batches(5, micro_batch=2, accumulation=2, rank=r, world_size=2,
                                                          dataset_size=100, seed=0) for i in m]
    b = [i for m in rank_micro_batches(5, micro_batch=4, accumulation=2, rank=0, world_size=1, dataset_size=100,
                                       seed=0) for i in m]
    assert a == b == global_indices(5, 8, 100, 0)


def test_generated_tokens_are_deterministic_and_padded():
    t1 = make_task("gpt-tiny", seq_len=32, seed=4).dataset()
    t2 = make_task("gpt-tiny", seq_len=32, seed=4).dataset()
    assert all((t1[i]["input_ids"] == t2[i]["input_ids"]).all() for i in range(20))
    lengths = {len(t1[i]["input_ids"]) for i in range(200)}
    assert min(lengths) >= 8 and max(lengths) <= 32 and len(lengths) > 10
