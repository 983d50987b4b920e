"""The README's worked example as a test: a local transformers checkpoint and tokenizer (made with
``save_pretrained``), a real corpus (the Python standard library's own source), ``trainfit prepare``, a
fine-tune with warm-up + cosine, evaluation and TensorBoard, killed and resumed bitwise, and the exported
model loaded back by ``transformers`` alone."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainfit.checkpoint import list_checkpoints, read_checkpoint

from loop.helpers import bitwise  # noqa: E402  (tests/ on sys.path)
from reliability.cli_harness import cli  # noqa: E402

pytestmark = pytest.mark.hf
ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(Path(json.__file__).parent / "*.py")  # 5 files of real Python, shipped with every Python




def _log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fine_tune_a_local_checkpoint_on_real_text_killed_and_resumed_bitwise_then_loaded_by_transformers(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "make_checkpoint.py"), str(ckpt), "--corpus", CORPUS,
                        "--vocab-size", "320"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = cli(["prepare", "--data", CORPUS, "--tokenizer", str(ckpt), "--out", str(tmp_path / "tokens")])
    assert r.rc == 0, r.err
    job = ["train", "--model", f"hf:{ckpt}", "--data", str(tmp_path / "tokens"), "--val-fraction", "0.2",
           "--seq-len", "32", "--micro-batch", "2", "--accumulation", "2", "--steps", "6", "--lr", "1e-3",
           "--schedule", "cosine", "--warmup-steps", "2", "--min-lr", "1e-4", "--eval-every", "2",
           "--weight-decay", "0.1", "--checkpoint-every", "3", "--log", "tensorboard"]
    full = tmp_path / "full"
    r = cli([*job, "--run-dir", str(full)])
    assert r.rc == 0, r.err

    # "Killed" after step 4: its log holds steps 1-4 and its newest checkpoint is step 3.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    last = list_checkpoints(cut)[-1]
    last.unlink()
    last.with_suffix(".json").unlink()
    lines = (cut / "metrics.jsonl").read_text().splitlines(keepends=True)
    (cut / "metrics.jsonl").write_text("".join(lines[:4]))
    shutil.rmtree(cut / "model")
    r = cli([*job, "--run-dir", str(cut), "--resume"])
    assert r.rc == 0, r.err

    a, b = read_checkpoint(list_checkpoints(full)[-1]), read_checkpoint(list_checkpoints(cut)[-1])
    assert a["step"] == b["step"] == 6
    for key in ("model", "optimizer", "schedule", "rng"):
        assert bitwise(a[key], b[key]), key
    la, lb = _log(full), _log(cut)
    assert [x["step"] for x in lb] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "val_loss"):
        assert [x.get(key) for x in la] == [x.get(key) for x in lb], key
    assert [x["step"] for x in la if "val_loss" in x] == [2, 4, 6]
    # the schedule the run used, worked by hand: warm-up 1/2, 2/2, then cosine from 1e-3 to 1e-4 over 4 steps
    cosine = [1e-4 + 0.9e-3 * (1 + math.cos(math.pi * k / 4)) / 2 for k in (1, 2, 3, 4)]
    assert [x["lr"] for x in la] == pytest.approx([5e-4, 1e-3, *cosine], rel=1e-9)

    # The exported model and tokenizer load with transformers alone and give the trained weights' logits.
    model = AutoModelForCausalLM.from_pretrained(full / "model").eval()
    tok = AutoTokenizer.from_pretrained(full / "model")
    ids = tok("def loads(s):", return_tensors="pt").input_ids
    reference = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    reference.load_state_dict(a["model"])  # the step-6 weights trainfit checkpointed (every key)
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-6)
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), str(full / "model"), "--tokens", "5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("def "), r.stderr
    assert (full / "tensorboard").is_dir() and any((full / "tensorboard").iterdir())
