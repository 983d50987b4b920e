"""Issue 35, row 8 for the files trainfit writes and reads back: a ``prepared.json`` or a checkpoint's sidecar
nested thousands deep is refused in one line (exit 2) through the gate's RECORD bounds, and nothing is changed.
Before, ``json.loads`` raised ``RecursionError`` out of ``read_sidecar`` and ``recorded_job`` (a traceback)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from tests.data.conftest import STDLIB_JSON

TINY = ["--model", "gpt-tiny", "--model-config", "n_layer=1,d_model=16,n_head=2", "--seq-len", "8",
        "--micro-batch", "2", "--accumulation", "1", "--lr", "0.01"]
DEEP = 5000


def nested(depth: int) -> str:
    """A JSON object nested ``depth`` levels: ``{"a": {"a": ... 1 ...}}``."""
    return '{"a": ' * depth + "1" + "}" * depth


def hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def refused_in_one_line(r, root: Path, before: dict[str, str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("trainfit: error: "), r.stderr
    assert "Traceback" not in r.stderr and hashes(root) == before
    return lines[0]


def test_a_prepared_json_nested_5000_deep_is_refused_in_one_line(tmp_path, trainfit_cli):
    prep = tmp_path / "prep"
    assert trainfit_cli("prepare", "--data", STDLIB_JSON / "__init__.py", "--out", prep).returncode == 0
    (prep / "prepared.json").write_text(nested(DEEP))
    before = hashes(tmp_path)
    r = trainfit_cli("train", "--data", prep, *TINY, "--steps", "1", "--run-dir", tmp_path / "run")
    line = refused_in_one_line(r, tmp_path, before)
    assert "data=" in line and "prepared.json" in line and "nested" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("payload", [nested(DEEP), "[" * DEEP + "]" * DEEP])
def test_a_checkpoint_sidecar_nested_5000_deep_is_refused_in_one_line(tmp_path, trainfit_cli, payload):
    run = tmp_path / "run"
    r = trainfit_cli("train", *TINY, "--steps", "2", "--checkpoint-every", "2", "--run-dir", run)
    assert r.returncode == 0, r.stderr
    sidecar = run / "checkpoints" / "step-00000002.json"
    assert sidecar.is_file()
    sidecar.write_text(payload)
    before = hashes(tmp_path)
    r = trainfit_cli("train", *TINY, "--steps", "3", "--checkpoint-every", "2", "--run-dir", run, "--resume")
    line = refused_in_one_line(r, tmp_path, before)
    assert "step-00000002" in line and "nested" in line, line


def test_a_tokenizer_config_nested_5000_deep_is_refused_in_one_line(tmp_path, trainfit_cli, bpe_dir):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((bpe_dir / "tokenizer.json").read_bytes())
    (tok / "tokenizer_config.json").write_text(nested(DEEP))
    before = hashes(tmp_path)
    r = trainfit_cli("prepare", "--data", STDLIB_JSON / "__init__.py", "--tokenizer", tok, "--out", tmp_path / "p")
    line = refused_in_one_line(r, tmp_path, before)
    assert "tokenizer=" in line and "tokenizer_config.json" in line and "nested" in line, line
