"""Run inside 2 spawned gloo ranks (tests/distributed/harness.spawn): train a pretrained tiny Llama with frozen
weights or LoRA under each strategy, export it, and leave what the test compares under root."""

from __future__ import annotations

from pathlib import Path

import torch

CASES = {
    "zero3-freeze": dict(strategy="zero3", freeze="model.embed_tokens.*,model.layers.0.*"),
    "zero2-lora-merged": dict(strategy="zero2", lora="r=4,alpha=8,targets=q_proj,v_proj,merge=true"),
    "zero1-freeze": dict(strategy="zero1", freeze="lm_head.*"),  # DDP underneath: ddp too
}


def train_and_export(rank: int, root: Path) -> None:
    from trainfit.config import make_config
    from trainfit.export import export_model
    from trainfit.run import build_run
    from trainfit.strategies.base import unwrap
    from trainfit.tasks.base import to_device

    root = Path(root)
    for name, kw in CASES.items():
        cfg = make_config(dict(model=f"hf:{root / 'llama'}", seq_len=16, micro_batch=2, accumulation=2, lr=0.05,
                               run_dir=str(root / name), **kw))
        run = build_run(cfg)
        model = unwrap(run.model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        batch = to_device(run.task.example_batch(2), run.strategy.device)  # the same batch on both ranks
        for _ in range(2):
            run.step([batch, batch])
        state = {id(t) for t in run.optimizer.state}
        frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        grads_of_frozen = [n for n, p in frozen.items() if p.grad is not None]
        state_of_frozen = [n for n, p in frozen.items() if id(p) in state]
        moved_frozen = [n for n, p in frozen.items() if not torch.equal(p.detach(), before[n])]
        moved = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p.detach(), before[n])]
        with torch.no_grad():
            logits = run.model(input_ids=batch["input_ids"]).logits  # a collective under FSDP2
        run.save(2)  # a sharded checkpoint with frozen weights (DCP keys only what trains in optim)
        out = export_model(run, root / name / "model")
        assert (out is not None) == (rank == 0)
        if rank == 0:
            torch.save({"logits": logits, "ids": batch["input_ids"], "n_frozen": len(frozen),
                        "grads_of_frozen": grads_of_frozen, "state_of_frozen": state_of_frozen,
                        "moved_frozen": moved_frozen, "n_moved": len(moved)}, root / f"{name}.pt")
