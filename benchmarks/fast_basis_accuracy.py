"""The fast basis against the full-depth trace, for every family plan_speed times, at CPU-traceable sizes.

    .venv/bin/python benchmarks/fast_basis_accuracy.py [--cases gpt2,mistral,t5,vit,llama]

For each model (the plan_speed families, shrunk: 6 blocks, width 64-128, sequence 64) and each
(precision, checkpointing) pair the planner traces by default, the fast basis (``probes.fastbasis``: 3 and 4
blocks, two windowed traces, extrapolated in depth) predicts the peak of four windows -- micro-batch x
accumulation (2, 1), (4, 1), (3, 2), (6, 3) -- through ``plan.cost.memory``; the reference is
``estimate_memory(..., shortcut=False)``: one fake-tensor trace of the whole model at that window, no
extrapolation. A third column separates the two approximations in the fast basis's number: the basis fitted
from four *full-depth* traces (``--basis estimate``'s reports, at the same kernels) through the same
``plan.cost.memory``. fast vs that basis is the depth extrapolation alone; that basis vs the full trace is the
planner's window model (linear in the micro-batch, accumulation from the two accumulation-2 reports), which
every basis shares. Writes benchmarks/results/fast_basis_accuracy.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

from trainfit.config import make_config  # noqa: E402
from trainfit.plan.basis import BASIS_BATCHES, basis_from_reports  # noqa: E402
from trainfit.plan.cost import Candidate, memory  # noqa: E402
from trainfit.probes.estimate import estimate_memory  # noqa: E402
from trainfit.probes.estimate import model_units  # noqa: E402
from trainfit.probes.fastbasis import fast_basis  # noqa: E402

CASES = {
    "gpt2": ("hf:GPT2LMHeadModel", "n_layer=6,n_embd=64,n_head=4,vocab_size=512,n_positions=64"),
    "mistral": ("hf:MistralForCausalLM", "hidden_size=64,intermediate_size=224,num_hidden_layers=6,"
                "num_attention_heads=4,num_key_value_heads=2,vocab_size=512,max_position_embeddings=64"),
    "t5": ("hf:T5ForConditionalGeneration", "d_model=64,d_ff=256,num_layers=6,num_heads=4,d_kv=16,vocab_size=512"),
    "vit": ("hf:ViTForImageClassification", "hidden_size=64,intermediate_size=256,num_hidden_layers=6,"
            "num_attention_heads=4,image_size=32,patch_size=4"),
    "llama": ("hf:LlamaForCausalLM", "hidden_size=64,intermediate_size=160,num_hidden_layers=6,num_attention_heads=4,"
              "num_key_value_heads=2,vocab_size=512,max_position_embeddings=64"),
}
PAIRS = (("fp32", "none"), ("bf16-mixed", "none"), ("bf16-mixed", "full"), ("bf16-true", "full"))
WINDOWS = ((2, 1), (4, 1), (3, 2), (6, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--target", default="h100", help="the kernels traced (both sides the same)")
    args = ap.parse_args()
    rows = []
    for name in args.cases.split(","):
        model, mc = CASES[name]
        base = make_config({"model": model, "model_config": mc, "seq_len": 64})
        for p, ck in PAIRS:
            t0 = time.perf_counter()
            fast = fast_basis(base, p, ck, target=args.target, use_cache=False)
            fast_s = time.perf_counter() - t0
            pair = make_config({"precision": p, "checkpointing": ck, "micro_batch": 1, "accumulation": 1}, base=base)
            reps = [estimate_memory(make_config({"accumulation": a}, base=pair), batch=b, shortcut=False,
                                    target=args.target) for a in (1, 2) for b in BASIS_BATCHES]
            n_blocks, n_tensors, max_unit = model_units(pair)
            full_basis = basis_from_reports(reps[0], reps[1], acc_reports=(reps[2], reps[3]), n_blocks=n_blocks,
                                            model_flops_per_sample=0.0, hardware_flops_per_sample=0.0,
                                            n_param_tensors=n_tensors, max_unit_params=max_unit)
            for mb, acc in WINDOWS:
                cfg = make_config({"precision": p, "checkpointing": ck, "micro_batch": mb, "accumulation": acc},
                                  base=base)
                full = estimate_memory(cfg, shortcut=False, target=args.target).peak_bytes
                cand = Candidate(precision=p, micro_batch=mb, accumulation=acc, checkpointing=ck, strategy="single",
                                 grad_sync="deferred", n=1)
                pred, est = memory(fast, cand).peak_bytes, memory(full_basis, cand).peak_bytes
                rows.append({"case": name, "precision": p, "checkpointing": ck, "micro_batch": mb,
                             "accumulation": acc, "fast_peak": int(pred), "full_peak": int(full),
                             "error": pred / full - 1, "estimate_basis_peak": int(est),
                             "depth_error": pred / est - 1, "window_error": est / full - 1, "fast_s": round(fast_s, 2),
                             "how": fast.source.split(";")[0]})
                print(json.dumps(rows[-1]), flush=True)
    lines = ["| model | precision | ckpt | mb x acc | fast basis peak | full-depth trace peak | error | "
             "estimate basis peak | fast vs estimate basis (depth) | estimate basis vs trace (window model) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['precision']} | {r['checkpointing']} | {r['micro_batch']} x "
                     f"{r['accumulation']} | {r['fast_peak']:,} | {r['full_peak']:,} | {r['error']:+.2%} | "
                     f"{r['estimate_basis_peak']:,} | {r['depth_error']:+.2%} | {r['window_error']:+.2%} |")
    worst = max(abs(r["error"]) for r in rows)
    worst_depth = max(abs(r["depth_error"]) for r in rows)
    worst_window = max(abs(r["window_error"]) for r in rows)
    write_results("fast_basis_accuracy", {"target": args.target, "rows": rows},
                  f"Kernels of {args.target} on both sides; {len(rows)} rows, max |error| {worst:.2%}: of it, the "
                  f"depth extrapolation (fast vs the full-depth estimate basis) at most {worst_depth:.2%}, the "
                  f"window model every basis shares at most {worst_window:.2%} "
                  f"(windows (2,1) and (4,1) are points the basis is fitted at; (3,2) and (6,3) are held out).\n\n"
                  + "\n".join(lines))


if __name__ == "__main__":
    main()
