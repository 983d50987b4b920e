"""What does trainfit's Trainer callback cost when it is not measuring? And what does the measured step cost?

A tiny GPT-2 (2 layers, width 64, vocab 512; built locally, nothing downloaded), micro-batch 8 x seq 64, AdamW,
the HF ``Trainer`` on CPU. Each round runs, in a shuffled order, the same training (same weights, same data)
three ways:

- ``plain``: the Trainer as the user runs it;
- ``callback``: plus ``TrainfitCallback(measure_step=10**9)`` (never measures: per-step bookkeeping and one
  metrics.jsonl line per step, what every step but one costs);
- ``measuring``: plus ``TrainfitCallback(measure_step=1)`` (its second step runs under the memory tracker and
  FlopCounterMode, and the run ends by writing memory.json and report.html).

Step time is read by one timing callback present in all three (``on_step_end`` to ``on_step_end``, the first
``--warmup`` steps dropped), so ``Trainer.train``'s set-up is outside it. The figure is the median over rounds
of the per-round ratio callback/plain of the mean step time (paired, so slow rounds cancel), in this
process's CPU time (robust to other jobs on a shared machine) and in wall time. For ``measuring``
the measured step's own time is compared with the median of the other steps of that run.

    .venv/bin/python benchmarks/callback_overhead.py --rounds 10 --steps 12   # ~5 min on a loaded 2-core CPU
    .venv/bin/python benchmarks/callback_overhead.py --rounds 2   # smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

from trainfit.integrations.hf_callback import TrainfitCallback  # noqa: E402

B, T, VOCAB = 8, 64, 512


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class Clock(transformers.TrainerCallback):
    def __init__(self):
        self.ends: list[float] = []
        self.cpu: list[float] = []

    def on_step_end(self, args, state, control, **kw):
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())  # this process's CPU time: other jobs' load on the machine is not in it


def run_once(model_dir: Path, out: Path, variant: str, steps: int) -> tuple[list[float], list[float], Path]:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel.from_pretrained(model_dir).train()
    clock = Clock()
    cbs = [clock]
    if variant == "callback":
        cbs.append(TrainfitCallback(measure_step=10**9))
    elif variant == "measuring":
        cbs.append(TrainfitCallback(measure_step=1))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=B, max_steps=steps, logging_steps=1, report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=cbs).train()
    gaps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]  # step k+1's time: end k -> end k+1
    return gaps, [b - a for a, b in zip(clock.cpu, clock.cpu[1:])], out


def hook_cost_us(n: int = 20_000) -> float:
    """CPU microseconds the meter's per-step calls take, alone (no model, no Trainer): every hook of a
    non-measured step (one micro-batch) plus its metrics.jsonl line."""
    from trainfit.integrations.measure import MeasureOptions, StepMeter
    m = StepMeter(MeasureOptions(measure_step=10**9), tool="bench")
    m.open(tempfile.mkdtemp())
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"input_ids": torch.zeros(B, T, dtype=torch.long), "labels": torch.zeros(B, T, dtype=torch.long)}
    t = time.process_time()
    for i in range(n):
        m.step_begin(i, model, opt)
        m.micro_batch(kw)
        m.batch_size(kw)
        m.forward_begin()
        m.forward_end()
        m.optimizer_begin(None)
        m.optimizer_end()
        m.step_end(i + 1, lr=0.1, split_backward=True)
        m.log(i + 1, {"loss": 1.0, "grad_norm": 1.0, "learning_rate": 0.1})
    m._flush()
    return (time.process_time() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: no spin-waiting threads in CPU time)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    tmp = Path(tempfile.mkdtemp())
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=T,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp / "model")
    rng = random.Random(0)
    ratios, cpu_ratios, measured_ratios = [], [], []
    means = {"plain": [], "callback": [], "measuring": []}
    for r in range(a.rounds):
        order = ["plain", "callback", "measuring"]
        rng.shuffle(order)
        mean, cpu = {}, {}
        for v in order:
            gaps, cpu_gaps, out = run_once(tmp / "model", tmp / f"{v}{r}", v, a.steps)
            cpu[v] = statistics.fmean(cpu_gaps[a.warmup:])
            keep = gaps[a.warmup:]  # gaps[i] is step i+2
            mean[v] = statistics.fmean(keep)
            means[v].append(mean[v])
            if v == "measuring":
                lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                m = next(x for x in lines if x.get("measured"))
                others = [x["step_s"] for x in lines[a.warmup:] if not x.get("measured")]
                measured_ratios.append(m["step_s"] / statistics.median(others))
        ratios.append(mean["callback"] / mean["plain"])
        cpu_ratios.append(cpu["callback"] / cpu["plain"])
        print(f"round {r}: plain {mean['plain'] * 1e3:.1f} ms, callback {mean['callback'] * 1e3:.1f} ms, "
              f"wall ratio {ratios[-1]:.3f}, CPU-time ratio {cpu_ratios[-1]:.3f}", flush=True)

    def q(xs):
        s = sorted(xs)
        return s[len(s) // 4], statistics.median(s), s[(3 * len(s)) // 4]

    hook_us = hook_cost_us()
    lo, med, hi = q(ratios)
    mlo, mmed, mhi = q(measured_ratios)
    clo, cmed, chi = q(cpu_ratios)
    table = (f"Tiny GPT-2 (2 layers, width 64, vocab 512), micro-batch {B} x seq {T}, AdamW, HF Trainer "
             f"{transformers.__version__} on CPU; {a.rounds} rounds x {a.steps} steps per variant, first {a.warmup} "
             f"step times dropped, variants shuffled per round, {a.threads} torch thread(s).\n\n"
             "| variant | mean ms per step (median over rounds) |\n|---|---|\n"
             + "".join(f"| {v} | {statistics.median(xs) * 1e3:.1f} |\n" for v, xs in means.items())
             + f"\n**callback, not measuring / plain**, median of per-round ratios (IQR): process CPU time "
             f"**{cmed:.3f}** ({clo:.3f} to {chi:.3f}); wall {med:.3f} ({lo:.3f} to {hi:.3f})\n\n"
             f"**the callback's own per-step work, alone** (all hooks of a step + its metrics.jsonl line, "
             f"20,000 steps, CPU time): **{hook_us:.0f} us per step** = "
             f"{hook_us * 1e-6 / statistics.median(means['plain']):.2%} of the plain step here\n\n"
             f"**measured step / median other step** of the measuring run: {mmed:.2f}x ({mlo:.2f} to {mhi:.2f}); "
             "the `measuring` mean leaves out the first steps (the measured one among them), so it has the same per-step "
             "work as `callback`: their difference shows this machine's noise.\n")
    write_results("callback_overhead", {"wall_ratios": ratios, "cpu_ratios": cpu_ratios, "means_s": means, "measured_step_ratios": measured_ratios,
                                        "hook_cost_us_per_step": hook_us,
                                        "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup}, table)
    print(table)


if __name__ == "__main__":
    main()
