"""Shared by the loop tests: a tiny GPT job, a validation split on the generated data, and readers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.nn import functional as F

from trainfit.config import RunConfig
from trainfit.tasks.make import make_task
from trainfit.tasks.synthetic import IGNORE_INDEX, TokenRules

TINY = dict(model_config="n_layer=1,d_model=32,n_head=2,dropout=0.1", seq_len=16, micro_batch=2, accumulation=2,
            lr=1e-2, dataset_size=64)
"""dropout > 0: evaluation must switch it off, and a resumed run must continue the RNG stream exactly."""
VAL_SIZE = 7
"""Validation samples: 4 micro-batches of 2 (the last one short), split unequally over 2 ranks."""


def val_dataset(seq_len: int = 16, vocab_size: int = 256) -> TokenRules:
    """A held-out split of the generated data (its own seed: samples the training set does not hold)."""
    return TokenRules(size=VAL_SIZE, seq_len=seq_len, vocab_size=vocab_size, seed=12345)


def with_eval(cfg: RunConfig, every: int, batches: int = 0) -> RunConfig:
    """``cfg`` with evaluation on. RunConfig refuses ``eval_every`` without ``--data``'s validation split; the
    generated data gets one from :func:`add_val_split`, so the field is set past that check."""
    object.__setattr__(cfg, "eval_every", every)
    object.__setattr__(cfg, "eval_batches", batches)
    return cfg


def add_val_split(monkeypatch) -> None:
    """Every run the loop builds gets :func:`val_dataset` as its task's validation split."""
    import trainfit.train as loop

    real = loop.build_run

    def build(cfg, **kw):
        run = real(cfg, **kw)
        run.task.val_dataset = lambda: val_dataset(cfg.seq_len)
        return run

    monkeypatch.setattr(loop, "build_run", build)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def reference_val_loss(model: torch.nn.Module, batches: list[dict]) -> tuple[float, int]:
    """Plain PyTorch: the token-weighted cross-entropy over ``batches``, model in eval mode, no autocast."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(b["input_ids"])
            total += F.cross_entropy(logits.flatten(0, 1).double(), b["labels"].flatten(),
                                     ignore_index=IGNORE_INDEX, reduction="sum").item()
            count += int((b["labels"] != IGNORE_INDEX).sum())
    model.train()
    return total / count, count


def gpt_task(seed: int = 0):
    return make_task("gpt-tiny", model_config=TINY["model_config"], seq_len=TINY["seq_len"], seed=seed,
                     dataset_size=TINY["dataset_size"])


def bitwise(a, b) -> bool:
    """Two nested structures of tensors (state dicts, optimizer states, RNG states) hold identical bits."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bitwise(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(bitwise(x, y) for x, y in zip(a, b))
    return a == b

