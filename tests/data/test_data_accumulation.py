"""Accumulation on real file data (packed and padded) equals one big batch in plain PyTorch (fp32)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.nn import functional as F

from tests.data.conftest import STDLIB_JSON
from trainfit.config import RunConfig
from trainfit.data import global_indices, make_loader
from trainfit.run import build_run
from trainfit.tasks.synthetic import IGNORE_INDEX, collate_tokens

TINY = "n_layer=2,d_model=32,n_head=2"


def _reference_update(model, rows, lr):
    """Plain PyTorch: the 8 rows right-padded into one batch, mean cross-entropy over real labels, SGD step 1
    (momentum's first step is plain ``p -= lr * grad``)."""
    model = copy.deepcopy(model)
    batch = collate_tokens(rows)
    logits = model(batch["input_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    return [(-lr * p.grad).detach() for p in model.parameters()]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_micro_batches_equal_the_big_batch_on_file_data(tmp_path, packing):
    lr = 0.5
    # documents of many lengths: the paragraphs of the stdlib's json/decoder.py, one JSON line each
    paragraphs = [p for p in (STDLIB_JSON / "decoder.py").read_text().split("\n\n") if p.strip()]
    data = tmp_path / "paragraphs.jsonl"
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    updates, rows_seen = {}, {}
    for micro, acc in ((2, 4), (8, 1)):
        cfg = RunConfig(data=str(data), model_config=TINY, seq_len=48, packing=packing,
                        micro_batch=micro, accumulation=acc, optimizer="sgd", lr=lr, grad_clip=0.0,
                        run_dir=str(tmp_path / f"r{micro}"), seed=3)
        run = build_run(cfg)
        if not packing:
            lengths = {len(run.task.dataset()[i]["input_ids"]) for i in range(len(run.task.dataset()))}
            assert len(lengths) > 1, "padded rows of different lengths are what makes this test mean something"
        loader = make_loader(run.task.dataset(), run.task.collate, start_step=0, micro_batch=micro,
                             accumulation=acc, seed=cfg.seed)
        batches = [b for _, b in zip(range(acc), loader)]
        rows_seen[micro] = torch.cat([b["labels"].flatten() for b in batches])
        assert batches[0]["input_ids"].shape[0] == micro
        ds = run.task.dataset()
        rows = [ds[i] for i in global_indices(0, 8, len(ds), cfg.seed)]  # step 0's 8 rows, for both splits
        before = [p.detach().clone() for p in run.model.parameters()]
        reference = _reference_update(run.model, rows, lr)
        run.step(batches)
        updates[micro] = [p.detach() - b for p, b in zip(run.model.parameters(), before)]
        assert max(r.abs().max().item() for r in reference) > 1e-3  # an update large enough to compare
        diff = max((u - r).abs().max().item() for u, r in zip(updates[micro], reference))
        assert diff <= 1e-5, (micro, acc, diff)
    assert max((a - b).abs().max().item() for a, b in zip(updates[2], updates[8])) <= 1e-5
    assert sorted(rows_seen[2].tolist()) == sorted(rows_seen[8].tolist())  # the same labels, split differently
