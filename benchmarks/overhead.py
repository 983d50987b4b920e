"""What does trainfit cost per optimizer step, beside a hand-written loop, Accelerate and Fabric?

Two measurements, each interleaving the five ways of writing the same step in one process
(round-robin in a shuffled order per round, so machine load hits all of them alike):

1. The real job: the built-in GPT (gpt-tiny, 3.3M params, seq 64), micro-batch 8 x accumulation 4,
   AdamW, clip 1.0, in fp32 and bf16-mixed. Each sample is one optimizer step; the ratio to the
   hand loop is the median of the per-round ratios (paired, so slow rounds cancel).
2. The fixed cost: one ``Linear(32, 32)``, 4 micro-batches of 16 rows, the same step. Each sample is
   a block of ``--block`` optimizer steps; the overhead is the median over rounds of
   (variant block - hand block) / block, in microseconds per optimizer step.

Every variant does the same arithmetic: the window's loss sum divided by the window's item count
(Accelerate's ``backward`` divides by the accumulation steps, so its loss is multiplied back), one
loss read-back per step, clipping at 1.0, AdamW. The final losses are printed beside the times as a
check that the five loops train the same way. ``trainfit-run`` is the same step through ``Run.step``, the
path the training loop and the probes take (one call more than ``optimizer_step``).

Needs ``pip install -r benchmarks/requirements.txt`` (accelerate, lightning); not part of the tests.

    .venv/bin/python benchmarks/overhead.py            # ~10 min on a loaded 2-core CPU
    .venv/bin/python benchmarks/overhead.py --quick    # smoke run
    # the fixed cost of trainfit alone, results under another name (before/after a change; old code: PYTHONPATH)
    .venv/bin/python benchmarks/overhead.py --only tiny --tiny-rounds 150 --block 20 \
        --variants trainfit trainfit-run --name overhead_quiet
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write_results  # noqa: E402

import trainfit  # noqa: E402
from trainfit.config import RunConfig  # noqa: E402
from trainfit.levers.schedule import make_scheduler  # noqa: E402
from trainfit.run import Run  # noqa: E402
from trainfit.strategies import Single  # noqa: E402
from trainfit.tasks.make import make_task  # noqa: E402

VARIANTS = ("hand", "trainfit", "trainfit-run", "accelerate", "fabric")
PRECISIONS = ("fp32", "bf16-mixed")
ACCUM = 4
CLIP = 1.0


# ---- the five ways to write one optimizer step -------------------------------------------------

def hand_loop(model, loss_fn, count_fn, precision):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None

    def step(mbs):
        total = sum(count_fn(mb) for mb in mbs)
        loss_total = 0.0
        for mb in mbs:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss_sum, _ = loss_fn(model, mb)
            (loss_sum / total).backward()
            loss_total += loss_sum.detach()
        loss = float(loss_total) / total  # the one read-back per step every loop does (logging)
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def trainfit_loop(model, loss_fn, count_fn, precision):
    prec = trainfit.make_precision(precision)
    prec.prepare(model)
    opt = torch.optim.AdamW(prec.optimizer_params(model), lr=3e-3)

    def step(mbs):
        return trainfit.optimizer_step(model=model, optimizer=opt, precision=prec, micro_batches=mbs,
                                       loss_fn=loss_fn, count_fn=count_fn, grad_clip=CLIP).loss

    return step


def trainfit_run_loop(model, loss_fn, count_fn, precision):
    """The same step through ``Run.step``, the path ``trainfit train`` and the probes take."""
    prec = trainfit.make_precision(precision)
    prec.prepare(model)
    opt = torch.optim.AdamW(prec.optimizer_params(model), lr=3e-3)
    task = SimpleNamespace(loss=loss_fn, count=count_fn)  # Run.step reads only these two of its task
    cfg = RunConfig(grad_clip=CLIP)
    # the schedule build_run gives every run (constant, no warm-up: the lr stays 3e-3 to the bit), moved by Run.step
    run = Run(cfg=cfg, task=task, model=model, precision=prec, strategy=Single(), optimizer=opt,
              scheduler=make_scheduler(opt, cfg))

    def step(mbs):
        return run.step(mbs).loss

    return step


def accelerate_loop(model, loss_fn, count_fn, precision):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerator per (precision, model)
    acc = Accelerator(cpu=True, mixed_precision="bf16" if precision == "bf16-mixed" else "no",
                      gradient_accumulation_steps=ACCUM)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)

    def step(mbs):
        total = sum(count_fn(mb) for mb in mbs)
        loss_total = 0.0
        for mb in mbs:
            with acc.accumulate(model):
                loss_sum, _ = loss_fn(model, mb)
                acc.backward(loss_sum * ACCUM / total)  # backward() divides by the accumulation steps
                loss_total += loss_sum.detach()
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()  # a no-op until the last micro-batch
                opt.zero_grad(set_to_none=True)
        return float(loss_total) / total

    return step


def fabric_loop(model, loss_fn, count_fn, precision):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed" if precision == "bf16-mixed" else "32-true")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = fabric.setup(model, opt)

    def step(mbs):
        total = sum(count_fn(mb) for mb in mbs)
        loss_total = 0.0
        for i, mb in enumerate(mbs):
            with fabric.no_backward_sync(model, enabled=i < len(mbs) - 1):
                loss_sum, _ = loss_fn(model, mb)
                fabric.backward(loss_sum / total)
            loss_total += loss_sum.detach()
        loss = float(loss_total) / total
        fabric.clip_gradients(model, opt, max_norm=CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


LOOPS = {"hand": hand_loop, "trainfit": trainfit_loop, "trainfit-run": trainfit_run_loop, "accelerate": accelerate_loop,
         "fabric": fabric_loop}


# ---- jobs ------------------------------------------------------------------------------------------

def gpt_job(n_windows: int):
    task = make_task("gpt-tiny", seq_len=64, seed=0, dataset_size=8 * ACCUM * n_windows)
    ds = task.dataset()
    mbs = [task.collate([ds[i * 8 + j] for j in range(8)]) for i in range(ACCUM * n_windows)]
    windows = [mbs[i * ACCUM:(i + 1) * ACCUM] for i in range(n_windows)]
    return task.build_model(), task.loss, task.count, windows


def linear_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y, reduction="sum"), y.numel()


def linear_job(n_windows: int):
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    data = [(torch.randn(16, 32), torch.randn(16, 32)) for _ in range(ACCUM * n_windows)]
    windows = [data[i * ACCUM:(i + 1) * ACCUM] for i in range(n_windows)]
    return model, linear_loss, lambda b: b[1].numel(), windows


# ---- measurement -----------------------------------------------------------------------------------

def spread(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "n": len(values), **median_ci(values)}


def median_ci(values: list[float], n_boot: int = 2000) -> dict:
    """95% bootstrap interval of the median (how sure the median is, not how wide the spread is)."""
    rng = random.Random(1)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n_boot))
    return {"median_ci95": [meds[int(0.025 * n_boot)], meds[int(0.975 * n_boot) - 1]]}


def build(job, precision, variants=VARIANTS):
    model, loss_fn, count_fn, windows = job
    return {v: LOOPS[v](copy.deepcopy(model), loss_fn, count_fn, precision) for v in variants}, windows


def interleave(steps, windows, *, rounds: int, block: int, warmup: int, rng: random.Random):
    """Times of ``block`` optimizer steps per variant per round, variants in a fresh random order each round."""
    times = {v: [] for v in steps}
    cpu = {v: [] for v in steps}
    losses = {v: math.nan for v in steps}
    pos = {v: 0 for v in steps}
    for r in range(warmup + rounds):
        order = list(steps)
        rng.shuffle(order)
        for v in order:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(block):
                losses[v] = steps[v](windows[pos[v] % len(windows)])
                pos[v] += 1
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if r >= warmup:
                times[v].append(dt / block)
                cpu[v].append(dc / block)
    return times, cpu, losses


def summarise(times: dict, cpu: dict, losses: dict) -> dict:
    """Wall and CPU (process) time; CPU time is what the loop itself costs, whatever else runs on the box."""
    out = {}
    for v in times:
        row = {"final_loss": losses[v]}
        for key, src in (("", times), ("cpu_", cpu)):
            ts, hand = src[v], src["hand"]
            row[f"{key}step_s"] = spread(ts)
            row[f"{key}ratio_to_hand"] = spread([t / h for t, h in zip(ts, hand)])
            row[f"{key}added_us_per_step"] = spread([(t - h) * 1e6 for t, h in zip(ts, hand)])
        out[v] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpt-rounds", type=int, default=15, help="optimizer steps per variant per precision (GPT)")
    ap.add_argument("--tiny-rounds", type=int, default=40, help="blocks per variant per precision (Linear)")
    ap.add_argument("--block", type=int, default=50, help="optimizer steps per timed block (Linear)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise when shared)")
    ap.add_argument("--quick", action="store_true", help="a few rounds only (smoke test; not for results)")
    ap.add_argument("--only", choices=("gpt", "tiny"), help="run one of the two measurements")
    ap.add_argument("--markdown-only", action="store_true", help="rewrite overhead.md from overhead.json")
    ap.add_argument("--name", default="overhead", help="results file name (benchmarks/results/NAME.json and .md)")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                    help="loops to run (hand is always one: the others are measured against it)")
    args = ap.parse_args()
    if args.markdown_only:
        import json

        res = json.loads((RESULTS / f"{args.name}.json").read_text())
        head = (RESULTS / f"{args.name}.md").read_text().split("\n\n## ", 1)[0]
        (RESULTS / f"{args.name}.md").write_text(head + "\n\n" + markdown(res) + "\n")
        return
    if args.quick:
        args.gpt_rounds, args.tiny_rounds, args.block = 2, 3, 10
    torch.set_num_threads(args.threads)
    variants = [v for v in VARIANTS if v == "hand" or v in args.variants]
    warnings.filterwarnings("ignore")  # Fabric warns that no_backward_sync is a no-op on one device
    rng = random.Random(0)
    import accelerate
    import lightning

    results: dict = {"versions": {"torch": torch.__version__, "accelerate": accelerate.__version__,
                                  "lightning": lightning.__version__, "trainfit": trainfit.__version__},
                     "threads": args.threads, "accumulation": ACCUM, "gpt": {}, "tiny": {}}
    for prec in PRECISIONS:
        if args.only != "tiny":
            steps, windows = build(gpt_job(8), prec, variants)
            t, c, l = interleave(steps, windows, rounds=args.gpt_rounds, block=1, warmup=2, rng=rng)
            results["gpt"][prec] = summarise(t, c, l)
            print_rows(f"gpt-tiny {prec}", results["gpt"][prec])
        if args.only != "gpt":
            steps, windows = build(linear_job(8), prec, variants)
            t, c, l = interleave(steps, windows, rounds=args.tiny_rounds, block=args.block, warmup=2, rng=rng)
            results["tiny"][prec] = summarise(t, c, l)
            print_rows(f"Linear(32,32) {prec}", results["tiny"][prec])
    results["settings"] = vars(args)
    old = RESULTS / f"{args.name}.json"
    if args.only and old.exists():  # re-measured one part: keep the other from the last full run
        import json

        prev = json.loads(old.read_text())
        other = "tiny" if args.only == "gpt" else "gpt"
        results[other] = prev.get(other, {})
        results["settings_" + other] = prev.get("settings_" + other, prev.get("settings"))
        results["commands"] = {**prev.get("commands", {}), args.only: "python " + " ".join(sys.argv)}
    else:
        results["commands"] = {part: "python " + " ".join(sys.argv) for part in ("gpt", "tiny")
                               if args.only in (None, part)}
    results["settings_" + (args.only or "all")] = vars(args)
    if not args.quick:
        write_results(args.name, results, markdown(results))


def print_rows(title: str, rows: dict) -> None:
    print(title, file=sys.stderr)
    for v, r in rows.items():
        s, q, c = r["step_s"], r["ratio_to_hand"], r["cpu_ratio_to_hand"]
        print(f"  {v:<11} {s['median'] * 1e3:9.3f} ms  wall x{q['median']:.3f} [{q['p25']:.3f}-{q['p75']:.3f}]  "
              f"cpu x{c['median']:.3f} [{c['p25']:.3f}-{c['p75']:.3f}] +{r['cpu_added_us_per_step']['median']:8.1f} us"
              f"  loss {r['final_loss']:.4f}", file=sys.stderr)


def markdown(res: dict) -> str:
    def q(d: dict, f: str, k: float = 1.0) -> str:
        return f"{d['median'] * k:{f}} ({d['p25'] * k:{f}} to {d['p75'] * k:{f}})"

    out = []
    if res["gpt"]:
        out += ["## Built-in GPT (gpt-tiny, micro-batch 8 x accumulation 4, seq 64)", "",
                "| precision | loop | wall ms per step | ratio to hand loop, CPU time | ratio to hand loop, wall | "
                "final loss |", "|---|---|---|---|---|---|"]
        for prec, rows in res["gpt"].items():
            for v, r in rows.items():
                out.append(f"| {prec} | {v} | {q(r['step_s'], '.0f', 1e3)} | {q(r['cpu_ratio_to_hand'], '.3f')} | "
                           f"{q(r['ratio_to_hand'], '.3f')} | {r['final_loss']:.4f} |")
        out.append("")
    if res["tiny"]:
        out += ["## Fixed cost per optimizer step: Linear(32,32), 4 micro-batches of 16 rows", "",
                "| precision | loop | CPU us per step | added CPU us per step vs hand (IQR) | 95% CI of that median | "
                "added wall us per step vs hand (IQR) |", "|---|---|---|---|---|---|"]
        for prec, rows in res["tiny"].items():
            for v, r in rows.items():
                ci = r["cpu_added_us_per_step"]["median_ci95"]
                out.append(f"| {prec} | {v} | {r['cpu_step_s']['median'] * 1e6:.0f} | "
                           f"{q(r['cpu_added_us_per_step'], '.0f')} | {ci[0]:.0f} to {ci[1]:.0f} | "
                           f"{q(r['added_us_per_step'], '.0f')} |")
    v = res["versions"]
    out += [""] + [f"{'GPT' if k == 'gpt' else 'Fixed-cost'} rows: `{c}`  " for k, c in res.get("commands", {}).items()]
    out += ["", f"Medians over rounds with the interquartile range in brackets; ratios and differences are paired "
                f"within a round. CPU time is the process's own (time.process_time), robust to other load on the "
                f"machine; wall time is what a user waits. torch {v['torch']}, accelerate {v['accelerate']}, "
                f"lightning {v['lightning']}, {res['threads']} torch thread(s); variants interleaved in a shuffled "
                f"order every round."]
    return "\n".join(out)


if __name__ == "__main__":
    main()
