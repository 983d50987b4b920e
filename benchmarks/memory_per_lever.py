"""What each lever does to memory: measured parts per configuration, beside the ZeRO paper's model.

Runs ``trainfit memory --json`` (the measured tracker, one real optimizer step) on the built-in GPT
(gpt-tiny, 3.3M params, seq 64, micro-batch 8, AdamW) for fp32 -> bf16-mixed -> bf16-true ->
+ full activation checkpointing, and ``torchrun --nproc_per_node=2 -m trainfit memory`` for ddp,
zero1, zero2, zero3 on 2 gloo ranks (bf16-mixed, which every strategy runs; plus zero1 with bf16-true,
the paper's own setting). Model states (params + grads + optimizer) per parameter are set beside
Rajbhandari et al. 2020 (ZeRO), Sec. 3.1/5: mixed-precision Adam keeps 2 (fp16 weights) + 2 (fp16
grads) + K=12 (fp32 master, momentum, variance) bytes per parameter; per device with N ranks:
baseline 2+2+K, P_os 2+2+K/N, P_os+g 2+(2+K)/N, P_os+g+p (2+2+K)/N.

    .venv/bin/python benchmarks/memory_per_lever.py      # ~6 min on a loaded 2-core CPU

Writes benchmarks/results/memory_per_lever.{json,md}.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
BASE = ["--model", "gpt-tiny", "--seq", "64", "--micro-batch", "8", "--accumulation", "1", "--optimizer", "adamw"]
N = 2

# (label, strategy, precision, checkpointing, ZeRO stage for the paper's formula)
CONFIGS = [
    ("fp32", "single", "fp32", "none", 0),
    ("bf16-mixed", "single", "bf16-mixed", "none", 0),
    ("bf16-true", "single", "bf16-true", "none", 0),
    ("bf16-true + checkpointing", "single", "bf16-true", "full", 0),
    ("ddp, 2 ranks, bf16-mixed", "ddp", "bf16-mixed", "none", 0),
    ("zero1, 2 ranks, bf16-mixed", "zero1", "bf16-mixed", "none", 1),
    ("zero1, 2 ranks, bf16-true", "zero1", "bf16-true", "none", 1),
    ("zero2, 2 ranks, bf16-mixed", "zero2", "bf16-mixed", "none", 2),
    ("zero3, 2 ranks, bf16-mixed", "zero3", "bf16-mixed", "none", 3),
]
DTYPE_BYTES = {"fp32": (4, 4, 8), "bf16-mixed": (4, 4, 8), "bf16-true": (2, 2, 12)}
"""(weights, grads, optimizer incl. master) bytes per parameter as each precision stores them."""


def zero_model(p: float, g: float, k: float, stage: int, n: int) -> float:
    """Model-state bytes per parameter per device (ZeRO paper, Sec. 5, with the stated P, G, K)."""
    if stage == 0:
        return p + g + k
    if stage == 1:
        return p + g + k / n
    if stage == 2:
        return p + (g + k) / n
    return (p + g + k) / n


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(strategy: str, precision: str, checkpointing: str) -> dict:
    flags = [*BASE, "--strategy", strategy, "--precision", precision, "--checkpointing", checkpointing,
             "--run-dir", "/tmp/trainfit-memory-bench", "--json"]
    if strategy == "single":
        cmd = [str(VENV_BIN / "trainfit"), "memory", *flags]
    else:
        cmd = [str(VENV_BIN / "torchrun"), f"--nproc_per_node={N}", f"--master_port={free_port()}", "-m", "trainfit",
               "memory", *flags]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["command"] = " ".join(Path(cmd[0]).name if i == 0 else c for i, c in enumerate(cmd))
    return out


def main() -> None:
    rows = []
    for label, strategy, precision, ckpt, stage in CONFIGS:
        r = measure(strategy, precision, ckpt)
        n_params = r["n_params"]
        ranks = r.get("per_rank") or [{p: r[f"{p}_bytes"] for p in ("params", "grads", "optimizer")}]
        states = max(sum(pr.values()) for pr in ranks)  # the fuller rank (zero1 partitions are uneven)
        p, g, k = DTYPE_BYTES[precision]
        row = {"label": label, "strategy": strategy, "precision": precision, "checkpointing": ckpt, "stage": stage,
               "n_params": n_params, "parts": {x: r[f"{x}_bytes"] for x in
                                                ("params", "grads", "optimizer", "activations", "temporaries")},
               "peak_bytes": r["peak_bytes"], "master_weights_bytes": r["master_weights_bytes"],
               "per_rank_model_states": ranks, "model_states_per_param": states / n_params,
               "zero_paper_per_param": zero_model(2, 2, 12, stage, N if strategy != "single" else 1),
               "zero_formula_this_dtype_per_param": zero_model(p, g, k, stage, N if strategy != "single" else 1),
               "command": r["command"]}
        print(f"{label:<30} states {row['model_states_per_param']:.2f} B/param (paper "
              f"{row['zero_paper_per_param']:.1f}, same formula with this dtype "
              f"{row['zero_formula_this_dtype_per_param']:.1f}); peak {r['peak_bytes'] / 2**20:.1f} MiB",
              file=sys.stderr)
        rows.append(row)
    write_results("memory_per_lever", {"model": "gpt-tiny", "args": BASE, "world_size": N, "rows": rows},
                  markdown(rows))


def markdown(rows: list[dict]) -> str:
    mib = 2.0**20
    out = ["Built-in GPT (gpt-tiny, "
           f"{rows[0]['n_params']:,} parameters), seq 64, micro-batch 8, AdamW; measured by `trainfit memory` "
           "(one real optimizer step, every live tensor attributed to a part). Distributed rows: rank 0's parts; "
           "model states per parameter take the fuller rank.", "",
           "| configuration | params MiB | grads MiB | optimizer MiB | activations MiB | temporaries MiB | peak MiB | "
           "model states B/param (measured) | ZeRO paper 2+2+12 | ZeRO formula, this run's dtypes |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pt = r["parts"]
        out.append(f"| {r['label']} | {pt['params'] / mib:.2f} | {pt['grads'] / mib:.2f} | {pt['optimizer'] / mib:.2f} | "
                   f"{pt['activations'] / mib:.2f} | {pt['temporaries'] / mib:.2f} | {r['peak_bytes'] / mib:.2f} | "
                   f"{r['model_states_per_param']:.2f} | {r['zero_paper_per_param']:.1f} | "
                   f"{r['zero_formula_this_dtype_per_param']:.1f} |")
    out += ["", "Commands:", ""] + [f"- {r['label']}: `{r['command']}`" for r in rows]
    return "\n".join(out)


if __name__ == "__main__":
    main()
