"""evaluate(): the token-weighted validation loss, against plain PyTorch; on 2 ranks under zero3 with
unequal shares, against one rank."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from trainfit.engine import evaluate
from trainfit.levers.precision import make_precision
from trainfit.train import val_index_batches

from .helpers import gpt_task, reference_val_loss, val_dataset


def _batches(ds, collate, index_lists):
    return [collate([ds[i] for i in idx]) for idx in index_lists]


@pytest.mark.parametrize("n,mb,world,limit", [(7, 2, 1, 0), (7, 2, 2, 0), (9, 2, 3, 0), (7, 2, 2, 1), (1, 4, 2, 0)])
def test_val_shares_are_disjoint_and_cover_the_split_in_order(n, mb, world, limit):
    shares = [val_index_batches(n, micro_batch=mb, rank=r, world_size=world, limit=limit) for r in range(world)]
    flat = sorted(i for share in shares for b in share for i in b)
    # hand count: ceil(n / mb) batches of consecutive samples, the first limit x world of them with a limit
    n_batches = math.ceil(n / mb) if not limit else min(math.ceil(n / mb), limit * world)
    assert flat == list(range(min(n, n_batches * mb)))
    assert all(len(b) <= mb and b == list(range(b[0], b[0] + len(b))) for share in shares for b in share)
    assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1


def test_evaluate_equals_plain_pytorch_and_leaves_the_model_as_it_was():
    task = gpt_task()
    model = task.build_model()  # dropout=0.1: evaluation must run it in eval mode
    ds = val_dataset()
    batches = _batches(ds, task.collate, val_index_batches(len(ds), micro_batch=2, rank=0, world_size=1))
    ref_loss, ref_count = reference_val_loss(model, batches)
    model.train()
    rng = torch.get_rng_state()
    loss_sum, count = evaluate(model=model, precision=make_precision("fp32"), batches=batches, loss_fn=task.loss)
    assert count == ref_count == sum(int(l) for l in ds.lengths)
    assert loss_sum / count == pytest.approx(ref_loss, rel=1e-6, abs=0)
    assert model.training  # back in train mode
    assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn from the training stream
    assert all(p.grad is None for p in model.parameters())  # no gradient


def test_evaluate_token_weighting_is_not_a_mean_of_batch_means():
    """The short last batch must weigh by its tokens: the mean of per-batch means is a different number."""
    task = gpt_task()
    model = task.build_model()
    ds = val_dataset()
    batches = _batches(ds, task.collate, val_index_batches(len(ds), micro_batch=2, rank=0, world_size=1))
    loss_sum, count = evaluate(model=model, precision=make_precision("fp32"), batches=batches, loss_fn=task.loss)
    per_batch = [reference_val_loss(model, [b])[0] for b in batches]
    assert abs(loss_sum / count - sum(per_batch) / len(per_batch)) > 1e-4


def test_evaluate_under_bf16_autocast_is_close_to_fp32():
    task = gpt_task()
    model = task.build_model()
    ds = val_dataset()
    batches = _batches(ds, task.collate, val_index_batches(len(ds), micro_batch=4, rank=0, world_size=1))
    ref, _ = reference_val_loss(model, batches)
    s, n = evaluate(model=model, precision=make_precision("bf16-mixed"), batches=batches, loss_fn=task.loss)
    assert s / n == pytest.approx(ref, rel=2e-2)
    assert s / n != ref  # autocast was really on (bf16 matmuls round differently)


def eval_zero3_worker(rank: int, root: Path) -> None:
    """Each rank evaluates its share (rank 0: 2 batches, rank 1: 1 batch + a discarded repeat) under zero3."""
    from trainfit.config import RunConfig
    from trainfit.run import build_run

    from .helpers import TINY

    cfg = RunConfig(**TINY, strategy="zero3", run_dir=str(root / "run"))
    run = build_run(cfg)
    ds = val_dataset()
    mine = val_index_batches(len(ds), micro_batch=3, rank=rank, world_size=2)  # 3 batches: [0-2] [3-5] [6]
    forwards = []
    handle = run.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    s, n = evaluate(model=run.model, precision=run.precision, batches=_batches(ds, run.task.collate, mine),
                    loss_fn=run.task.loss, strategy=run.strategy)
    handle.remove()
    (root / f"rank{rank}.json").write_text(json.dumps({"sum": s, "count": n, "share": len(mine),
                                                       "forwards": len(forwards), "training": run.model.training}))
    # The loop on the same 2 ranks: evaluation every 2 steps, and the checkpoint clock (rank 0 decides) run
    # out at every step -- a rank deciding alone would leave the other in a sharded save's collectives.
    import trainfit.train as loop

    from .helpers import with_eval

    real = loop.build_run

    def build(cfg, **kw):
        r = real(cfg, **kw)
        r.task.val_dataset = val_dataset
        return r

    loop.build_run = build
    cfg = with_eval(RunConfig(**TINY, strategy="zero3", steps=3, checkpoint_every=0, checkpoint_minutes=1e-9,
                              keep_checkpoints=5, run_dir=str(root / "loop")), every=2)
    loop.train(cfg, progress=False)


@pytest.mark.distributed
def test_evaluate_on_two_zero3_ranks_with_unequal_shares_equals_one_rank(tmp_path):
    from trainfit.config import RunConfig
    from trainfit.run import build_run
    from trainfit.strategies.launch import spawn_errors, spawn_local

    from .helpers import TINY

    codes = spawn_local(eval_zero3_worker, tmp_path, world_size=2, timeout_s=180)
    assert codes == [0, 0], spawn_errors(tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["share"] for r in ranks] == [2, 1]
    assert [r["forwards"] for r in ranks] == [2, 2]  # the same number of forwards on every rank (FSDP2)
    assert all(r["training"] for r in ranks)
    # one rank, the same weights (same seed), every batch: the plain-PyTorch reference
    run = build_run(RunConfig(**TINY, run_dir=str(tmp_path / "one")))
    ds = val_dataset()
    ref, count = reference_val_loss(run.model, _batches(ds, run.task.collate, [[0, 1, 2], [3, 4, 5], [6]]))
    for r in ranks:
        assert r["count"] == count
        assert r["sum"] / r["count"] == pytest.approx(ref, rel=1e-6, abs=0)
    from trainfit.strategies.dist_checkpoint import list_dcp

    from .helpers import metrics

    assert [p.name for p in list_dcp(tmp_path / "loop")] == [f"step-0000000{i}.dcp" for i in (1, 2, 3)]
    log = metrics(tmp_path / "loop")
    assert [r["step"] for r in log if "val_loss" in r] == [2, 3]
    assert all(r["val_tokens"] == count and math.isfinite(r["val_loss"]) for r in log if "val_loss" in r)
