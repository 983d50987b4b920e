"""Planner accuracy on this CPU: predicted vs measured peak memory and step time over a small grid.

    .venv/bin/python benchmarks/planner_accuracy.py

Memory: the planner's basis per (precision, checkpointing) comes from memory reports at
micro-batches 2 and 4 (``plan.sources.report_basis``, measured: the estimator is used
when present); predictions at other micro-batches and accumulations are analytic and are
compared with a fresh ``measure_memory`` of that configuration. Time: ``calibrated_links`` fits
per-sample, per-micro-batch and per-step costs to steps measured at (2,1), (4,1), (2,2); the
predictions at (3,1) and (6,2) are compared with freshly measured steps (fastest of 5: the
machine is shared, and other processes only add time).
Writes planner_accuracy.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from trainfit.config import make_config
from trainfit.meters.devices import device_row
from trainfit.plan.cost import Candidate, memory, step_time
from trainfit.probes.calibrate import calibrated_links, links_provider, measure_step_s, report_basis
from trainfit.probes.memory import measure_memory

CLOCK = time.thread_time
"""Step CPU time of the one torch thread (set in main): the machine is shared, and another process's load
changes wall time by multiples but this thread's CPU time barely. On an idle machine the two agree."""
MODELS = [
    {"model": "gpt-tiny", "model_config": "n_layer=2,d_model=64,n_head=2", "seq_len": 64},
    {"model": "hf:LlamaForCausalLM", "model_config": "vocab_size=256,num_hidden_layers=2,hidden_size=64,"
     "num_attention_heads=4,num_key_value_heads=2,intermediate_size=128", "seq_len": 64},
]
NOTES = """Memory: predicted from `estimate_memory` reports (fake tensors) at micro-batches 2 and 4,
accumulation 1 and 2, scaled by `plan.cost.memory`; measured by `measure_memory` (a real step).
Time: `calibrated_links` fits per-sample, per-micro-batch and per-step costs to steps at (2,1),
(4,1), (2,2); the rows at (3,1) and (6,2) are held out; both sides are the CPU time of the one
torch thread (`time.thread_time`, fastest of 5), which other processes on the machine barely change.
Scatter plot: planner_accuracy.png. Two-process rows: planner_accuracy_dist.md (memory) and
planner_time_dist.md (time)."""
GRID = [(p, ck, mb, acc) for p in ("fp32", "bf16-mixed") for ck in ("none", "full") for mb, acc in ((3, 1), (6, 2))]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help only
    torch.set_num_threads(1)
    rows = []
    for spec in MODELS:
        base = make_config(spec)
        bases: dict = {}

        def basis(p, ck, base=base, bases=bases):
            if (p, ck) not in bases:
                bases[(p, ck)] = report_basis(base, p, ck, source="estimate")
            return bases[(p, ck)]

        plain = links_provider(device_row("cpu"), nodes=1, devices=1, intra=None, inter=None)
        links = calibrated_links(base, plain, basis, clock=CLOCK)
        for p, ck, mb, acc in GRID:
            b = basis(p, ck)
            c = Candidate(precision=p, micro_batch=mb, accumulation=acc, checkpointing=ck, strategy="single",
                          grad_sync="deferred", n=1)
            cfg = make_config({"precision": p, "checkpointing": ck, "micro_batch": mb, "accumulation": acc},
                              base=base)
            pred_mem, pred_t = memory(b, c).peak_bytes, step_time(b, c, links(p, ck)).step_s
            meas_mem, meas_t = measure_memory(cfg).peak_bytes, measure_step_s(cfg, clock=CLOCK)
            rows.append({"model": spec["model"], "precision": p, "checkpointing": ck, "micro_batch": mb,
                         "accumulation": acc, "pred_peak_bytes": int(pred_mem), "meas_peak_bytes": int(meas_mem),
                         "mem_err": pred_mem / meas_mem - 1, "pred_step_s": pred_t, "meas_step_s": meas_t,
                         "time_err": pred_t / meas_t - 1, "basis": b.source})
            print(json.dumps(rows[-1]), flush=True)
    from _common import RESULTS, write_results

    lines = ["| model | precision | ckpt | mb x acc | predicted peak | measured peak | error | predicted step s | "
             "measured step s | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['precision']} | {r['checkpointing']} | {r['micro_batch']} x {r['accumulation']} | "
                     f"{r['pred_peak_bytes']:,} | {r['meas_peak_bytes']:,} | {r['mem_err']:+.1%} | "
                     f"{r['pred_step_s']:.4f} | {r['meas_step_s']:.4f} | {r['time_err']:+.0%} |")
    mem_ok = sum(abs(r["mem_err"]) <= 0.05 for r in rows)
    time_ok = sum(abs(r["time_err"]) <= 0.25 for r in rows)
    summary = (f"One process, one torch thread. Peak memory within 5%: {mem_ok} of {len(rows)} rows (max |error| "
               f"{max(abs(r['mem_err']) for r in rows):.2%}); step time within 25%: {time_ok} of {len(rows)} "
               f"(max |error| {max(abs(r['time_err']) for r in rows):.0%}).\n\n")
    write_results("planner_accuracy", {"torch_threads": torch.get_num_threads(), "models": MODELS, "rows": rows},
                  summary + "\n".join(lines) + "\n\n" + NOTES)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key, unit in ((axes[0], "peak_bytes", "MB"), (axes[1], "step_s", "s")):
        scale = 1e6 if unit == "MB" else 1.0
        xs = [r[f"meas_{key}"] / scale for r in rows]
        ys = [r[f"pred_{key}"] / scale for r in rows]
        ax.scatter(xs, ys)
        lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = measured")
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title("peak memory" if unit == "MB" else "step time")
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "planner_accuracy.png", dpi=120)


if __name__ == "__main__":
    main()
