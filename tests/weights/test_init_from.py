"""``--init-from RUN_DIR``: the weights of another run (its export, else its newest checkpoint); all else fresh."""

from __future__ import annotations

import pytest
import torch

from reliability.cli_harness import check_promise, cli, error_lines, snapshot
from trainfit.config import make_config
from trainfit.export import export_model
from trainfit.run import build_run

from .conftest import GPT


def _cfg(tmp_path, name, **kw):
    return make_config(dict(model="gpt-tiny", model_config=GPT, seq_len=8, micro_batch=2, accumulation=1, lr=0.05,
                            run_dir=str(tmp_path / name), **kw))


def _source(tmp_path, **kw):
    run = build_run(_cfg(tmp_path, "source", **kw))
    batch = run.task.example_batch(2)
    for _ in range(2):
        run.step([batch])
    run.save(2)
    return run


def test_from_a_checkpoint_weights_only(tmp_path):
    _source(tmp_path)
    saved = torch.load(tmp_path / "source" / "checkpoints" / "step-00000002.pt", weights_only=True)["model"]
    run = build_run(_cfg(tmp_path, "target", init_from=str(tmp_path / "source"), seed=5))
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert len(run.optimizer.state) == 0  # the optimizer starts fresh


def test_a_lora_checkpoint_initialises_the_plain_model_merged(tmp_path):
    src = _source(tmp_path, lora="r=2,alpha=4,targets=qkv,fc")
    for n, p in src.model.named_parameters():
        assert ("lora_" in n) == p.requires_grad
    run = build_run(_cfg(tmp_path, "target", init_from=str(tmp_path / "source")))
    ids = src.task.example_batch(2)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(run.model(ids), src.model(ids), atol=1e-6, rtol=0)


@pytest.mark.hf
def test_the_export_comes_first(tmp_path, llama_dir):
    transformers = pytest.importorskip("transformers")
    cfg = make_config(dict(model=f"hf:{llama_dir}", seq_len=8, micro_batch=2, accumulation=1, lr=0.05,
                           run_dir=str(tmp_path / "source")))
    src = build_run(cfg)
    src.step([src.task.example_batch(2)])
    export_model(src, tmp_path / "source" / "model")
    run = build_run(make_config({**cfg.to_dict(), "run_dir": str(tmp_path / "t"), "init_from": cfg.run_dir}))
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "source" / "model").state_dict()
    for k, v in run.model.state_dict().items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("case,says", [("missing", "an existing trainfit run directory"),
                                       ("foreign", "neither"), ("shape", "tok_emb.weight is (256, 32)")])
def test_a_wrong_run_dir_is_refused_in_one_line(tmp_path, case, says):
    if case == "shape":
        _source(tmp_path)
    (tmp_path / "foreign").mkdir()
    init = {"missing": tmp_path / "nowhere", "foreign": tmp_path / "foreign", "shape": tmp_path / "source"}[case]
    before = snapshot(tmp_path)
    r = cli(["train", "--model", "gpt-tiny", "--model-config", "n_layer=2,d_model=64,n_head=2", "--init-from",
             str(init), "--steps", "1", "--seq-len", "8", "--run-dir", str(tmp_path / "run")])
    check_promise(r, tmp_path, before)
    assert r.rc == 2
    line = next(ln for ln in error_lines(r.err) if ln.startswith("trainfit: error:"))
    assert says in line, line
