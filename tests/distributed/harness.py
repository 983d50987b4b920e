"""Run a function in 2 gloo processes on loopback (file rendezvous under the test's tmp dir),
and the plain-PyTorch reference the distributed results are compared against."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch
from torch.nn import functional as F

from trainfit.strategies.launch import spawn_errors, spawn_local

TINY = "n_layer=2,d_model=64,n_head=2"
BASE = {"model_config": TINY, "seq_len": 16, "micro_batch": 2, "accumulation": 2, "dataset_size": 64,
        "optimizer": "sgd", "lr": 0.5, "grad_clip": 1.0}
"""The tiny GPT every distributed test trains: 2 ranks x 2 micro-batches x 2 samples = 8 per step.
SGD with momentum (state that zero1/2/3 shard) and a large lr, so that every tensor moves by
>= 1e-3 of its size in 5 steps and a wrong gradient shows far above the 1e-5 tolerance. AdamW is
checked too, at a looser bound: it divides each gradient by its own size, which turns rounding
noise on gradients that are zero in exact arithmetic (the attention key bias) into lr-sized steps."""
ADAMW = {"optimizer": "adamw", "lr": 3e-3}


def spawn(fn, root: Path, *args, world_size: int = 2, timeout_s: float = 240) -> list[int]:
    """Run ``fn(rank, root, *args)`` in ``world_size`` gloo processes; return their exit codes."""
    return spawn_local(fn, root, *args, world_size=world_size, timeout_s=timeout_s)


def errors(root: Path) -> str:
    return spawn_errors(root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


# ---- the independent reference -------------------------------------------------------------

def reference_params(steps: int, *, global_batch: int = 8, autocast_dtype: torch.dtype | None = None,
                     seed: int = 0, optimizer: str = "sgd") -> list[dict[str, torch.Tensor]]:
    """Plain PyTorch, one process, one big batch per step: params after each step (index = step)."""
    from trainfit.data import global_indices
    from trainfit.tasks.make import make_task
    from trainfit.tasks.synthetic import IGNORE_INDEX

    task = make_task("gpt-tiny", model_config=TINY, seq_len=BASE["seq_len"], seed=seed,
                     dataset_size=BASE["dataset_size"])
    model, ds = task.build_model(), task.dataset()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=BASE["lr"], momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], weight_decay=0.0)
    out = [{k: v.detach().clone() for k, v in model.state_dict().items()}]
    for step in range(steps):
        batch = task.collate([ds[i] for i in global_indices(step, global_batch, len(ds), seed)])
        labels = batch["labels"]
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / (labels != IGNORE_INDEX).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), BASE["grad_clip"])
        opt.step()
        opt.zero_grad()
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


def read_dcp_model(path: Path) -> dict[str, torch.Tensor]:
    """The full model weights of a sharded checkpoint, read by DCP into a plain model (no process group)."""
    import torch.distributed.checkpoint as dcp

    from trainfit.tasks.make import make_task

    model = make_task("gpt-tiny", model_config=TINY, seq_len=BASE["seq_len"], seed=0,
                      dataset_size=BASE["dataset_size"]).build_model()
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=str(path))
    return sd


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a - b| / max|b| (b is the reference)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()) for k in b)
