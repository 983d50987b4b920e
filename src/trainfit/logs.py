"""Where the per-step metrics go besides ``metrics.jsonl``: TensorBoard event files (``--log tensorboard``).

Pure core: :func:`scalars` maps one metrics.jsonl record to TensorBoard tags (the same numbers, no
rounding). Shell: :func:`open_log` returns a sink with ``write(step, record)`` / ``close()`` -- a
:class:`TensorBoardLog` on rank 0 when asked for, otherwise :data:`NULL_LOG`, whose methods do nothing
(the loop has no branches).

TensorBoard needs the ``tensorboard`` package (``pip install 'trainfit[tensorboard]'``); it is imported
only when asked for, and its absence is one line naming the extra, before any work.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainfit.errors import ConfigError
from trainfit.vocabulary import LogSink

TAGS = {
    "loss": "train/loss",
    "val_loss": "val/loss",
    "val_perplexity": "val/perplexity",
    "lr": "lr",
    "loss_scale": "loss_scale",
    "skipped_steps": "skipped_steps",
    "tokens_per_s": "tokens_per_s",
    "samples_per_s": "samples_per_s",
    "grad_norm": "grad_norm",
    "data_wait_frac": "data_wait_frac",
    "peak_allocated_bytes": "memory/peak_allocated_bytes",
}
"""metrics.jsonl key -> TensorBoard tag. A key absent from a record (no evaluation at that step, no
clipping, no CUDA memory reading) writes nothing for that step."""

TENSORBOARD_DIR = "tensorboard"
"""Under the run directory, beside metrics.jsonl."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one metrics.jsonl record (pure): finite numbers only, under their tags."""
    out = {}
    for key, tag in TAGS.items():
        v = record.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[tag] = float(v)
    return out


class _NullLog:
    """The sink when TensorBoard is off (or on ranks other than 0): does nothing."""

    def write(self, step: int, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


NULL_LOG = _NullLog()


class TensorBoardLog:
    """``RUN_DIR/tensorboard`` event files through ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        run_dir: the run directory.
        start: the step the run starts after (a resume); events of later steps left by the interrupted
            run are purged, so each step appears once.
    """

    def __init__(self, run_dir: Path, *, start: int) -> None:
        writer_class = summary_writer()
        kw = {"purge_step": start + 1} if start else {}
        self._writer = writer_class(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), **kw)

    def write(self, step: int, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._writer.close()  # flushes the event file


def summary_writer():
    """torch's SummaryWriter class; ConfigError naming the extra when the ``tensorboard`` package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # lazy: needs the optional tensorboard package
    except ImportError as e:
        raise ConfigError("log", "tensorboard", "the tensorboard package installed",
                          f"pip install 'trainfit[tensorboard]' ({e})") from None
    return SummaryWriter


def check_available(sink: LogSink) -> None:
    """Refuse ``--log tensorboard`` before any work when the package is missing."""
    if sink == LogSink.TENSORBOARD:
        summary_writer()


def open_log(sink: LogSink, run_dir: Path, *, start: int, rank: int):
    """The sink for this rank: TensorBoard on rank 0 when ``sink`` asks for it, else :data:`NULL_LOG`."""
    if sink == LogSink.TENSORBOARD and rank == 0:
        return TensorBoardLog(run_dir, start=start)
    return NULL_LOG
