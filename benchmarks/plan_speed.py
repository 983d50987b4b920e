"""How long ``trainfit plan`` takes for models of every kind, cold (empty basis cache) and cached.

    python benchmarks/plan_speed.py [--cases gpt2,mistral-7b,t5-base,vit-base,llama-70b,llama-70b-fast]
    python benchmarks/plan_speed.py --cases gpt-small-calibrated --keep [--old DIR] [--old-timeout-s 600]

``gpt-small-calibrated`` (issue 30): ``plan --model gpt-small --seq 128 --global-batch 32 --device-memory 1GiB
--device cpu --calibrate``, which steps the model on this CPU; timed once (wall and the process's CPU time, user +
system of the child: the machine is shared, and its load changes the wall time), after (this checkout) and, with
``--old DIR``, before (that tree's ``src`` on ``PYTHONPATH``, stopped at ``--old-timeout-s``). ``--keep`` keeps the
rows of ``results/plan_speed.json`` that are not rerun.

Each case is planned for 8 and for 1,024 H100s, each time as a whole command (``trainfit plan ... --json`` in a
fresh process, so imports count), first with an empty ``TRAINFIT_CACHE_DIR`` (cold), then again with the cache the
first run wrote (cached). The machine's load average is recorded beside the times: on a shared 2-core machine
other processes slow the cold runs, which trace on every core.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

CASES = {
    "gpt2": ("hf:GPT2LMHeadModel", "n_layer=12,n_embd=768,n_head=12,vocab_size=50257,n_positions=1024", 1024, []),
    "mistral-7b": ("hf:MistralForCausalLM", "hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,"
                   "num_attention_heads=32,num_key_value_heads=8,vocab_size=32000,max_position_embeddings=4096",
                   4096, []),
    "t5-base": ("hf:T5ForConditionalGeneration", "d_model=768,d_ff=3072,num_layers=12,num_heads=12,d_kv=64,"
                "vocab_size=32128", 512, []),
    "vit-base": ("hf:ViTForImageClassification", "hidden_size=768,intermediate_size=3072,num_hidden_layers=12,"
                 "num_attention_heads=12,image_size=224,patch_size=16", 197, []),
    "llama-70b": ("llama-70b", "", 4096, []),
    "llama-70b-fast": ("llama-70b", "", 4096, ["--basis", "fast"]),
}
DEVICES = ((8, 512), (1024, 4096))  # (devices, global batch)
CPU_CASES = {
    "gpt-small-calibrated": ["--model", "gpt-small", "--seq", "128", "--global-batch", "32", "--device-memory", "1GiB",
                             "--device", "cpu", "--calibrate"],
}
"""Plans that measure on this CPU (``--calibrate``): timed once each, wall and CPU."""


def plan_cpu(flags: list[str], *, old: str | None = None, timeout_s: float | None = None) -> dict:
    """One ``trainfit plan FLAGS --json`` in a fresh process: wall seconds, the child's CPU seconds, the best plan;
    ``old``: a tree whose ``src`` goes first on ``PYTHONPATH``; stopped (and said) after ``timeout_s``."""
    cmd = [sys.executable, "-m", "trainfit", "plan", *flags, "--json"]
    env = {**os.environ, **({"PYTHONPATH": str(Path(old) / "src")} if old else {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {"wall_s": round(time.perf_counter() - t0, 1), "timed_out": True, "rc": None, "best": None,
                "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
                "load_avg": os.getloadavg()[0], "tree": old or "this checkout"}
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    best = next(iter(json.loads(done.stdout).get("plans", [])), None)
    return {"wall_s": round(wall, 1), "timed_out": False, "rc": done.returncode,
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "best": None if best is None else {k: best[k] for k in ("precision", "micro_batch", "accumulation",
                                                                    "checkpointing", "strategy", "fits", "step_s")},
            "stderr_lines": len(done.stderr.splitlines()), "load_avg": os.getloadavg()[0],
            "tree": old or "this checkout"}


def plan(model: str, config: str, seq: int, extra: list[str], devices: int, batch: int, cache: str) -> dict:
    cmd = [sys.executable, "-m", "trainfit", "plan", "--model", model, "--seq", str(seq), "--global-batch", str(batch),
           "--device-memory", "80GiB", "--devices", str(min(devices, 8)), "--nodes", str(max(1, devices // 8)),
           "--device", "h100", "--json", *extra]
    if config:
        cmd[6:6] = ["--model-config", config]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TRAINFIT_CACHE_DIR": cache})
    wall = time.perf_counter() - t0
    if done.returncode != 0 and "nothing fits" not in done.stderr:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout) if done.stdout.strip() else {}
    best = next(iter(out.get("plans", [])), None)
    return {"wall_s": round(wall, 2), "rc": done.returncode, "basis": out.get("basis"),
            "best": None if best is None else {k: best[k] for k in ("precision", "micro_batch", "accumulation",
                                                                    "checkpointing", "strategy", "fits")},
            "load_avg": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rows-from", help="JSON lines of rows this script printed in an earlier run, kept first")
    ap.add_argument("--keep", action="store_true", help="keep the rows of results/plan_speed.json not rerun")
    ap.add_argument("--old", help="a checkout whose src is timed as 'before' for the --calibrate cases")
    ap.add_argument("--old-timeout-s", type=float, default=600.0, help="stop the 'before' run after this long")
    args = ap.parse_args()
    names = args.cases.split(",")
    rows = [json.loads(x) for x in Path(args.rows_from).read_text().splitlines()
            if x.startswith("{")] if args.rows_from else []
    earlier: dict = {}
    if args.keep:
        from _common import RESULTS

        kept = json.loads((RESULTS / "plan_speed.json").read_text())["rows"]
        rows += [r for r in kept if r["case"] not in names]
        earlier = {r["case"]: r for r in kept if "before" in r}
    for name in names:
        if name in CPU_CASES:
            after = plan_cpu(CPU_CASES[name])
            # without --old, --keep keeps the 'before' an earlier run measured
            before = (plan_cpu(CPU_CASES[name], old=args.old, timeout_s=args.old_timeout_s) if args.old
                      else earlier.get(name, {}).get("before"))
            rows.append({"case": name, "devices": 1, "flags": CPU_CASES[name], "after": after, "before": before})
            print(json.dumps(rows[-1]), flush=True)
            continue
        model, config, seq, extra = CASES[name]
        for devices, batch in DEVICES:
            with tempfile.TemporaryDirectory(prefix="trainfit-cache-") as cache:
                cold = plan(model, config, seq, extra, devices, batch, cache)
                cached = plan(model, config, seq, extra, devices, batch, cache)
            rows.append({"case": name, "devices": devices, "global_batch": batch, "seq": seq, "cold": cold,
                         "cached": cached})
            print(json.dumps(rows[-1]), flush=True)
    lines = ["| case | devices | seq | basis | cold s | cached s | load avg (cold) | best plan |", "|---|---|---|---|---|---|---|---|"]
    cpu = [r for r in rows if "after" in r]
    for r in rows:
        if "after" in r:
            continue
        b = r["cold"]["best"]
        best = "nothing fits" if b is None or not b["fits"] else (
            f"{b['precision']} mb {b['micro_batch']} x acc {b['accumulation']}, {b['checkpointing']}, {b['strategy']}")
        lines.append(f"| {r['case']} | {r['devices']} | {r['seq']} | {r['cold']['basis']} | {r['cold']['wall_s']} | "
                     f"{r['cached']['wall_s']} | {r['cold']['load_avg']:.1f} | {best} |")
    if cpu:
        lines += ["", "Plans that measure on this CPU (one run each; wall and the process's CPU seconds, user + "
                  "system):", "", "| case | command | before: wall s / CPU s | after: wall s / CPU s | load avg "
                  "(after) | best plan |", "|---|---|---|---|---|---|"]
        for r in cpu:
            def cell(x):
                if x is None:
                    return "-"
                return f"{'> ' if x['timed_out'] else ''}{x['wall_s']} / {x['cpu_s']}" + (
                    " (stopped)" if x["timed_out"] else "")
            b = r["after"]["best"]
            best = "nothing fits" if b is None or not b["fits"] else (
                f"{b['precision']} mb {b['micro_batch']} x acc {b['accumulation']}, {b['checkpointing']}, "
                f"{b['strategy']}: {b['step_s']:.3g} s/step")
            lines.append(f"| {r['case']} | `trainfit plan {' '.join(r['flags'])}` | {cell(r['before'])} | "
                         f"{cell(r['after'])} | {r['after']['load_avg']:.1f} | {best} |")
    write_results("plan_speed", {"rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
