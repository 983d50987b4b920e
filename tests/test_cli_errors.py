"""Bad input: one clear line naming field/file and what is allowed, exit 2, nothing overwritten."""

import hashlib

import pytest
import torch

BASE = ["train", "--steps", "1", "--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16"]


@pytest.fixture
def _run(trainfit_cli):
    """``trainfit train`` in this process (tests/conftest.py): the same stdout, stderr and exit status."""
    return lambda args, tmp_path: trainfit_cli(*_base(args), "--run-dir", tmp_path / "run", *args)


def _base(args) -> list[str]:
    """BASE without the flags ``args`` gives itself: each flag once (a repeated one is refused, issue 35 row 12)."""
    out, i = [BASE[0]], 1
    while i < len(BASE):
        if BASE[i] not in args:
            out += BASE[i:i + 2]
        i += 2
    return out


@pytest.mark.parametrize("args, needle", [
    (["--precision", "fp8"], "precision='fp8' is not valid; allowed: one of: fp32, bf16-mixed"),
    (["--accumulation", "0"], "accumulation=0 is not valid; allowed: an integer >= 1"),
    (["--micro-batch", "0"], "micro_batch=0 is not valid; allowed: an integer >= 1"),
    (["--micro-batch", "x"], "micro_batch='x' is not valid; allowed: an integer"),
    (["--checkpointing", "sometimes"], "checkpointing='sometimes' is not valid"),
    (["--model", "resnet9000"], "model='resnet9000' is not valid; allowed: one of: gpt-tiny"),
    # was an AssertionError traceback from the generated-data task (exit 1)
    (["--model-config", "vocab_size=8"], "model_config.vocab_size=8 is not valid; allowed: an integer >= 11"),
    (["--strategy", "zero3", "--precision", "bf16-true"], "precision='bf16-true' is not valid; allowed: fp32, "
                                                          "bf16-mixed or fp16-mixed with strategy=zero3"),
])
def test_bad_flags(_run, tmp_path, args, needle):
    r = _run(args, tmp_path)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert needle in r.stderr
    assert not (tmp_path / "run").exists()


def test_unknown_config_key(trainfit_cli, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('precision = "fp32"\nmicro_bach = 4\n')
    r = trainfit_cli("train", cfg)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "config key='micro_bach' is not valid; allowed: one of:" in r.stderr and "micro_batch" in r.stderr


def _checkpoint(_run, tmp_path):
    r = _run([], tmp_path)
    assert r.returncode == 0, r.stderr
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001.pt"
    return ckpt, hashlib.sha256(ckpt.read_bytes()).hexdigest()


def test_corrupt_checkpoint_is_refused_and_kept(_run, tmp_path):
    ckpt, _ = _checkpoint(_run, tmp_path)
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    before = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    r = _run(["--resume", "--steps", "2"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "fails its sha256 checksum" in r.stderr and "step-00000001.pt" in r.stderr
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == before


def test_foreign_checkpoint_is_refused(_run, tmp_path):
    ckpt, _ = _checkpoint(_run, tmp_path)
    torch.save({"weights": torch.ones(3)}, ckpt)
    ckpt.with_suffix(".json").unlink()
    (ckpt.parent / "step-00000002.pt").write_bytes(b"not a checkpoint")
    (ckpt.parent / "step-00000002.json").write_text('{"bytes": 16, "sha256": "x"}')
    from trainfit.checkpoint import read_checkpoint
    from trainfit.errors import CheckpointError

    with pytest.raises(CheckpointError, match="is not a trainfit checkpoint"):
        read_checkpoint(ckpt)
    r = _run(["--resume", "--steps", "3"], tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("trainfit: error: no usable checkpoint")


def test_existing_checkpoints_are_not_overwritten_without_resume(_run, tmp_path):
    ckpt, digest = _checkpoint(_run, tmp_path)
    r = _run([], tmp_path)
    assert r.returncode == 2 and "pass --resume to continue it" in r.stderr
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == digest
