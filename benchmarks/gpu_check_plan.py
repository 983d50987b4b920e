"""GPU check for the target-kernel estimate (issue 14): ``--device h200`` estimates vs a real CUDA step.

For hf GPT-2 small (n_layer=12, n_embd=768, n_head=12, n_positions=2048) and a Llama-shaped model (hidden
2048, 16 layers, 16 heads / 8 kv heads, seq 2048), bf16-mixed, micro-batch 1 and 2, AdamW:

1. the estimate: ``trainfit.probes.estimate.estimate_memory(cfg, device=TARGET)`` when the estimator takes
   ``device=``; otherwise ``estimate_memory(cfg)`` inside ``trainfit.meters.attention.target_kernels(TARGET)``
   (the fake CPU trace with the target's SDPA kernels, CUDA dropout and CUDA autocast rules). Both are fake
   tensors on the CPU, so they run before any CUDA memory is touched;
2. the real step on ``cuda``: ``build_run``, one warm-up step (optimizer states exist, as in the estimate's
   steady step), ``reset_peak_memory_stats``, one step, ``max_memory_allocated``. The allocator also holds
   memory that is no tensor of the step (cuBLAS / cuDNN workspaces, the CUDA context's allocations):
   ``baseline`` = ``memory_allocated()`` before the step minus the bytes of the live params, grads and
   optimizer states (unique storages), added to the estimate before comparing;
3. pass: ``|estimate + baseline - max_memory_allocated| <= 5%`` of ``max_memory_allocated``.
   ``max_memory_reserved`` (the caching allocator's reserve: rounding and fragmentation) is reported apart,
   not compared. The SDPA kernel the real run could use (``torch.backends.cuda.can_use_*`` on the first
   call's arguments) is reported next to the kernel the estimate assumed.

The clock check (issue 30, item 4; ``--clock``, on by default, ``--no-memory`` for it alone): ``plan --calibrate``'s
CUDA calibration (``trainfit.probes.calibrate.measure_device_timings``: GEMMs large and skinny in bf16/fp16/fp32, a
1 GiB device copy, pinned host copies each way, back-to-back tiny GEMMs, a causal bf16 SDPA attention forward and
backward) turned into the clock's device row
(``calibrated_device_clock``), then each case's single-device step priced by the op-level clock with the table's
row and with the calibrated one, against the median of 5 real CUDA steps; and a plan (``plan.search`` over
precisions, micro-batches and checkpointing for a global batch of 16) priced with the calibrated row. Written to
``$OUT/gpu_check_clock.json``. Reported, not passed or failed: it is the measurement the clock is checked by.

Works on torch >= 2.6 with only torch + transformers (no internet: models are built from configs; without
transformers the hf cases are skipped with a message). Output: one JSON line per case on stdout, and
``$OUT/gpu_check_plan.json`` when ``OUT`` is set (or ``--out DIR``). Exit 0 when every case passes or is
skipped, 1 otherwise. ``--dry-run`` (no CUDA needed) builds the configs and runs the estimates only.

Usage::

    python benchmarks/gpu_check_plan.py [--target h200] [--cases gpt2,llama] [--micro-batches 1,2]
                                        [--out DIR] [--dry-run] [--no-clock | --no-memory]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from trainfit.config import make_config
from trainfit.meters.attention import target_kernels
from trainfit.probes.estimate import estimate_memory

TOLERANCE = 0.05
SEQ = 2048
MODELS = {
    "gpt2": {"model": "hf:GPT2LMHeadModel",
             "model_config": f"n_layer=12,n_embd=768,n_head=12,vocab_size=50257,n_positions={SEQ}"},
    "llama": {"model": "hf:LlamaForCausalLM",
              "model_config": "hidden_size=2048,intermediate_size=5504,num_hidden_layers=16,num_attention_heads=16,"
                              f"num_key_value_heads=8,vocab_size=32000,max_position_embeddings={SEQ}"},
}
MICRO_BATCHES = (1, 2)


def cases(names: list[str], micro_batches: tuple[int, ...] = MICRO_BATCHES) -> list[dict]:
    return [{**MODELS[n], "name": n, "seq_len": SEQ, "micro_batch": mb, "precision": "bf16-mixed",
             "checkpointing": "none", "optimizer": "adamw", "accumulation": 1}
            for n in names for mb in micro_batches]


def transformers_missing() -> str | None:
    try:
        import transformers  # noqa: F401  (only probing that it is installed)
    except ImportError as e:
        return f"transformers is not installed here ({e}); hf cases skipped"
    return None


def estimate(case: dict, target: str) -> dict:
    """The estimate for ``target``: the estimator's own ``device=`` when it has one, else our context."""
    cfg = make_config({k: v for k, v in case.items() if k != "name"})
    t0 = time.perf_counter()
    if "device" in inspect.signature(estimate_memory).parameters:
        report, how, lines = estimate_memory(cfg, device=target), f"estimate_memory(device={target!r})", []
    else:
        with target_kernels(target) as record:
            report = estimate_memory(cfg)
        how, lines = f"estimate_memory inside target_kernels({target!r})", record.lines()
    return {"estimate_peak_bytes": report.peak_bytes, "estimate_peak_phase": report.peak_phase,
            "estimate_parts": dict(report.peak_parts), "estimate_how": how, "estimate_s": time.perf_counter() - t0,
            "kernel_notes": lines + list(report.notes)}


class _FirstSdpa(TorchFunctionMode):
    """Which SDPA kernels torch would allow for the first real call (arguments as the model passes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.usable: dict[str, bool] | str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.usable is None:
            try:  # a report, never a reason for the step to fail
                self.usable = _usable(args, kwargs)
            except (TypeError, RuntimeError, AttributeError) as e:
                self.usable = f"not checked: {type(e).__name__}: {e}"
        return func(*args, **kwargs)


def _usable(args: tuple, kwargs: dict) -> dict[str, bool]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    got = {**dict(zip(names, args)), **kwargs}
    q, k, v = got["query"], got["key"], got["value"]
    if torch.is_autocast_enabled("cuda"):  # the kernel sees the autocast dtype
        low = torch.get_autocast_dtype("cuda")
        q, k, v = (t.to(low) for t in (q, k, v))
    params = [q, k, v, got.get("attn_mask"), float(got.get("dropout_p", 0.0)), bool(got.get("is_causal", False))]
    try:  # enable_gqa joined SDPAParams in torch 2.5
        p = torch.backends.cuda.SDPAParams(*params, bool(kwargs.get("enable_gqa", False)))
    except TypeError:
        p = torch.backends.cuda.SDPAParams(*params)
    checks = {"flash": "can_use_flash_attention", "efficient": "can_use_efficient_attention",
              "cudnn": "can_use_cudnn_attention"}
    return {name: bool(getattr(torch.backends.cuda, fn)(p)) for name, fn in checks.items()
            if hasattr(torch.backends.cuda, fn)}


def _live_state_bytes(run) -> int:
    """Unique storage bytes of the params, their grads and the optimizer states (live before the step)."""
    seen: dict[int, int] = {}
    tensors = [p for p in run.model.parameters()] + [p.grad for p in run.model.parameters() if p.grad is not None]
    optimizer = getattr(run, "optimizer", None)
    if optimizer is not None:
        tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    for t in tensors:
        if t.is_cuda:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure(case: dict) -> dict:
    """One real CUDA step's peak (after a warm-up step), with the allocator baseline and reserve."""
    from trainfit.probes.memory import example_batch, warm_up  # noqa: I001  (the CUDA path only)
    from trainfit.run import build_run
    from trainfit.strategies.single import Single
    from trainfit.tasks.base import to_device

    cfg = make_config({k: v for k, v in case.items() if k != "name"})
    run = build_run(cfg, strategy=Single("cuda"))
    mb = to_device(example_batch(run.task, cfg.micro_batch), torch.device("cuda"))
    warm_up(run, [mb])
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated() - _live_state_bytes(run)
    torch.cuda.reset_peak_memory_stats()
    spy = _FirstSdpa()
    with spy:
        run.step([mb])
    torch.cuda.synchronize()
    out = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
           "max_memory_reserved": torch.cuda.max_memory_reserved(), "baseline_untracked_bytes": baseline,
           "real_sdpa_usable": spy.usable}
    del run, mb
    torch.cuda.empty_cache()
    return out


SHAPES = {  # the analytic shapes of MODELS (plan.shapes), for the clock's op list
    "gpt2": dict(family="gpt", vocab_size=50257, n_layer=12, d_model=768, n_head=12, n_kv_head=12, d_ff=3072,
                 max_seq_len=SEQ, tied_embeddings=True),
    "llama": dict(family="llama", vocab_size=32000, n_layer=16, d_model=2048, n_head=16, n_kv_head=8, d_ff=5504),
}


def measure_step_s(case: dict, reps: int = 5) -> float:
    """Median of ``reps`` real CUDA steps of ``case`` after two warm-up steps (synchronised, wall clock)."""
    from trainfit.probes.memory import example_batch, warm_up  # noqa: I001  (the CUDA path only)
    from trainfit.run import build_run
    from trainfit.strategies.single import Single
    from trainfit.tasks.base import to_device

    cfg = make_config({k: v for k, v in case.items() if k != "name"})
    run = build_run(cfg, strategy=Single("cuda"))
    mb = to_device(example_batch(run.task, cfg.micro_batch), torch.device("cuda"))
    warm_up(run, [mb])
    run.step([mb])
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run.step([mb])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del run, mb
    torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


def clock_check(names: list[str], micro_batches: tuple[int, ...], target: str, dry_run: bool) -> dict:
    """The CUDA calibration, each case's step priced with the table's and the calibrated clock vs measured, a plan."""
    from trainfit.meters.devices import clock_facts, device_row, dtypes_of
    from trainfit.plan.basis import analytic_basis
    from trainfit.plan.clock import DeviceClock, clocked_links
    from trainfit.plan.cost import Candidate, step_time
    from trainfit.plan.rules import Context
    from trainfit.plan.search import SearchSpace, search
    from trainfit.plan.shapes import TransformerShape
    from trainfit.probes.calibrate import calibrated_device_clock, measure_device_timings
    from trainfit.probes.fastbasis import links_provider

    row = device_row(target)
    table = DeviceClock(**clock_facts(row))
    out: dict = {"target": target}
    if dry_run:
        calibrated, lines = None, []
    else:
        t0 = time.perf_counter()
        timings = measure_device_timings("cuda")
        calibrated, host, lines = calibrated_device_clock(row, timings=timings)
        out.update(timings=timings.to_dict(), calibration_s=time.perf_counter() - t0, host_bytes_per_s=host,
                   gemm_shares=calibrated.gemm_shares, hbm_share=calibrated.hbm_share, kernel_s=calibrated.kernel_s,
                   attention_share=calibrated.attention_share)
        print(json.dumps({"calibration": lines}), flush=True)
    out["sources"] = lines
    plain = links_provider(row, nodes=1, devices=1, intra=None, inter=None)
    rows = []
    for case in cases(names, micro_batches):
        shape = TransformerShape(**SHAPES[case["name"]])
        b = analytic_basis(shape, precision=case["precision"], checkpointing="none", seq_len=SEQ)
        c = Candidate(precision=case["precision"], micro_batch=case["micro_batch"], accumulation=1,
                      checkpointing="none", strategy="single", grad_sync="deferred", n=1)
        r = {"name": case["name"], "micro_batch": case["micro_batch"], "precision": case["precision"],
             "table_step_s": step_time(b, c, clocked_links(plain, table, shape, seq_len=SEQ)(c.precision)).step_s}
        if calibrated is not None:
            r["calibrated_step_s"] = step_time(b, c, clocked_links(plain, calibrated, shape, seq_len=SEQ)(
                c.precision)).step_s
            if not (case["model"].startswith("hf:") and transformers_missing()):
                r["measured_step_s"] = measure_step_s(case)
                r["table_error"] = r["table_step_s"] / r["measured_step_s"] - 1
                r["calibrated_error"] = r["calibrated_step_s"] / r["measured_step_s"] - 1
        rows.append(r)
        print(json.dumps(r), flush=True)
    out["steps"] = rows
    shape = TransformerShape(**SHAPES[names[0]])
    links = clocked_links(plain, calibrated or table, shape, seq_len=SEQ)
    space = SearchSpace(global_batch=16, devices=1, memory_bytes=row.memory_bytes, strategies=("single",))
    plan = search(space, ctx=Context(devices=1, dtypes=dtypes_of(row)), links=links,
                  basis=lambda p, ck: analytic_basis(shape, precision=p, checkpointing=ck, seq_len=SEQ))
    best = plan.best
    out["plan"] = {"model": names[0], "global_batch": 16, "clock": "calibrated" if calibrated else "table",
                   "best": None if best is None else best.to_dict(),
                   "top": [e.to_dict() for e in plan.entries[:5]]}
    print(json.dumps({"plan_best": out["plan"]["best"]}, default=str), flush=True)
    return out


def check(case: dict, target: str, dry_run: bool) -> dict:
    row = {**case, "target": target, **estimate(case, target)}
    if dry_run:
        return row
    row.update(measure(case))
    predicted = row["estimate_peak_bytes"] + row["baseline_untracked_bytes"]
    row["relative_error"] = (predicted - row["max_memory_allocated"]) / row["max_memory_allocated"]
    row["pass"] = abs(row["relative_error"]) <= TOLERANCE
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="h200", help="device table name the estimate is for (default h200)")
    ap.add_argument("--cases", default="gpt2,llama", help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--micro-batches", default=",".join(map(str, MICRO_BATCHES)), help="comma list (default 1,2)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check_plan.json (default $OUT)")
    ap.add_argument("--dry-run", action="store_true", help="estimates only (no CUDA)")
    ap.add_argument("--no-clock", dest="clock", action="store_false", help="leave out the clock check")
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="leave out the memory check")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {sorted(MODELS)}")
    try:
        micro_batches = tuple(int(b) for b in args.micro_batches.split(","))
    except ValueError:
        ap.error(f"--micro-batches: integers, comma-separated; got {args.micro_batches!r}")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check_plan: no CUDA device; nothing to check (try --dry-run)", file=sys.stderr)
        return 0
    skip = transformers_missing()
    rows = []
    for case in cases(names, micro_batches) if args.memory else ():
        if skip is not None and case["model"].startswith("hf:"):
            rows.append({**case, "skipped": skip})
        else:
            rows.append(check(case, args.target, args.dry_run))
        print(json.dumps(rows[-1]), flush=True)
    ok = all(r.get("pass", True) for r in rows)
    if args.clock:
        clock = clock_check(names, micro_batches, args.target, args.dry_run)
        if args.out:
            path = Path(args.out) / "gpu_check_clock.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"torch": torch.__version__, **clock}, indent=2, default=str) + "\n")
            print(f"gpu_check_plan: wrote {path}")
    if args.out:
        out = Path(args.out) / "gpu_check_plan.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (dry run)"
        out.write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
        print(f"gpu_check_plan: wrote {out}")
    print(f"gpu_check_plan: {'PASS' if ok else 'FAIL'}{' (dry run: estimates only)' if args.dry_run else ''}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
