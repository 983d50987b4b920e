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

Offload section (``OFFLOAD_CASES``, ``--offload`` optimizer / activations / both, single device):
``torch.cuda.max_memory_allocated`` counts device memory only (pinned host buffers are not in it), so
the tracker's *device* peak (``device_peak_bytes``) + the baseline is compared with it (same 5%), and
the host side (``host_peak_bytes``) is printed with the pinned allocator's figure where torch has one.
Then the step time: offloaded minus resident (median of timed steps) against ``plan/offload.py``'s
``offload_price`` at the host-to-device bandwidth measured here (pinned copy); reported, not passed or
failed: the price assumes no overlap of the copies with compute, so it is an upper bound.
zero2/zero3's CPUOffloadPolicy needs several ranks: not in this single-device script.

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
OFFLOAD_CASES = [
    {"model": "gpt-small", "seq_len": 256, "micro_batch": 8, "precision": precision, "checkpointing": "none",
     "optimizer": "adamw", "offload": offload}
    for precision in ("fp32", "bf16-true") for offload in ("optimizer", "activations", "optimizer,activations")
]
TIMED_STEPS = 5


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


def host_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes/s of one pinned host -> device copy (the direction the priced traffic is dearest in; best of 5)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best


def step_seconds(run, micro_batches) -> float:
    """Median wall seconds of TIMED_STEPS steps (synchronised: the offloaded step ends on the device copy)."""
    import time

    times = []
    for _ in range(TIMED_STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run.step(micro_batches)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def check_offload(case: dict, link_bytes_per_s: float) -> dict:
    import dataclasses

    from trainfit.config import make_config
    from trainfit.plan.offload import offload_price
    from trainfit.probes.memory import example_batch, new_tracker, tracked_step, warm_up
    from trainfit.run import build_run
    from trainfit.strategies.single import Single
    from trainfit.tasks.base import to_device
    from trainfit.vocabulary import parse_offload

    cfg = make_config({**case, "accumulation": 1})
    run = build_run(cfg, strategy=Single("cuda"))
    mb = to_device(example_batch(run.task, cfg.micro_batch), torch.device("cuda"))
    warm_up(run, [mb])
    torch.cuda.synchronize()
    tracker = new_tracker(run)
    # allocated on the device but not a tracked device storage (host storages are not in memory_allocated)
    baseline = torch.cuda.memory_allocated() - (tracker.live_bytes - tracker.host_live_bytes)
    torch.cuda.reset_peak_memory_stats()
    tracked_step(run, [mb], tracker)
    torch.cuda.synchronize()
    max_alloc = torch.cuda.max_memory_allocated()
    predicted = tracker.device_peak_bytes + baseline
    err = (predicted - max_alloc) / max_alloc
    host_stats = getattr(torch.cuda, "host_memory_stats", None)  # newer torch only
    pinned = host_stats().get("allocated_bytes.current") if host_stats is not None else None
    offloaded_s = step_seconds(run, [mb])
    n = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    host_peak, host_parts = tracker.host_peak_bytes, dict(tracker.host_part_max)
    tracker_host_activations = host_parts["activations"]  # what crossed the link down (and back up)
    del run, tracker
    torch.cuda.empty_cache()
    resident = build_run(dataclasses.replace(cfg, offload=""), strategy=Single("cuda"))
    warm_up(resident, [mb])
    resident_s = step_seconds(resident, [mb])
    del resident
    torch.cuda.empty_cache()
    half = cfg.precision.endswith("-true")
    price = offload_price(parts=parse_offload(cfg.offload), strategy="single", n_params=n, accumulation=1,
                          weight_bytes=2 if half else 4, master_bytes_per_param=4 if half else 0,
                          activation_bytes_per_micro_batch=tracker_host_activations,
                          host_bytes_per_s=link_bytes_per_s)
    return {**case, "tracker_device_peak_bytes": predicted - baseline, "tracker_host_peak_bytes": host_peak,
            "tracker_host_bytes": host_parts, "baseline_untracked_bytes": baseline, "max_memory_allocated": max_alloc,
            "pinned_host_allocated_bytes": pinned, "relative_error": err, "pass": abs(err) <= TOLERANCE,
            "offloaded_step_s": offloaded_s, "resident_step_s": resident_s, "added_s": offloaded_s - resident_s,
            "predicted_added_s": price.seconds_per_step, "host_link_bytes_per_s": link_bytes_per_s,
            "price": price.reason}


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
    link = host_bandwidth()
    for case in OFFLOAD_CASES:
        rows.append(check_offload(case, link))
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
