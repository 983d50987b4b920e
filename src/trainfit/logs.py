"""Where the per-step metrics go besides ``metrics.jsonl`` (TensorBoard event files, ``--log tensorboard``), and
where stderr goes before a job is accepted.

Pure core: :func:`scalars` maps one metrics.jsonl record to TensorBoard tags (the same numbers, no
rounding). Shell: :func:`open_log` returns a sink with ``write(step, record)`` / ``close()`` -- a
:class:`TensorBoardLog` on rank 0 when asked for, otherwise :data:`NULL_LOG`, whose methods do nothing
(the loop has no branches).

Before a job is accepted, stderr itself is held (:func:`held_until_accepted`, :func:`accept`): a refused
command prints its one error line alone, not the info lines and bars that came before it.

TensorBoard needs the ``tensorboard`` package (``pip install 'trainfit[tensorboard]'``); it is imported
only when asked for, and its absence is one line naming the extra, before any work.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
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


# -- stderr until the job is accepted ----------------------------------------------------------------------------
class _HeldStderr:
    """``sys.stderr`` while a command is not yet accepted: what is written is held (info lines such as
    ``data: ...``, warnings, a ``tokenizing`` bar), printed when the job is accepted and dropped when it is
    refused -- so a refusal is one line. Once released it writes through (a logger or bar that kept it still
    prints)."""

    def __init__(self, real) -> None:
        self.real, self.parts, self.holding = real, [], True

    def write(self, text: str) -> int:
        if self.holding:
            self.parts.append(text)
        else:
            self.real.write(text)
        return len(text)

    def release(self, *, show: bool) -> None:
        if self.holding and show:
            self.real.write("".join(self.parts))
            self.real.flush()
        self.parts, self.holding = [], False

    def flush(self) -> None:
        if not self.holding:
            self.real.flush()

    def isatty(self) -> bool:  # a held bar must not redraw in place: it is printed later, or never
        return False if self.holding else self.real.isatty()

    def __getattr__(self, name: str):  # encoding, errors, ... of the stream it stands for
        return getattr(self.real, name)


_HELD: list[_HeldStderr] = []


@contextlib.contextmanager
def held_until_accepted(*, dropped_on: tuple[type[BaseException], ...]) -> Iterator[None]:
    """Hold stderr until :func:`accept` (or the end of the block); an exception of ``dropped_on`` (a refusal)
    drops what was held, any other prints it (it helps read a traceback)."""
    gate = _HeldStderr(sys.stderr)
    sys.stderr = gate
    _HELD.append(gate)
    try:
        yield
    except BaseException as e:
        gate.release(show=not isinstance(e, dropped_on))
        raise
    finally:
        gate.release(show=True)  # a no-op when already released
        _HELD.remove(gate)
        if sys.stderr is gate:
            sys.stderr = gate.real


def holding() -> bool:
    """Whether stderr is held: the command has not accepted its job yet (an error now is a refusal)."""
    return any(gate.holding for gate in _HELD)


def accept(*, show: bool = True) -> None:
    """The job is accepted (its input checked, its work starting): print what was held (``show=False``: drop
    it, e.g. the launcher's, whose workers say it again), write through from now."""
    for gate in _HELD:
        gate.release(show=show)
        if sys.stderr is gate:
            sys.stderr = gate.real
