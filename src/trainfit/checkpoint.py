"""Single-process checkpoints: atomic, checksummed, loaded with ``weights_only=True``.

Layout under ``RUN_DIR/checkpoints``::

    step-00000050.pt     torch.save of plain containers and tensors (no pickled code)
    step-00000050.json   {"sha256": ..., "bytes": ..., "step": 50, "format": ..., "config": {...}}

The ``.pt`` is written to a temporary file, fsynced and renamed; the ``.json`` sidecar is
written the same way *after* it, so a checkpoint without a matching sidecar is incomplete
and ignored. On load the checksum is verified; a bad file is refused and the previous one
is used. Only the newest ``keep`` checkpoints are kept. Sharded (multi-rank) checkpoints
use torch.distributed.checkpoint instead (see strategies).

Every checkpoint records its job (:func:`resume_record`: the config and its data's identity); the sidecar
holds a copy, so a resume is compared with it before the checkpoint (or the data) is read.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import warnings
from pathlib import Path

import torch

from trainfit.config import RunConfig
from trainfit.errors import CheckpointError
from trainfit.gate import RECORD, read_document
from trainfit.tasks.identity import FIELDS as DATA_FIELDS
from trainfit.tasks.identity import data_identity, describe, difference, same

FORMAT = "trainfit-checkpoint-v1"


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + rename).

    Raises:
        CheckpointError: the disk is full or not writable; ``path``'s previous content is intact.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        why = "the disk is full" if e.errno == errno.ENOSPC else e.strerror or str(e)
        raise CheckpointError(f"could not write checkpoint {path}: {why}; the previous checkpoint is intact") from None


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's torch RNG: the CPU generator and, on a CUDA device, that device's (dropout on a
    GPU draws from it). Plain tensors, so a checkpoint holding it loads with ``weights_only=True``."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    """Inverse of :func:`rng_state` (a CUDA state is applied only on a CUDA device)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


RESUME_KEYS = ("model", "model_config", "precision", "optimizer", "seed", "seq_len", "dataset_size",
               "lr", "schedule", "warmup_steps", "min_lr")
"""Config fields a checkpoint must share with the run that resumes it (one-file and sharded alike);
the global batch (micro_batch x accumulation x ranks) must match too, so the step stays the same.
The learning-rate schedule is part of the job: a resumed run follows the curve it started on, so a
changed lr, schedule, warm-up or min_lr is refused (a key an older checkpoint lacks is not compared).
The data is part of the job too: see :data:`DATA_IDENTITY`."""

DATA_IDENTITY = "data_identity"
"""The key of a recorded job that holds its data's identity (:mod:`trainfit.tasks.identity`: sources and their
fingerprint, tokenizer, packing, text field, seq_len, validation split); each field is compared on resume."""


def resume_record(cfg: RunConfig) -> dict:
    """What a checkpoint records of its job and a resume compares: the config's values and its data's identity.

    Raises:
        ConfigError: the data cannot be found or its tokenizer read (naming the field).
    """
    return {**cfg.to_dict(), DATA_IDENTITY: data_identity(cfg)}

DECAYING = ("linear", "cosine")
"""Schedules whose curve depends on ``steps``: resuming one with other ``steps`` would bend it mid-run."""


def check_resumable(saved: dict, saved_world: int, now: dict, world: int, path: Path) -> None:
    """Refuse a checkpoint written for another job: a different :data:`RESUME_KEYS` field, other data
    (:data:`DATA_IDENTITY`, when both ``saved`` and ``now`` hold it: see :func:`resume_record`) or global batch.

    Raises:
        CheckpointError: naming the field, both values and what to do.
    """
    for key in RESUME_KEYS:
        if key in saved and saved[key] != now[key]:
            raise CheckpointError(f"checkpoint {path} was written with {key}={saved[key]!r}, this run has "
                                  f"{key}={now[key]!r}; resume with the same {key} or use a new --run-dir")
    if now.get("schedule") in DECAYING and "steps" in saved and saved["steps"] != now["steps"]:
        raise CheckpointError(
            f"checkpoint {path} was written with steps={saved['steps']!r} and a {now['schedule']} schedule, which "
            f"decays to min_lr at its last step; this run has steps={now['steps']!r}: resume with "
            f"steps={saved['steps']!r}, or start a new --run-dir with --init-from {path.parent.parent} for more steps")
    _check_data(saved, now, path)
    if not {"micro_batch", "accumulation"} <= saved.keys():
        return  # written before the split was recorded: nothing to compare
    was = int(saved["micro_batch"]) * int(saved["accumulation"]) * saved_world
    have = int(now["micro_batch"]) * int(now["accumulation"]) * world
    if was != have:
        raise CheckpointError(
            f"checkpoint {path} was written with a global batch of {was} samples per step ({saved_world} "
            f"rank{'s' if saved_world > 1 else ''}), this run has {have}; set global_batch={was} so the step "
            "stays the same")


def _check_data(saved: dict, now: dict, path: Path) -> None:
    """Refuse other data: the first field of :data:`~trainfit.tasks.identity.FIELDS` that differs, both values."""
    old, new = saved.get(DATA_IDENTITY), now.get(DATA_IDENTITY)
    if not isinstance(old, dict) or not isinstance(new, dict):
        return  # written before the data's identity was recorded
    for key in DATA_FIELDS:
        if key in old and not same(key, old[key], new.get(key, "")):
            which = difference(key, old[key], new.get(key, ""))
            raise CheckpointError(f"checkpoint {path} was written with {key}={describe(key, old[key])}, this run has "
                                  f"{key}={describe(key, new.get(key, ''))}{f': {which}' if which else ''}; resume "
                                  f"with the same {key} or use a new --run-dir")


def first_cause(e: BaseException) -> str:
    """The first line of ``e`` that names something: torch's ``load_state_dict`` error opens with a header
    ("Error(s) in loading state_dict for GPT:") and names the tensor and both shapes on the next line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else type(e).__name__


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints (with sidecar), oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.glob("step-*.pt") if p.with_suffix(".json").is_file())


def save_checkpoint(run_dir: str | Path, step: int, payload: dict, *, keep: int = 3) -> Path:
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({"format": FORMAT, **payload}, buf)
    data = buf.getvalue()
    path = d / f"step-{step:08d}.pt"
    atomic_write_bytes(path, data)
    meta = {"format": FORMAT, "step": step, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "config": payload.get("config")}  # the job, readable without loading the checkpoint (resume checks it)
    atomic_write_bytes(path.with_suffix(".json"), json.dumps(meta).encode())
    for old in list_checkpoints(run_dir)[:-keep]:
        old.with_suffix(".json").unlink(missing_ok=True)
        old.unlink(missing_ok=True)
    for stale in d.glob(".step-*.tmp-*"):  # left by a process killed mid-write (each is a whole checkpoint)
        if not stale.name.endswith(f".tmp-{os.getpid()}"):
            stale.unlink(missing_ok=True)
    return path


def read_sidecar(path: Path) -> object:
    """The parsed ``.json`` sidecar of checkpoint ``path``, read through the gate's :data:`~trainfit.gate.RECORD`
    bounds: a corrupt one, or one nested thousands deep, is refused in one line naming the checkpoint.

    Raises:
        CheckpointError: the sidecar is unreadable, not JSON, or past the bounds.
    """
    return read_document(path.with_suffix(".json"), field=f"checkpoint {path}: its checksum file", fmt="json",
                         limits=RECORD, error=CheckpointError)


def read_checkpoint(path: str | Path) -> dict:
    """Verify and load one checkpoint file (``weights_only=True``: no code is unpickled).

    Raises:
        CheckpointError: missing, truncated, tampered with, or not a trainfit checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    data = path.read_bytes()
    sidecar = path.with_suffix(".json")
    if sidecar.is_file():
        meta = read_sidecar(path)
        if not isinstance(meta, dict):  # valid JSON but not our object (e.g. "[]", "null")
            raise CheckpointError(f"checkpoint {path}: its checksum file {sidecar.name} is corrupt")
        if meta.get("bytes") != len(data):
            raise CheckpointError(f"checkpoint {path} is truncated ({len(data)} of {meta.get('bytes')} bytes)")
        if meta.get("sha256") != hashlib.sha256(data).hexdigest():
            raise CheckpointError(f"checkpoint {path} fails its sha256 checksum (corrupt or tampered with)")
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path} was refused by the safe loader (weights_only=True): {first}") from None
    except Exception as e:  # zip/format errors from torch.load on a foreign or corrupt file
        raise CheckpointError(f"checkpoint {path} is not a readable torch checkpoint ({type(e).__name__})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a trainfit checkpoint (expected format {FORMAT!r})")
    return obj


def load_latest(run_dir: str | Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies; bad ones are skipped with a warning.

    Raises:
        CheckpointError: checkpoints exist but none verifies.
    """
    candidates = list_checkpoints(run_dir)
    errors = []
    for path in reversed(candidates):
        try:
            found = path, read_checkpoint(path)
        except CheckpointError as e:
            errors.append(str(e))
            continue
        for err in errors:  # said only when an older checkpoint is used instead (else the error says it all)
            warnings.warn(f"{err}; falling back to the previous checkpoint ({path.name})", stacklevel=2)
        return found
    if errors:
        raise CheckpointError("no usable checkpoint: " + "; ".join(errors))
    return None
