"""The loop: evaluation in the log, resume bitwise with evaluation on, TensorBoard files read back by
tensorboard's own reader, checkpoints by time as well as by steps."""

from __future__ import annotations

import math

import pytest
import torch

from trainfit.checkpoint import list_checkpoints, read_checkpoint
from trainfit.config import RunConfig
from trainfit.train import checkpoint_due, train

from .helpers import TINY, add_val_split, bitwise, metrics, reference_val_loss, val_dataset, with_eval


def _final(run_dir):
    state = read_checkpoint(list_checkpoints(run_dir)[-1])
    return state["model"], state["optimizer"]["state"], state["rng"]




def test_eval_every_logs_the_token_weighted_val_loss_of_the_weights_at_that_step(tmp_path, monkeypatch):
    add_val_split(monkeypatch)
    cfg = with_eval(RunConfig(**TINY, steps=3, checkpoint_every=1, run_dir=str(tmp_path)), every=2)
    s = train(cfg, progress=False)
    log = metrics(tmp_path)
    assert [("val_loss" in r) for r in log] == [False, True, True]  # every 2 steps and at the end
    # the reference: plain PyTorch on the checkpointed weights of steps 2 and 3, every validation sample
    from trainfit.tasks.make import make_task

    task = make_task("gpt-tiny", model_config=TINY["model_config"], seq_len=TINY["seq_len"])
    ds = val_dataset()
    batches = [task.collate([ds[i] for i in range(j, min(j + 2, len(ds)))]) for j in range(0, len(ds), 2)]
    for rec, ckpt in zip(log[1:], list_checkpoints(tmp_path)[-2:]):
        model = task.build_model()
        model.load_state_dict(read_checkpoint(ckpt)["model"])
        ref, count = reference_val_loss(model, batches)
        assert rec["val_loss"] == pytest.approx(ref, rel=1e-6, abs=0)
        assert rec["val_tokens"] == count
        assert rec["val_perplexity"] == pytest.approx(math.exp(ref), rel=1e-6)
    assert s.val_loss == log[-1]["val_loss"] and s.val_perplexity == log[-1]["val_perplexity"]


def test_eval_batches_limits_each_rank_to_its_first_batches(tmp_path, monkeypatch):
    add_val_split(monkeypatch)
    train(with_eval(RunConfig(**TINY, steps=1, run_dir=str(tmp_path)), every=1, batches=1), progress=False)
    ds = val_dataset()
    assert metrics(tmp_path)[-1]["val_tokens"] == int(ds.lengths[0] + ds.lengths[1])  # one micro-batch of 2


def test_resume_with_eval_on_is_bitwise(tmp_path, monkeypatch):
    add_val_split(monkeypatch)
    full = with_eval(RunConfig(**TINY, steps=6, run_dir=str(tmp_path / "full")), every=2)
    train(full, progress=False)
    train(with_eval(RunConfig(**TINY, steps=3, run_dir=str(tmp_path / "split")), every=2), progress=False)
    train(with_eval(RunConfig(**TINY, steps=6, run_dir=str(tmp_path / "split")), every=2), resume=True,
          progress=False)
    assert bitwise(_final(tmp_path / "full"), _final(tmp_path / "split"))
    a, b = metrics(tmp_path / "full"), metrics(tmp_path / "split")
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    # evaluated at 2, 4, 6 uninterrupted; the split run also at 3 (its end) -- and the same numbers at 2, 4, 6
    assert {r["step"]: r["val_loss"] for r in a if "val_loss" in r}.items() <= \
        {r["step"]: r["val_loss"] for r in b if "val_loss" in r}.items()


def test_eval_without_a_validation_split_is_refused_before_any_step(tmp_path):
    from trainfit.errors import ConfigError

    with pytest.raises(ConfigError, match="eval_every"):
        train(with_eval(RunConfig(**TINY, steps=1, run_dir=str(tmp_path / "r")), every=1), progress=False)
    assert not (tmp_path / "r").exists()


def test_the_lr_each_step_used_and_cumulative_skips_are_logged(tmp_path):
    train(RunConfig(**TINY, steps=2, run_dir=str(tmp_path / "const")), progress=False)
    log = metrics(tmp_path / "const")
    assert [r["lr"] for r in log] == [TINY["lr"]] * 2  # constant schedule, no warm-up: the configured lr
    assert [r["skipped_steps"] for r in log] == [0, 0]
    train(RunConfig(**TINY, steps=4, warmup_steps=2, schedule="linear", min_lr=0.002,
                    run_dir=str(tmp_path / "sched")), progress=False)
    # by hand (docs/schedule.md): warm-up (s+1)/W of 0.01, then 1 - (1 - 0.2) * (s+1-W)/(T-W)
    assert [r["lr"] for r in metrics(tmp_path / "sched")] == pytest.approx([0.005, 0.01, 0.006, 0.002], rel=1e-12)


@pytest.mark.parametrize("done,every,by_time,due", [(3, 0, False, False), (3, 0, True, True), (4, 2, False, True),
                                                   (5, 2, False, False), (10, 0, False, True), (10, 3, False, True)])
def test_checkpoint_due_by_steps_time_or_the_end(done, every, by_time, due):
    assert checkpoint_due(done, steps=10, every=every, by_time=by_time) is due


def test_checkpoint_minutes_saves_when_the_clock_runs_out(tmp_path, monkeypatch):
    import trainfit.train as loop

    clock = iter(range(0, 10_000, 40))  # every perf_counter call advances 40 s
    monkeypatch.setattr(loop.time, "perf_counter", lambda: float(next(clock)))
    # every step takes several calls -> > 60 s between checks: one checkpoint per step with checkpoint_minutes=1
    train(RunConfig(**TINY, steps=3, checkpoint_every=0, checkpoint_minutes=1.0, keep_checkpoints=5,
                    run_dir=str(tmp_path / "timed")), progress=False)
    assert [p.name for p in list_checkpoints(tmp_path / "timed")] == [f"step-0000000{i}.pt" for i in (1, 2, 3)]
    train(RunConfig(**TINY, steps=3, checkpoint_every=0, checkpoint_minutes=0.0, keep_checkpoints=5,
                    run_dir=str(tmp_path / "off")), progress=False)
    assert [p.name for p in list_checkpoints(tmp_path / "off")] == ["step-00000003.pt"]  # the end only


def _scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))  # event files hold float32


def test_tensorboard_files_hold_the_logged_numbers_and_a_resume_purges_redone_steps(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    add_val_split(monkeypatch)
    run_dir = tmp_path / "r"
    cfg = with_eval(RunConfig(**TINY, steps=3, checkpoint_every=2, log="tensorboard", run_dir=str(run_dir)), every=2)
    train(cfg, progress=False)
    # a crash after step 3's log line but before its checkpoint: only step 2's checkpoint is left
    for p in list_checkpoints(run_dir)[-1:]:
        p.unlink()
        p.with_suffix(".json").unlink(missing_ok=True)
    cfg4 = with_eval(RunConfig(**TINY, steps=4, checkpoint_every=2, log="tensorboard", run_dir=str(run_dir)), every=2)
    train(cfg4, resume=True, progress=False)
    log = metrics(run_dir)
    tb = _scalars(run_dir)
    assert [s for s, _ in tb["train/loss"]] == [1, 2, 3, 4]  # step 3 once: the first run's was purged
    for tag, key in [("train/loss", "loss"), ("lr", "lr"), ("loss_scale", "loss_scale"), ("grad_norm", "grad_norm"),
                     ("skipped_steps", "skipped_steps"), ("tokens_per_s", "tokens_per_s"),
                     ("data_wait_frac", "data_wait_frac"), ("val/loss", "val_loss"),
                     ("val/perplexity", "val_perplexity")]:
        want = [(r["step"], _f32(r[key])) for r in log if key in r]
        assert tb[tag] == want, tag
    assert [s for s, _ in tb["val/loss"]] == [2, 4]
    assert not any(t.startswith("memory/") for t in tb)  # CPU: no allocator peak to read


def test_missing_tensorboard_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    import builtins

    from trainfit.errors import ConfigError

    real = builtins.__import__

    def no_tensorboard(name, *a, **kw):
        if name == "torch.utils.tensorboard":
            raise ModuleNotFoundError("No module named 'tensorboard'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ConfigError, match=r"trainfit\[tensorboard\]") as e:
        train(RunConfig(**TINY, steps=1, log="tensorboard", run_dir=str(tmp_path / "r")), progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()
