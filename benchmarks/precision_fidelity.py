"""Does lower precision train the same? Loss curves of every precision policy, and why fp16 needs loss scaling.

Trains the built-in GPT (small: 2 layers, d_model 64, seq 32, micro-batch 16) from the same initial
weights on the same batches, once per policy: fp32, bf16-mixed, fp16-mixed, fp16-true, and fp16 with
loss scaling turned off (autocast fp16 and fp16 weights, each with the no-op scaler in place of the
dynamic one). Before every optimizer step a hook on the optimizer records the share of gradient values
that are exactly zero; on the fp32 run it also records the share of non-zero gradient values that would
round to zero in fp16 (``trainfit.probes.verify.fp16_underflow_fraction``) -- the values that unscaled fp16
loses.

    .venv/bin/python benchmarks/precision_fidelity.py              # ~5-10 min on a loaded 2-core CPU
    .venv/bin/python benchmarks/precision_fidelity.py --steps 3    # smoke run (writes nothing)

Writes benchmarks/results/precision_fidelity.{json,md,png}.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write_results  # noqa: E402

import trainfit  # noqa: E402
from trainfit.levers.precision import AutocastMixed, HalfWithMaster, make_precision  # noqa: E402
from trainfit.levers.scaler import NoScaler  # noqa: E402
from trainfit.probes.verify import fp16_underflow_fraction  # noqa: E402
from trainfit.tasks.make import make_task  # noqa: E402
from trainfit.vocabulary import precision_facts  # noqa: E402

MODEL_CONFIG = "n_layer=2,d_model=64,n_head=2"
SEQ, MICRO_BATCH = 32, 16


def unscaled(policy):
    policy.scaler = NoScaler()  # the fp16 policy, minus its loss scaler: what fp16 training is without it
    return policy


VARIANTS = {
    "fp32": lambda: make_precision("fp32"),
    "bf16-mixed": lambda: make_precision("bf16-mixed"),
    "fp16-mixed": lambda: make_precision("fp16-mixed"),
    "fp16-true": lambda: make_precision("fp16-true"),
    "fp16-mixed, no loss scaling": lambda: unscaled(AutocastMixed(precision_facts("fp16-mixed"))),
    "fp16-true, no loss scaling": lambda: unscaled(HalfWithMaster(precision_facts("fp16-true"))),
}


def lost_share(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Share of the reference's non-zero gradient values that are exactly zero here (same weights, same batch)."""
    nz = ref != 0
    return float(((got == 0) & nz).sum()) / max(int(nz.sum()), 1)


def train_one(name: str, model0, task, windows, ref_step1: torch.Tensor | None, quiet: bool = False) -> dict:
    model = copy.deepcopy(model0)
    precision = VARIANTS[name]()
    precision.prepare(model)
    opt = torch.optim.AdamW(precision.optimizer_params(model), lr=3e-3)
    zeros, would_underflow, first = [], [], []

    def probe(optimizer, args, kwargs):  # runs before every optimizer step, on the unscaled fp32 gradients
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        flat = torch.cat([g.detach().float().flatten() for g in grads])
        zeros.append(float((flat == 0).float().mean()))
        if not first:
            first.append(flat.clone())
        if name == "fp32":
            would_underflow.append(fp16_underflow_fraction(grads))

    opt.register_step_pre_hook(probe)
    losses, skipped, scales = [], [], []
    t0 = time.perf_counter()
    for i, window in enumerate(windows):
        r = trainfit.optimizer_step(model=model, optimizer=opt, precision=precision, micro_batches=window,
                                    loss_fn=task.loss, count_fn=task.count, grad_clip=1.0)
        losses.append(r.loss)
        scales.append(r.loss_scale)
        if not r.stepped:
            skipped.append(i + 1)
    out = {"loss": losses, "skipped_steps": skipped, "loss_scale": scales, "wall_s": time.perf_counter() - t0,
           "zero_grad_share_median": statistics.median(zeros) if zeros else None, "zero_grad_share": zeros}
    out["step1_grads"] = first[0]
    if ref_step1 is not None:
        out["lost_at_step1_share"] = lost_share(ref_step1, first[0])
    if would_underflow:
        out["fp16_underflow_share"] = would_underflow
        out["fp16_underflow_share_median"] = statistics.median(would_underflow)
    if not quiet:
        print(f"{name:<28} loss {losses[0]:.4f} -> {losses[-1]:.4f}  skipped {len(skipped)}  zero grads "
              f"{out['zero_grad_share_median']:.4f}  lost at step 1 {out.get('lost_at_step1_share', 0):.4%}  "
              f"fp16 underflow (fp32 run) {out.get('fp16_underflow_share_median', math.nan):.4%}  "
              f"{out['wall_s']:.0f}s", file=sys.stderr)
    return out


SWEEP = (1, 4, 16, 64)
"""Micro-batches per optimizer step for the underflow sweep (loss normalised by all their tokens)."""


def sweep(model0, task, ds, ks) -> list[dict]:
    """One optimizer step at growing tokens per step: what unscaled fp16 loses grows as 1/tokens shrinks grads.

    The loss is the window's sum over its token count, so every activation gradient in backward is divided
    by the tokens of the whole window: more accumulation, smaller values, more of them below fp16's range.
    """
    rows = []
    for k in ks:
        window = [task.collate([ds[(i * MICRO_BATCH + j) % len(ds)] for j in range(MICRO_BATCH)]) for i in range(k)]
        ref = train_one("fp32", model0, task, [window], None, quiet=True)
        row = {"accumulation": k, "tokens": sum(task.count(mb) for mb in window),
               "fp32_grads_underflowing_in_fp16": ref["fp16_underflow_share"][0]}
        for name in ("fp16-mixed", "fp16-mixed, no loss scaling", "fp16-true, no loss scaling"):
            row[name] = train_one(name, model0, task, [window], ref["step1_grads"], quiet=True)["lost_at_step1_share"]
        print(f"sweep k={k}: {row}", file=sys.stderr)
        rows.append(row)
    return rows


def tail_mean(xs: list[float], n: int = 10) -> float:
    finite = [x for x in xs[-n:] if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else math.nan


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, d, b) = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {"fp32": ("black", "-"), "bf16-mixed": ("#4C72B0", "-"), "fp16-mixed": ("#55A868", "-"),
              "fp16-true": ("#8172B3", "--"), "fp16-mixed, no loss scaling": ("#C44E52", "-"),
              "fp16-true, no loss scaling": ("#DD8452", "--")}
    ref = res["runs"]["fp32"]["loss"]
    for name, r in res["runs"].items():
        c, ls = styles[name]
        steps = range(1, len(r["loss"]) + 1)
        a.plot(steps, r["loss"], color=c, ls=ls, lw=1.3, label=name)
        d.plot(steps, [x - y for x, y in zip(r["loss"], ref)], color=c, ls=ls, lw=1.3, label=name)
    a.set(xlabel="optimizer step", ylabel="training loss", title="Loss: same weights, same batches")
    d.set(xlabel="optimizer step", ylabel="loss minus fp32 loss", title="Difference to fp32")
    for ax in (a, d):
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(10)
    a.legend(fontsize=8)
    sw = res.get("tokens_sweep", [])
    if sw:
        toks = [r["tokens"] for r in sw]
        b.plot(toks, [100 * r["fp32_grads_underflowing_in_fp16"] for r in sw], "k:o", ms=3,
               label="fp32 grads that round to 0 in fp16")
        for name in ("fp16-mixed, no loss scaling", "fp16-true, no loss scaling", "fp16-mixed"):
            b.plot(toks, [100 * r[name] for r in sw], marker="o", ms=3, color=styles[name][0], ls=styles[name][1],
                   label=f"{name}: lost")
        b.set_xscale("log", base=2)
        b.set(xlabel="loss-bearing tokens per optimizer step (accumulation 1-64)",
              ylabel="% of fp32's non-zero gradient values", title="Gradient values lost at step 1")
        b.title.set_fontsize(10)
        b.grid(alpha=0.3)
        b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--from-json", action="store_true", help="redraw the plot and table from the saved JSON")
    args = ap.parse_args()
    if args.from_json:
        import json

        res = json.loads((RESULTS / "precision_fidelity.json").read_text())
        plot(res, RESULTS / "precision_fidelity.png")
        head = (RESULTS / "precision_fidelity.md").read_text().split("\n\nBuilt-in GPT", 1)[0]
        (RESULTS / "precision_fidelity.md").write_text(head + "\n\n" + markdown(res) + "\n")
        return
    torch.set_num_threads(args.threads)
    task = make_task("gpt-tiny", model_config=MODEL_CONFIG, seq_len=SEQ, seed=0, dataset_size=MICRO_BATCH * args.steps)
    ds = task.dataset()
    batches = [[task.collate([ds[i * MICRO_BATCH + j] for j in range(MICRO_BATCH)])] for i in range(args.steps)]
    model0 = task.build_model()
    res = {"model": f"gpt-tiny {MODEL_CONFIG}", "seq_len": SEQ, "micro_batch": MICRO_BATCH, "accumulation": 1,
           "steps": args.steps, "optimizer": "AdamW lr 3e-3, clip 1.0", "threads": args.threads,
           "n_params": sum(p.numel() for p in model0.parameters()), "runs": {}}
    ref = None
    for name in VARIANTS:  # fp32 first: its first-step gradients are the reference
        r = train_one(name, model0, task, batches, ref)
        step1 = r.pop("step1_grads")
        ref = step1 if ref is None else ref
        res["runs"][name] = r
    res["tokens_sweep"] = sweep(model0, task, ds, (1, 2) if args.steps < 10 else SWEEP)
    if args.steps < 10:
        return  # smoke run
    RESULTS.mkdir(exist_ok=True)
    plot(res, RESULTS / "precision_fidelity.png")
    write_results("precision_fidelity", res, markdown(res))


def markdown(res: dict) -> str:
    ref = tail_mean(res["runs"]["fp32"]["loss"])
    rows = [f"Built-in GPT ({res['model']}, {res['n_params']:,} parameters), seq {res['seq_len']}, micro-batch "
            f"{res['micro_batch']}, {res['steps']} steps, {res['optimizer']}; same initial weights and batches for "
            "every policy.", "", "![loss curves](precision_fidelity.png)", "",
            "| policy | first loss | mean loss, last 10 steps | vs fp32 | skipped steps | fp32's non-zero gradient "
            "values lost (exactly 0) at step 1 |", "|---|---|---|---|---|---|"]
    for name, r in res["runs"].items():
        tm = tail_mean(r["loss"])
        rows.append(f"| {name} | {r['loss'][0]:.4f} | {tm:.4f} | {tm - ref:+.4f} | {len(r['skipped_steps'])} | "
                    f"{100 * r.get('lost_at_step1_share', 0.0):.3f}% |")
    rows += ["", "Underflow grows with the tokens per optimizer step (the loss is divided by all of them, so every "
                 "activation gradient shrinks): one step from the same initial weights, accumulation 1 to 64 micro-"
                 "batches of 16 sequences; share of fp32's non-zero gradient values that are exactly 0:", "",
             "| accumulation | tokens | fp32 values that round to 0 in fp16 | fp16-mixed (scaled) | fp16-mixed, no "
             "loss scaling | fp16-true, no loss scaling |", "|---|---|---|---|---|---|"]
    for r in res.get("tokens_sweep", []):
        rows.append(f"| {r['accumulation']} | {r['tokens']:,} | {100 * r['fp32_grads_underflowing_in_fp16']:.3f}% | "
                    f"{100 * r['fp16-mixed']:.3f}% | {100 * r['fp16-mixed, no loss scaling']:.3f}% | "
                    f"{100 * r['fp16-true, no loss scaling']:.3f}% |")
    u = res["runs"]["fp32"]["fp16_underflow_share"]
    rows += ["", f"Share of the fp32 run's non-zero gradient values that would round to zero if stored in fp16 "
                 f"(an upper bound: the unscaled fp16 runs lose fewer, because fp16-mixed reduces weight gradients "
                 f"into fp32 and fp16-true's half gradients are computed by fp32-accumulating kernels): median {100 * statistics.median(u):.2f}%, first step {100 * u[0]:.2f}%, last step "
                 f"{100 * u[-1]:.2f}%."]
    return "\n".join(rows)


if __name__ == "__main__":
    main()
