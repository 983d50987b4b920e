"""Soak: the default job for 10x its length, resumed every segment, watching for leaks.

One long-lived process runs ``train`` in segments of ``--segment`` steps; each segment
after the first is a fresh ``train(..., resume=True)`` from the newest checkpoint (a new
model, optimizer and data loader every time -- what leaks across resumes shows up here),
with checkpoints every ``--checkpoint-every`` steps. After every segment it records the
resident set size (RSS), open file descriptors, threads and child processes.

Figures: the RSS slope after warm-up (least squares over segment ends, MiB per 1000
steps), the change in file descriptors / threads / children after warm-up (must be 0),
the peak RSS sampled every 0.2 s, and that the loss went down. RSS is read after a
``gc.collect()`` (retained memory; a slope before it is reported too: garbage in reference
cycles waits for the cycle collector). Results go to
``benchmarks/results/soak*.json`` and ``.md``.

Usage::

    python benchmarks/soak.py                          # default job, 2500 steps (10 x 250)
    python benchmarks/soak.py --model-config n_layer=1,d_model=32,n_head=2 --seq 16 \\
        --micro-batch 2 --accumulation 2 --tag tiny    # the tiny GPT, same length
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def children() -> list[int]:
    """Live processes whose parent is this one (DataLoader workers, anything forked)."""
    me, out = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(int(pid))
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


class PeakSampler(threading.Thread):
    def __init__(self, period_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.period_s, self.peak, self._halt = period_s, 0, threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period_s):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> None:
        self._halt.set()
        self.join()


def soak(values: dict, *, steps: int, segment: int, warmup_segments: int, run_dir: Path,
         partial: Path | None = None) -> dict:
    import torch

    from trainfit.config import make_config
    from trainfit.train import train

    rows = []
    sampler = PeakSampler()
    sampler.start()
    t0 = time.perf_counter()
    first_loss = last_loss = None
    done = 0
    while done < steps:
        target = min(done + segment, steps)
        cfg = make_config({**values, "steps": target, "run_dir": str(run_dir)})
        summary = train(cfg, resume=done > 0, progress=False)
        done = target
        first_loss = summary.first_loss if first_loss is None else first_loss
        last_loss = summary.final_loss
        raw = rss_bytes()
        gc.collect()  # what is still referenced is a leak; garbage awaiting the cycle collector is not
        rows.append({"step": done, "rss_mib": rss_bytes() / 2**20, "rss_raw_mib": raw / 2**20, "fds": open_fds(),
                     "threads": threads(),
                     "children": len(children()), "loss": summary.final_loss, "skipped": summary.skipped_steps,
                     "wall_s": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if partial is not None:
            partial.write_text(json.dumps({"values": values, "rows": rows}) + "\n")  # figures even if stopped
    sampler.stop()
    after = rows[warmup_segments:]
    xs = [r["step"] for r in after]
    rss_slope = slope(xs, [r["rss_mib"] for r in after]) * 1000 if len(after) > 1 else 0.0
    raw_slope = slope(xs, [r["rss_raw_mib"] for r in after]) * 1000 if len(after) > 1 else 0.0
    base = rows[warmup_segments - 1] if warmup_segments else rows[0]
    return {
        "steps": steps,
        "segments_resumed": len(rows) - 1,
        "checkpoint_every": values.get("checkpoint_every"),
        "rss_slope_mib_per_1000_steps": round(rss_slope, 3),
        "rss_slope_before_gc_mib_per_1000_steps": round(raw_slope, 3),
        "rss_after_warmup_mib": [round(after[0]["rss_mib"], 1), round(after[-1]["rss_mib"], 1)] if after else None,
        "rss_peak_mib": round(sampler.peak / 2**20, 1),
        # Start of the measured window, its end, and its maximum (a batch in flight holds a few briefly).
        "fds_after_warmup": [base["fds"], rows[-1]["fds"], max(r["fds"] for r in after)] if after else None,
        "threads_after_warmup": [base["threads"], rows[-1]["threads"], max(r["threads"] for r in after)]
        if after else None,
        "children_at_end": rows[-1]["children"],
        "first_loss": round(first_loss, 4),
        "final_loss": round(last_loss, 4),
        "wall_s": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__,
        "rows": rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2500, help="10 x the default job's 250 steps")
    ap.add_argument("--segment", type=int, default=100, help="steps per train() call; each later one resumes")
    ap.add_argument("--checkpoint-every", type=int, default=25)
    ap.add_argument("--warmup-segments", type=int, default=3)
    ap.add_argument("--model-config", default="")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--accumulation", type=int, default=None)
    ap.add_argument("--loader-workers", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--tag", default="default")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    values = {"checkpoint_every": a.checkpoint_every, "loader_workers": a.loader_workers}
    for key, v in (("model_config", a.model_config), ("seq_len", a.seq), ("micro_batch", a.micro_batch),
                   ("accumulation", a.accumulation)):
        if v:
            values[key] = v
    with tempfile.TemporaryDirectory(prefix="trainfit-soak-") as tmp:
        a.out.mkdir(parents=True, exist_ok=True)
        result = soak(values, steps=a.steps, segment=a.segment, warmup_segments=a.warmup_segments,
                      run_dir=Path(tmp) / "run", partial=a.out / f"soak_{a.tag}.partial.json")
    result["config"] = values
    result["command"] = " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]])
    a.out.mkdir(parents=True, exist_ok=True)
    name = "soak" if a.tag == "default" else f"soak_{a.tag}"
    (a.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    keys = [k for k in result if k not in ("rows", "config")]
    table = "\n".join(f"| {k} | {result[k]} |" for k in keys)
    (a.out / f"{name}.md").write_text(f"# Soak ({a.tag})\n\nconfig: `{values}`\n\n| measure | value |\n|---|---|\n"
                                       f"{table}\n")
    print(json.dumps({k: result[k] for k in keys}, indent=1))
    (a.out / f"soak_{a.tag}.partial.json").unlink(missing_ok=True)
    fds = result["fds_after_warmup"] or [0, 0, 0]
    leak = fds[1] > fds[0] or result["children_at_end"] > 0
    return 1 if leak else 0


if __name__ == "__main__":
    sys.exit(main())
