"""GPU check for the memory tracker (run when a CUDA machine is at hand; safe to import on CPU).

On one CUDA device, for the built-in GPT (fp32 and bf16-mixed, with and without
checkpointing) and one ``transformers`` model (a small Llama), it runs the measured step
and compares the tracker's peak with the caching allocator's ``torch.cuda.max_memory_allocated``:

- the allocator also holds memory the tracker never sees as a tensor of the step (what was
  allocated before the step that is not a tracked storage, e.g. cuBLAS workspaces), so that
  baseline -- ``memory_allocated()`` at the start minus the tracker's live bytes at the
  start -- is added to the tracker's peak before comparing;
- the allocator rounds every block up to 512 bytes, so small tensors cost a little more there.

Pass: |tracker peak + baseline - max_memory_allocated| <= 5% of max_memory_allocated for
every case, and the estimate (fake tensors, CPU rules) is printed alongside for reference.

Usage::

    python benchmarks/gpu_check_memory.py [--out DIR]   # writes gpu_check_memory.json there
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

CASES = [
    {"model": "gpt-small", "seq_len": 256, "micro_batch": 8, "precision": "fp32", "checkpointing": "none"},
    {"model": "gpt-small", "seq_len": 256, "micro_batch": 8, "precision": "bf16-mixed", "checkpointing": "none"},
    {"model": "gpt-small", "seq_len": 256, "micro_batch": 8, "precision": "bf16-mixed", "checkpointing": "full"},
    {"model": "gpt-small", "seq_len": 256, "micro_batch": 8, "precision": "bf16-true", "checkpointing": "none"},
    {"model": "hf:LlamaForCausalLM", "seq_len": 512, "micro_batch": 4, "precision": "bf16-mixed",
     "checkpointing": "none",
     "model_config": "hidden_size=512,intermediate_size=1376,num_hidden_layers=8,num_attention_heads=8,"
                     "num_key_value_heads=4,vocab_size=32000,max_position_embeddings=512"},
]
TOLERANCE = 0.05


def check(case: dict) -> dict:
    from trainfit.config import make_config
    from trainfit.probes.memory import example_batch, new_tracker, tracked_step, warm_up
    from trainfit.run import build_run
    from trainfit.strategies.single import Single
    from trainfit.tasks.base import to_device

    cfg = make_config({**case, "accumulation": 1})
    run = build_run(cfg, strategy=Single("cuda"))
    mb = to_device(example_batch(run.task, cfg.micro_batch), torch.device("cuda"))
    warm_up(run, [mb])
    torch.cuda.synchronize()
    tracker = new_tracker(run)
    baseline = torch.cuda.memory_allocated() - tracker.live_bytes  # allocated but not a tracked storage
    torch.cuda.reset_peak_memory_stats()
    tracked_step(run, [mb], tracker)
    torch.cuda.synchronize()
    max_alloc, max_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    predicted = tracker.peak_bytes + baseline
    err = (predicted - max_alloc) / max_alloc
    return {**case, "tracker_peak_bytes": tracker.peak_bytes, "tracker_peak_phase": tracker.peak_phase,
            "baseline_untracked_bytes": baseline, "max_memory_allocated": max_alloc,
            "max_memory_reserved": max_reserved, "relative_error": err, "pass": abs(err) <= TOLERANCE}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check_memory: no CUDA device; nothing to check", file=sys.stderr)
        return 0
    rows = []
    for case in CASES:
        try:
            rows.append(check(case))
        except ImportError as e:  # transformers missing
            rows.append({**case, "skipped": str(e)})
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    out = Path(args.out) / "gpu_check_memory.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "rows": rows}, indent=2) + "\n")
    ok = all(r.get("pass", True) for r in rows)
    print(f"gpu_check_memory: {'PASS' if ok else 'FAIL'} -> {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
