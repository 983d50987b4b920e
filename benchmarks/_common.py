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
