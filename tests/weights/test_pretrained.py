"""``--model hf:DIR``: a save_pretrained directory loads with its weights; its first loss is transformers' own."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch.nn import functional as F

from reliability.cli_harness import check_promise, cli, error_lines, snapshot
from trainfit.config import make_config
from trainfit.run import build_run

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers")


def test_first_step_loss_equals_transformers(llama_dir):
    cfg = make_config(dict(model=f"hf:{llama_dir}", seq_len=16, micro_batch=3, accumulation=1))
    run = build_run(cfg)
    batch = run.task.example_batch(3)
    loss = run.step([batch]).loss  # the first step's loss: computed before the update

    # The reference: transformers' own model from the same files, the standard shifted cross-entropy
    # on the whole sequence (inputs plus the last label), sum / count, in fp32.
    ref = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    seq = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)
    with torch.no_grad():
        logits = ref(input_ids=seq).logits
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), seq[:, 1:].flatten(), reduction="sum") / seq[:, 1:].numel()
    assert loss == pytest.approx(want.item(), rel=1e-6)


def test_loading_is_deterministic_whatever_the_seed(llama_dir):
    a, b = (build_run(make_config(dict(model=f"hf:{llama_dir}", seed=s, seq_len=8))).model for s in (0, 7))
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert pa.dtype == torch.float32 and torch.equal(pa, pb), name


def _broken(tmp_path, llama_dir, how: str):
    d = tmp_path / "broken"
    shutil.copytree(llama_dir, d)
    if how == "no-config":
        (d / "config.json").unlink()
    elif how == "no-architectures":
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop("architectures")
        (d / "config.json").write_text(json.dumps(cfg))
    elif how == "no-weights":
        (d / "model.safetensors").unlink()
    elif how == "corrupt":
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    return d


@pytest.mark.parametrize("how,says", [("no-config", "config.json"), ("no-architectures", "architectures"),
                                      ("no-weights", "model.safetensors"), ("corrupt", "model.safetensors"),
                                      ("model-config", "shape is fixed"), ("missing-dir", "existing directory")])
def test_an_unusable_directory_is_refused_in_one_line(tmp_path, llama_dir, how, says):
    d = tmp_path / "nowhere" / "llama" if how == "missing-dir" else llama_dir
    if how not in ("model-config", "missing-dir"):
        d = _broken(tmp_path, llama_dir, how)
    extra = ["--model-config", "hidden_size=64"] if how == "model-config" else []
    before = snapshot(tmp_path)
    r = cli(["train", "--model", f"hf:{d}", *extra, "--steps", "1", "--seq-len", "8",
             "--run-dir", str(tmp_path / "run")])
    check_promise(r, tmp_path, before)
    assert r.rc == 2
    line = next(ln for ln in error_lines(r.err) if ln.startswith("trainfit: error:"))
    assert says in line, line


def test_seq_len_above_a_pretrained_models_positions_names_the_limit_not_a_config_override(tmp_path, llama_dir):
    """A pretrained directory's shape is fixed: the fix is a shorter --seq-len, not --model-config (refused)."""
    before = snapshot(tmp_path)
    r = cli(["train", "--model", f"hf:{llama_dir}", "--steps", "1", "--seq-len", "65", "--run-dir", str(tmp_path / "r")])
    check_promise(r, tmp_path, before)
    assert r.rc == 2
    line = next(ln for ln in error_lines(r.err) if ln.startswith("trainfit: error:"))
    assert "seq_len=65" in line and "max_position_embeddings=64" in line and "--seq-len 64 or less" in line, line
    assert "--model-config" not in line, line
