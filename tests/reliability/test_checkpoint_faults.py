"""Checkpoint files under damage: truncation, tampering, code smuggling, full disks, keep-last-K.

The reference for "the previous checkpoint is intact" is an independent, uninterrupted
run of the same number of steps (bitwise equal model and optimizer state).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from trainfit.outputs import MARKER
import torch

from trainfit import checkpoint as ck
from trainfit.cli import main as cli_main
from trainfit.errors import CheckpointError
from trainfit.train import train

from .conftest import TINY_FLAGS, error_lines, latest, tensors_equal, tiny_config, training_state


def _payload(i: int) -> dict:
    return {"step": i, "model": {"w": torch.full((4,), float(i))}}


def _write_sidecar(pt, data: bytes) -> None:
    """What someone with write access (or a bug) could do: a sidecar that matches the bytes."""
    meta = {"format": ck.FORMAT, "step": 1, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    pt.with_suffix(".json").write_text(json.dumps(meta))


def test_keeps_the_last_k_and_no_temporary_files(tmp_path):
    for i in range(1, 8):
        ck.save_checkpoint(tmp_path, i, _payload(i), keep=3)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f"step-{i:08d}.{ext}" for i in (5, 6, 7) for ext in ("json", "pt")]
    path, state = ck.load_latest(tmp_path)
    assert path.name == "step-00000007.pt" and torch.equal(state["model"]["w"], torch.full((4,), 7.0))


@pytest.mark.parametrize("damage", ["truncate", "flip-byte", "empty", "sidecar-garbage", "sidecar-list",
                                    "sidecar-null"])
def test_damaged_newest_is_refused_and_previous_used(tmp_path, damage):
    for i in (1, 2):
        ck.save_checkpoint(tmp_path, i, _payload(i), keep=3)
    newest = tmp_path / "checkpoints" / "step-00000002.pt"
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "flip-byte":
        newest.write_bytes(data[:100] + bytes([data[100] ^ 0x01]) + data[101:])
    elif damage == "empty":
        newest.write_bytes(b"")
    elif damage == "sidecar-garbage":
        newest.with_suffix(".json").write_bytes(b"\x00{not json")
    elif damage == "sidecar-list":
        newest.with_suffix(".json").write_text("[1, 2]")
    else:
        newest.with_suffix(".json").write_text("null")
    with pytest.raises(CheckpointError) as e:
        ck.read_checkpoint(newest)
    assert str(newest) in str(e.value) and "\n" not in str(e.value)
    with pytest.warns(UserWarning, match="falling back to the previous checkpoint"):
        path, state = ck.load_latest(tmp_path)
    assert path.name == "step-00000001.pt" and torch.equal(state["model"]["w"], torch.full((4,), 1.0))


class _Payload:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("container", ["torch-zip", "raw-pickle"])
def test_checkpoint_smuggling_code_is_refused(tmp_path, container):
    marker = tmp_path / "pwned"
    ck.save_checkpoint(tmp_path, 1, _payload(1), keep=3)
    evil = tmp_path / "checkpoints" / "step-00000002.pt"
    obj = {"format": ck.FORMAT, "step": 2, "model": _Payload(marker)}
    if container == "torch-zip":
        buf = io.BytesIO()
        torch.save(obj, buf)
        data = buf.getvalue()
    else:
        data = pickle.dumps(obj, protocol=2)
    evil.write_bytes(data)
    _write_sidecar(evil, data)  # the checksum matches: only weights_only stands in the way

    # Sanity check of the test itself: an unrestricted unpickler would run the payload.
    assert b"system" in data
    with pytest.raises(CheckpointError, match="refused by the safe loader|not a readable"):
        ck.read_checkpoint(evil)
    with pytest.warns(UserWarning):
        path, _ = ck.load_latest(tmp_path)
    assert path.name == "step-00000001.pt"
    assert not marker.exists()


def test_cli_resume_refuses_smuggled_code_with_one_line(tmp_path, trainfit_cli):
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    evil = ck.checkpoint_dir(run_dir) / "step-00000001.pt"
    evil.parent.mkdir(parents=True)
    buf = io.BytesIO()
    torch.save({"format": ck.FORMAT, "step": 1, "model": _Payload(marker)}, buf)
    evil.write_bytes(buf.getvalue())
    _write_sidecar(evil, buf.getvalue())
    r = trainfit_cli("train", *TINY_FLAGS, "--steps", "2", "--run-dir", run_dir, "--resume")
    assert r.returncode == 2, r.stderr
    errs = [ln for ln in error_lines(r.stderr) if ln.startswith("trainfit: error:")]
    assert len(errs) == 1 and "weights_only" in errs[0] and "Traceback" not in r.stderr
    assert not marker.exists()


class _FullDisk:
    """``open`` for the checkpoint module backed by a disk with ``free`` bytes left.

    Writes go through until the budget is spent, then the write that does not fit stores
    what fits and raises ENOSPC -- like a real full disk mid-file.
    """

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, path, mode="r", *a, **kw):
        f = open(path, mode, *a, **kw)
        if "w" not in mode:
            return f
        disk, real_write = self, f.write

        def write(data):
            n = min(len(data), disk.free)
            real_write(data[:n])
            disk.free -= n
            if n < len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return n

        f.write = write
        return f


def test_full_disk_while_writing_keeps_previous_and_stops_with_exit_2(tmp_path, monkeypatch, capsys):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    train(tiny_config(steps=2, run_dir=str(ref_dir)), progress=False)
    _, ref = latest(ref_dir)
    size = (ck.checkpoint_dir(ref_dir) / "step-00000002.pt").stat().st_size
    sidecar = (ck.checkpoint_dir(ref_dir) / "step-00000002.json").stat().st_size
    # Room for two checkpoints and their sidecars, and half of the third.
    monkeypatch.setattr(ck, "open", _FullDisk(2 * (size + sidecar) + size // 2), raising=False)
    rc = cli_main(["train", *TINY_FLAGS, "--steps", "6", "--checkpoint-every", "1", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in error_lines(err) if ln.startswith("trainfit: error:")]
    assert len(lines) == 1 and "disk is full" in lines[0] and "previous checkpoint is intact" in lines[0], err
    assert "Traceback" not in err
    monkeypatch.undo()
    left = sorted(p.name for p in ck.checkpoint_dir(run_dir).iterdir())
    assert left == ["step-00000001.json", "step-00000001.pt", "step-00000002.json", "step-00000002.pt"]
    path, state = latest(run_dir)
    assert path.name == "step-00000002.pt"
    assert tensors_equal(training_state(state), training_state(ref)) == []


def _unshare_tmpfs_ok() -> bool:
    if not shutil.which("unshare") or sys.platform != "linux":
        return False
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                        "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _unshare_tmpfs_ok(), reason="needs user namespaces to mount a small tmpfs")
@pytest.mark.parametrize("free_kib", [0, 200, 1100])
def test_real_full_disk_tmpfs_cli_exits_2_and_keeps_checkpoints(tmp_path, free_kib):
    """A real 2 MiB tmpfs (ENOSPC from the kernel), pre-filled so the disk fills at
    different points: the config file, the first checkpoint, a later checkpoint."""
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    cmd = " ".join(f"'{a}'" for a in [sys.executable, "-m", "trainfit", "train", *TINY_FLAGS, "--steps", "8",
                                       "--checkpoint-every", "1", "--run-dir", str(mnt / "run")])
    script = (f"mount -t tmpfs -o size=2m tmpfs {mnt} && "
              f"dd if=/dev/zero of={mnt}/filler bs=1k count={2048 - free_kib} status=none 2>/dev/null; "
              f"{cmd} 2>{tmp_path}/stderr; echo $? > {tmp_path}/rc; "
              f"mkdir -p {out} && cp -r {mnt}/run {out}/ 2>/dev/null; true")
    subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], check=True, timeout=120)
    rc = int((tmp_path / "rc").read_text())
    err = (tmp_path / "stderr").read_text()
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in error_lines(err) if ln.startswith("trainfit: error:")]
    assert len(lines) == 1 and ("No space left" in lines[0] or "disk is full" in lines[0]), err
    found = ck.load_latest(out / "run") if (out / "run").exists() else None
    if free_kib >= 1100:
        assert found is not None and found[1]["step"] >= 1  # at least one checkpoint fit, and it verifies


def test_leftovers_of_a_killed_writer_do_not_block_or_leak(tmp_path):
    """A crash after the .pt rename but before its sidecar, and a temporary file of a dead
    process: a fresh run starts (the lone .pt is not a checkpoint) and cleans both up."""
    d = ck.checkpoint_dir(tmp_path)
    d.mkdir(parents=True)
    (tmp_path / MARKER).write_text("")  # the killed run had claimed the directory
    (d / "step-00000001.pt").write_bytes(b"cut short")
    (d / ".step-00000002.pt.tmp-999999").write_bytes(b"x" * 1000)
    train(tiny_config(steps=2, checkpoint_every=1, run_dir=str(tmp_path)), progress=False)
    assert sorted(p.name for p in d.iterdir()) == [f"step-0000000{i}.{e}" for i in (1, 2) for e in ("json", "pt")]
    assert latest(tmp_path)[1]["step"] == 2
