"""The training loop: loss falls, resume is bitwise, the JSON summary is the only stdout."""

import json

import pytest
import torch

from trainfit.checkpoint import list_checkpoints, read_checkpoint
from trainfit.config import RunConfig
from trainfit.train import train

TINY = dict(model_config="n_layer=1,d_model=32,n_head=2", seq_len=16, micro_batch=2, accumulation=2, lr=1e-2)


def _final_state(run_dir):
    state = read_checkpoint(list_checkpoints(run_dir)[-1])
    return state["model"], state["optimizer"]["state"], state["precision"]


def _assert_bitwise(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_bitwise(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_bitwise(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_resume_is_bitwise_identical(tmp_path, precision):
    N = 3
    full = RunConfig(**TINY, precision=precision, steps=2 * N, run_dir=str(tmp_path / "full"))
    train(full, progress=False)
    half = RunConfig(**TINY, precision=precision, steps=N, run_dir=str(tmp_path / "split"))
    train(half, progress=False)
    train(RunConfig(**TINY, precision=precision, steps=2 * N, run_dir=str(tmp_path / "split")), resume=True,
          progress=False)
    _assert_bitwise(_final_state(tmp_path / "full"), _final_state(tmp_path / "split"))


def test_loss_falls_on_the_default_task(tmp_path):
    cfg = RunConfig(model_config="n_layer=2,d_model=64,n_head=2", steps=40, run_dir=str(tmp_path), seq_len=32)
    s = train(cfg, progress=False)
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = sum(l["loss"] for l in lines[:5]) / 5
    last = sum(l["loss"] for l in lines[-5:]) / 5
    assert last < first - 0.3, (first, last)
    assert s.skipped_steps == 0 and s.steps == 40 and s.effective_batch == 32


def test_cli_json_is_the_only_stdout(trainfit_cli, tmp_path):
    r = trainfit_cli("train", "--steps", "2", "--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16",
                     "--run-dir", tmp_path, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"steps", "final_loss", "skipped_steps", "tokens_per_s", "effective_batch"} <= out.keys()
    assert out["steps"] == 2 and out["effective_batch"] == 32
    assert len(r.stdout.strip().splitlines()) == 1


def test_one_file_and_sharded_checkpoints_share_the_resume_rule(tmp_path):
    """One set of resume keys: the same global batch resumes (here split differently), another is refused."""
    from trainfit.errors import CheckpointError

    run_dir = str(tmp_path / "r")
    train(RunConfig(**TINY, steps=2, run_dir=run_dir), progress=False)  # micro-batch 2 x accumulation 2
    resplit = {**TINY, "micro_batch": 1, "accumulation": 4}  # the same 4 samples per step, cut in 4
    assert train(RunConfig(**resplit, steps=3, run_dir=run_dir), resume=True, progress=False).steps == 3
    with pytest.raises(CheckpointError, match="global batch of 4 samples per step .* this run has 8"):
        train(RunConfig(**{**TINY, "accumulation": 4}, steps=4, run_dir=run_dir), resume=True, progress=False)
    with pytest.raises(CheckpointError, match="written with seq_len=16, this run has seq_len=32"):
        train(RunConfig(**{**TINY, "seq_len": 32}, steps=4, run_dir=run_dir), resume=True, progress=False)
