"""How long ``trainfit plan`` takes for models of every kind, cold (empty basis cache) and cached.

    python benchmarks/plan_speed.py [--cases gpt2,mistral-7b,t5-base,vit-base,llama-70b,llama-70b-fast]

Each case is planned for 8 and for 1,024 H100s, each time as a whole command (``trainfit plan ... --json`` in a
fresh process, so imports count), first with an empty ``TRAINFIT_CACHE_DIR`` (cold), then again with the cache the
first run wrote (cached). The machine's load average is recorded beside the times: on a shared 2-core machine
other processes slow the cold runs, which trace on every core.
"""

from __future__ import annotations

import argparse
import json
import os
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


def plan(model: str, config: str, seq: int, extra: list[str], devices: int, batch: int, cache: str) -> dict:
    cmd = [sys.executable, "-m", "trainfit", "plan", "--model", model, "--seq", str(seq), "--global-batch", str(batch),
           "--device-memory", "80GiB", "--devices", str(devices), "--nodes", str(max(1, devices // 8)),
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
    args = ap.parse_args()
    rows = [json.loads(x) for x in Path(args.rows_from).read_text().splitlines()
            if x.startswith("{")] if args.rows_from else []
    for name in args.cases.split(","):
        model, config, seq, extra = CASES[name]
        for devices, batch in DEVICES:
            with tempfile.TemporaryDirectory(prefix="trainfit-cache-") as cache:
                cold = plan(model, config, seq, extra, devices, batch, cache)
                cached = plan(model, config, seq, extra, devices, batch, cache)
            rows.append({"case": name, "devices": devices, "global_batch": batch, "seq": seq, "cold": cold,
                         "cached": cached})
            print(json.dumps(rows[-1]), flush=True)
    lines = ["| case | devices | seq | basis | cold s | cached s | load avg (cold) | best plan |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["cold"]["best"]
        best = "nothing fits" if b is None or not b["fits"] else (
            f"{b['precision']} mb {b['micro_batch']} x acc {b['accumulation']}, {b['checkpointing']}, {b['strategy']}")
        lines.append(f"| {r['case']} | {r['devices']} | {r['seq']} | {r['cold']['basis']} | {r['cold']['wall_s']} | "
                     f"{r['cached']['wall_s']} | {r['cold']['load_avg']:.1f} | {best} |")
    write_results("plan_speed", {"rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
