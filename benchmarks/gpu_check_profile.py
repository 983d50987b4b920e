"""GPU check for ``trainfit profile`` (run when a CUDA machine is at hand; safe to import on CPU).

What it checks on one CUDA device, with the built-in GPT in bf16-mixed:

1. The step-time breakdown is timed with CUDA events: forward, backward, optimizer > 0, and
   the timed parts do not exceed the wall-clock step (they partition the device timeline).
2. ``busy_frac`` comes from the torch.profiler kernel timeline and lies in (0, 1].
3. MFU is reported against the peak table's row for this GPU (``null`` with the reason when
   the device name is not in the table -- then add a row with its datasheet source).
4. The counted model FLOPs agree within 15% with an independent transformer estimate
   (6 x non-embedding params x tokens + 12 x layers x seq x d_model x tokens, Kaplan et al.
   2020 / PaLM appendix B), and a bf16 8192^3 matmul's measured rate stays below the table peak.
5. Timing overhead on the GPU: interleaved plain vs timed steps, median ratio - 1 <= 2%.
6. ``--compile`` on the GPU (per block, inductor): eager and compiled runs from the same weights stepped
   interleaved on one window (median of 10 after the compile), the compile time apart, no recompilation
   after the first step, and the loss of the first step equal to eager's within bf16-mixed's tolerance.
   The measured speed-up is what ``trainfit plan --device h200 --compile-speedup F`` should be given; the
   planner's compiled step (compute / F, communication unchanged) is printed next to the measured one.

Usage::

    python benchmarks/gpu_check_profile.py [--out DIR]   # writes gpu_check_profile.json there
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

MODEL = {"model": "gpt-small", "seq_len": 256, "micro_batch": 16, "accumulation": 2, "precision": "bf16-mixed"}


def _matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * n**3 / best


def _overhead(run, steps: int = 40) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from profile_overhead import one_step

    from trainfit.meters.timers import PhaseTimer
    from trainfit.probes.profile import step_batches

    batches, timer = step_batches(run, run.cfg.micro_batch, start_step=50_000), PhaseTimer(run.strategy.device)

    def synced(t):
        s = one_step(run, batches, t)
        torch.cuda.synchronize()  # the plain step would otherwise leave queued kernels to the next one
        return s

    for _ in range(5):
        synced(None), synced(timer)
    plain, timed = [], []
    for i in range(steps):
        order = (None, timer) if i % 2 == 0 else (timer, None)
        for t in order:
            (plain if t is None else timed).append(synced(t))
    return {"median_plain_s": statistics.median(plain), "median_timed_s": statistics.median(timed),
            "overhead": statistics.median(timed) / statistics.median(plain) - 1}


def _compile_check(cfg, reps: int = 10) -> dict:
    """Eager vs compiled (per block) steps on CUDA, interleaved on one window; the planner's price next to it."""
    import dataclasses

    from trainfit.tasks.base import to_device
    from trainfit.plan.cost import Candidate, Links, step_time
    from trainfit.probes.fastbasis import basis_provider
    from trainfit.run import build_run
    from trainfit.strategies.single import Single

    eager = build_run(dataclasses.replace(cfg, compile=False), strategy=Single("cuda"))
    compiled = build_run(dataclasses.replace(cfg, compile=True), strategy=Single("cuda"))
    compiled.model.load_state_dict(eager.model.state_dict())
    ds = eager.task.dataset()
    m = cfg.micro_batch
    window = [to_device(eager.task.collate([ds[j * m + i] for i in range(m)]), torch.device("cuda"))
              for j in range(cfg.accumulation)]

    def timed(run) -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = run.step(window)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, float(out.loss)

    _, loss_eager = timed(eager)
    first_s, loss_compiled = timed(compiled)
    graphs_after_first = compiled.compiled.graphs()
    e, c = [], []
    for _ in range(reps):
        e.append(timed(eager)[0])
        c.append(timed(compiled)[0])
    eager_s, compiled_s = statistics.median(e), statistics.median(c)
    recompiles = compiled.compiled.graphs() - graphs_after_first
    speedup = eager_s / compiled_s
    basis, _ = basis_provider(cfg, source="auto", target="h200")
    b = basis(cfg.precision, cfg.checkpointing.spec)
    links = Links(flops_per_s=1.0, bandwidth_bytes_per_s=1.0)  # the ratio only: compute scales by 1 / speed-up
    cand = Candidate(precision=cfg.precision, micro_batch=m, accumulation=cfg.accumulation,
                     checkpointing=cfg.checkpointing.spec, strategy="single", grad_sync="deferred", n=1)
    plain = step_time(b, cand, links).step_s
    priced = step_time(b, dataclasses.replace(cand, compile=True),
                       dataclasses.replace(links, compile_speedup=speedup)).step_s
    return {"eager_step_s": eager_s, "compiled_step_s": compiled_s, "speedup": speedup,
            "compile_s": max(0.0, first_s - compiled_s), "recompiles_after_first_step": recompiles,
            "loss_eager": loss_eager, "loss_compiled": loss_compiled,
            "planner_compiled_over_eager": priced / plain, "measured_compiled_over_eager": compiled_s / eager_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from trainfit.config import make_config
    from trainfit.meters import devices as hardware
    from trainfit.presets import GPT_PRESETS
    from trainfit.probes.profile import ProfileOptions, profile
    from trainfit.run import build_run
    from trainfit.strategies.single import Single

    cfg = make_config(MODEL)
    run = build_run(cfg, strategy=Single("cuda"))
    t0 = time.perf_counter()
    r = profile(run, ProfileOptions(steps=20, warmup=5, bandwidth_bytes_per_s=450e9))
    wall = time.perf_counter() - t0
    name = torch.cuda.get_device_name()
    checks: dict[str, bool] = {}
    timed = sum(r[k] for k in ("h2d_s", "forward_s", "backward_s", "optimizer_s", "comm_exposed_s"))
    checks["events_positive"] = all(r[k] > 0 for k in ("forward_s", "backward_s", "optimizer_s"))
    checks["events_within_wall_step"] = timed <= r["step_s"] * 1.02
    checks["busy_frac_in_0_1"] = r["busy_frac"] is not None and 0 < r["busy_frac"] <= 1
    checks["device_in_peak_table"] = hardware.find_device(name) is not None
    checks["mfu_reported_vs_table"] = (r["mfu"] is not None and 0 < r["mfu"] < 1) if checks["device_in_peak_table"] \
        else r["mfu"] is None
    g = GPT_PRESETS["gpt-small"]
    n_nonemb = g.n_layer * (12 * g.d_model**2 + 13 * g.d_model)  # blocks' weights + biases + norms
    tokens = cfg.micro_batch * cfg.accumulation * cfg.seq_len  # upper bound: the batches are padded to <= seq
    est = (6 * (n_nonemb + g.d_model * g.vocab_size) + 12 * g.n_layer * cfg.seq_len * g.d_model) * tokens
    checks["flops_vs_formula_within_15pct"] = abs(r["model_flops_per_step"] / est - 1) < 0.15
    rate = _matmul_rate()
    peak = hardware.peak_flops(name, "bf16")
    checks["matmul_rate_below_table_peak"] = peak is None or rate <= peak
    ov = _overhead(run)
    checks["overhead_le_2pct"] = ov["overhead"] <= 0.02
    comp = _compile_check(cfg)
    checks["compile_no_recompiles"] = comp["recompiles_after_first_step"] == 0
    checks["compile_first_loss_equal"] = abs(comp["loss_compiled"] - comp["loss_eager"]) <= 1e-2 * max(
        1.0, abs(comp["loss_eager"]))
    checks["planner_prices_the_measured_ratio"] = abs(comp["planner_compiled_over_eager"]
                                                      - comp["measured_compiled_over_eager"]) < 0.02
    out = {"device": name, "checks": checks, "all_pass": all(checks.values()), "config": MODEL,
           "profile_wall_s": wall, "formula_flops_per_step": est, "bf16_matmul_flops_per_s": rate,
           "table_peak_bf16": peak, "overhead": ov, "compile": comp,
           "profile": {k: v for k, v in r.items() if k not in ("scaling", "parts")}}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check_profile.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps({"device": name, "checks": checks, "mfu": r["mfu"], "busy_frac": r["busy_frac"],
                      "step_s": r["step_s"], "bottleneck": r["bottleneck"], "overhead": ov["overhead"],
                      "compile_speedup": comp["speedup"], "compile_s": comp["compile_s"]}, indent=2))
    return 0 if out["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
