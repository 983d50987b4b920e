"""Shared helpers for benchmarks: machine/version header and result writing."""

from __future__ import annotations

import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }


def write_results(name: str, data: dict, table_md: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = machine()
    (RESULTS / f"{name}.json").write_text(json.dumps({"machine": meta, **data}, indent=2) + "\n")
    header = (f"# {name}\n\nCommand: `{meta['command']}`  \nMachine: {meta['cpu_count']} CPUs, {meta['platform']}, "
              f"Python {meta['python']}, torch {meta['torch']}, {meta['date']}\n\n")
    (RESULTS / f"{name}.md").write_text(header + table_md + "\n")


def spawn_ranks(target, *args, world: int = 2, timeout_s: float = 1800) -> Path:
    """Run ``target(rank, root, *args)`` in ``world`` gloo processes (``trainfit.strategies.launch.spawn_local``:
    file rendezvous, loopback, one torch thread each); return ``root``, a fresh temp folder the ranks
    write ``rank{r}.json`` into. A failed rank stops the benchmark with its traceback."""
    import tempfile

    from trainfit.strategies.launch import spawn_errors, spawn_local

    root = Path(tempfile.mkdtemp())
    codes = spawn_local(target, root, *args, world_size=world, timeout_s=timeout_s, collective_timeout_s=300)
    missing = [r for r in range(world) if not (root / f"rank{r}.json").exists()]
    if codes != [0] * world or missing:
        raise SystemExit(f"ranks exited {codes}, no results from ranks {missing}\n{spawn_errors(root)}".rstrip())
    return root
