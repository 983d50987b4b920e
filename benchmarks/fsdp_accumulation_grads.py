"""What gradient accumulation adds to a rank's peak under FSDP2, measured on 2 and 4 gloo processes, against the planner.

    .venv/bin/python benchmarks/fsdp_accumulation_grads.py [--worlds 2,4]

For zero3 and each precision (fp32, bf16-mixed), the per-rank peak of gpt-tiny (2 blocks, d_model 64) at
micro-batch 6 with accumulation 1, then accumulation 2 with the gradients reduce-scattered after every
micro-batch (per-micro-batch) and once per window (deferred). The increment over accumulation 1 is what the
window's extra micro-batch keeps live; it is compared with ``plan.cost.memory``'s increment for the same rows
(estimate basis). Why: ``plan.cost.memory`` used to add, under a half compute dtype with accumulation, a whole
copy of the gradients in that dtype per device (n_params x 2 bytes, fitted on 2 ranks) to backward and to the
optimizer step, a term that does not shrink with the device count. On 2 ranks n_params x 2 equals the sharded
fp32 gradients (n_params x 4 / 2), so 2 ranks cannot tell the two apart; 4 ranks can (docs/planner.md, "FSDP
and accumulation"). Writes fsdp_accumulation_grads.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = {"model": "gpt-tiny", "model_config": "n_layer=2,d_model=64,n_head=2", "seq_len": 64}
ROWS = [(p, acc, sync) for p in ("fp32", "bf16-mixed")
        for acc, sync in ((1, "deferred"), (2, "per-micro-batch"), (2, "deferred"))]
MICRO_BATCH = 6


def rank_main(rank: int, root: Path) -> None:
    """Inside each rank (``_common.spawn_ranks``)."""
    from trainfit.config import make_config
    from trainfit.probes.memory import measure_memory

    out = []
    for p, acc, sync in ROWS:
        cfg = make_config({**MODEL, "strategy": "zero3", "precision": p, "micro_batch": MICRO_BATCH,
                           "accumulation": acc, "grad_sync": sync})
        out.append(measure_memory(cfg).peak_bytes)
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="2,4")
    args = ap.parse_args()
    from _common import spawn_ranks, write_results

    from trainfit.config import make_config
    from trainfit.plan.cost import Candidate, activation_precision, memory
    from trainfit.probes.calibrate import report_basis

    base = make_config(MODEL)
    bases = {p: report_basis(base, p, "none", source="estimate") for p in ("fp32", "bf16-mixed", "bf16-true")}
    n_params = bases["fp32"].n_params
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        measured = json.loads(Path(spawn_ranks(rank_main, world=world), "rank0.json").read_text())
        predicted = []
        for p, acc, sync in ROWS:
            c = Candidate(precision=p, micro_batch=MICRO_BATCH, accumulation=acc, checkpointing="none",
                          strategy="zero3", grad_sync=sync, n=world)
            predicted.append(memory(bases[p], c, act_basis=bases[activation_precision("zero3", p)]).peak_bytes)
        for i, (p, acc, sync) in enumerate(ROWS):
            first = ROWS.index((p, 1, "deferred"))
            rows.append({"world": world, "precision": p, "accumulation": acc, "grad_sync": sync,
                         "measured_peak": measured[i], "predicted_peak": int(predicted[i]),
                         "measured_increment": measured[i] - measured[first],
                         "predicted_increment": int(predicted[i] - predicted[first])})
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"gpt-tiny {MODEL['model_config']}, seq {MODEL['seq_len']}, n_params {n_params:,} (fp32 gradients "
             f"{4 * n_params:,} B whole); zero3, micro-batch {MICRO_BATCH}; rank 0. Increment: over accumulation 1 "
             "of the same precision and world.", "",
             "| ranks | precision | acc | sync | measured peak | predicted peak | measured increment | "
             "predicted increment |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['world']} | {r['precision']} | {r['accumulation']} | {r['grad_sync']} | "
                     f"{r['measured_peak']:,} | {r['predicted_peak']:,} | {r['measured_increment']:,} | "
                     f"{r['predicted_increment']:,} |")
    write_results("fsdp_accumulation_grads", {"model": MODEL, "n_params": n_params, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
