"""Planner accuracy on 2 gloo processes: predicted vs measured per-rank peak memory per strategy.

    .venv/bin/python benchmarks/planner_accuracy_dist.py [--model llama] [--model-config ... --tag T]

The prediction comes from the single-device basis (``plan.sources.report_basis``, estimated at
micro-batches 2 and 4, accumulation 1 and 2) scaled by ``plan.cost.memory`` for each strategy
on n=2; the measurement is ``measure_memory`` inside rank 0 of 2 spawned gloo processes (file
rendezvous, loopback). Writes planner_accuracy_dist.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODEL = {"model": "gpt-tiny", "model_config": "n_layer=2,d_model=64,n_head=2", "seq_len": 64}
MODELS = {"gpt-tiny": MODEL,
          "llama": {"model": "hf:LlamaForCausalLM", "model_config": "vocab_size=256,num_hidden_layers=2,hidden_size=64,"
                    "num_attention_heads=4,num_key_value_heads=2,intermediate_size=128", "seq_len": 64}}
GRID = [(s, p, mb, acc, sync) for s in ("ddp", "zero1", "zero2", "zero3") for p in ("fp32", "bf16-mixed")
        for mb, acc, sync in ((3, 1, "deferred"), (6, 2, "deferred"), (6, 2, "per-micro-batch"))
        if sync == "deferred" or s in ("zero2", "zero3")]


def rank_main(rank: int, root: Path, model: dict) -> None:
    """Inside each of the 2 ranks (``_common.spawn_ranks``)."""
    from trainfit.config import make_config
    from trainfit.probes.memory import measure_memory

    out = []
    for s, p, mb, acc, sync in GRID:
        cfg = make_config({**model, "strategy": s, "precision": p, "micro_batch": mb, "accumulation": acc,
                           "grad_sync": sync})
        out.append(measure_memory(cfg).peak_bytes)
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt-tiny")
    ap.add_argument("--model-config", default=None,
                    help="held-out shapes: the strategy rules of plan.cost were read off gpt-tiny's default one")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--basis", default="estimate", choices=("estimate", "fast"),
                    help="the single-device basis: four full estimates per pair, or the fast basis "
                         "(probes.fastbasis: two windowed traces, uncached here)")
    args = ap.parse_args()
    model = dict(MODELS[args.model])
    if args.model_config:
        model["model_config"] = args.model_config
    name = "planner_accuracy_dist" + (f"_{args.tag}" if args.tag else "")
    from _common import RESULTS, spawn_ranks

    root = spawn_ranks(rank_main, model)
    measured = [json.loads(Path(root, f"rank{r}.json").read_text()) for r in range(2)]
    (RESULTS / f"{name}_measured.json").write_text(json.dumps(measured))

    from trainfit.config import make_config
    from trainfit.plan.cost import Candidate, activation_precision, memory
    from trainfit.probes.calibrate import report_basis
    from trainfit.probes.fastbasis import fast_basis

    base = make_config(model)
    bases: dict = {}
    rows = []
    def basis(p):
        if p not in bases:
            bases[p] = (fast_basis(base, p, "none", use_cache=False) if args.basis == "fast" else
                        report_basis(base, p, "none", source="estimate"))
        return bases[p]

    for i, (s, p, mb, acc, sync) in enumerate(GRID):
        act_b = basis(activation_precision(s, p))
        pred = memory(basis(p), Candidate(precision=p, micro_batch=mb, accumulation=acc, checkpointing="none",
                                          strategy=s, grad_sync=sync, n=2), act_basis=act_b).peak_bytes
        rows.append({"strategy": s, "precision": p, "micro_batch": mb, "accumulation": acc, "grad_sync": sync,
                     "pred_peak_bytes": int(pred), "meas_peak_bytes_rank0": measured[0][i],
                     "meas_peak_bytes_rank1": measured[1][i], "mem_err": pred / measured[0][i] - 1})
        print(json.dumps(rows[-1]), flush=True)
    from _common import write_results

    lines = ["| strategy | precision | mb x acc | sync | predicted peak/rank | measured rank 0 | measured rank 1 | "
             "error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['precision']} | {r['micro_batch']} x {r['accumulation']} | "
                     f"{r['grad_sync']} | {r['pred_peak_bytes']:,} | {r['meas_peak_bytes_rank0']:,} | "
                     f"{r['meas_peak_bytes_rank1']:,} | {r['mem_err']:+.1%} |")
    worst = max(abs(r["mem_err"]) for r in rows)
    write_results(name, {"model": model, "basis": args.basis, "rows": rows},
                  f"Basis: {args.basis}. Per-rank peak memory on 2 gloo processes, model {model}: {len(rows)} rows, "
                  f"max |error| "
                  f"{worst:.2%}.\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
