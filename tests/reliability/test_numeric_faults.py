"""Numerical faults: fp16 overflow storms and NaN losses, injected at the Task seam.

References: the loss-scale arithmetic is checked against a hand calculation (65536 halved
per skip); "the checkpoint on disk equals the last good state" against an independent
fault-free run of as many steps as were good.
"""

from __future__ import annotations

import json

import pytest

from trainfit.cli import main as cli_main

from .conftest import TINY_FLAGS, error_lines, latest, tensors_equal, tiny_config, training_state
from .faults import patch_make_task

pytestmark = pytest.mark.timeout(300)


def _train_cli(run_dir, *flags):
    return cli_main(["train", *TINY_FLAGS, "--checkpoint-every", "1", "--run-dir", str(run_dir), *flags])


def _toml(path, **values) -> str:
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    return str(path)


def _reference(tmp_path, steps: int, **kw) -> dict:
    from trainfit.train import train

    d = tmp_path / f"reference-{steps}"
    train(tiny_config(steps=steps, run_dir=str(d), **kw), progress=False)
    return latest(d)[1]


def _one_error(err: str) -> str:
    lines = [ln for ln in error_lines(err) if ln.startswith("trainfit: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_fp16_overflow_storm_is_survived_and_counted(tmp_path, monkeypatch, capsys):
    storm = range(3, 8)  # M = 5 consecutive steps with infinite gradients
    patch_make_task(monkeypatch, bad_steps=storm, kind="inf-grad", accumulation=2)
    cfg = _toml(tmp_path / "c.toml", keep_checkpoints=20)
    rc = _train_cli(tmp_path / "run", cfg, "--precision", "fp16-mixed", "--steps", "10", "--json")
    out = capsys.readouterr().out
    assert rc == 0
    assert json.loads(out)["skipped_steps"] == len(storm)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["stepped"] for r in rows] == [s not in storm for s in range(1, 11)]
    # Hand calculation: 2**16 to start, halved once per skipped step, unchanged otherwise.
    expected = [65536.0 / 2 ** sum(1 for s in storm if s < step) for step in range(1, 11)]
    assert [r["loss_scale"] for r in rows] == expected
    # Skipped steps do not touch the weights or the optimizer state.
    from trainfit.checkpoint import read_checkpoint

    ck = lambda s: read_checkpoint(tmp_path / "run" / "checkpoints" / f"step-{s:08d}.pt")  # noqa: E731
    assert tensors_equal([ck(2)["model"], ck(2)["optimizer"]], [ck(7)["model"], ck(7)["optimizer"]]) == []
    assert tensors_equal(ck(7)["model"], ck(8)["model"]) != []  # and training resumed afterwards


@pytest.mark.parametrize("limit, expect", [
    ({"max_consecutive_skips": 4}, "4 optimizer steps in a row overflowed"),
    ({"min_loss_scale": 4096.0}, "fell below min_loss_scale=4096"),
])
def test_fp16_storm_past_the_limit_stops_and_keeps_last_good_weights(tmp_path, monkeypatch, capsys, limit, expect):
    patch_make_task(monkeypatch, bad_steps=range(3, 100), kind="inf-grad", accumulation=2)
    cfg = _toml(tmp_path / "c.toml", **limit)
    rc = _train_cli(tmp_path / "run", cfg, "--precision", "fp16-mixed", "--steps", "30")
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and expect in line and "bf16" in line  # names the likely cause and the way out
    monkeypatch.undo()
    ref = _reference(tmp_path, 2, precision="fp16-mixed")
    path, last = latest(tmp_path / "run")
    # Stops at the 4th skip (4 in a row), or at the 5th (65536 / 2**5 = 2048 < 4096).
    assert last["step"] == (3 + 4 - 2 if "max_consecutive_skips" in limit else 3 + 5 - 2)
    assert tensors_equal([last["model"], last["optimizer"]], [ref["model"], ref["optimizer"]]) == []


@pytest.mark.parametrize("precision, kind, clip", [
    ("fp32", "nan-loss", 1.0),
    ("fp32", "inf-grad", 1.0),
    ("fp32", "inf-grad", 0.0),  # no clipping: nothing else looks at the gradients
    ("bf16-mixed", "inf-grad", 0.0),
])
def test_non_finite_without_scaler_stops_and_disk_holds_last_good_state(tmp_path, monkeypatch, capsys, precision,
                                                                       kind, clip):
    patch_make_task(monkeypatch, bad_steps={4}, kind=kind, accumulation=2)
    cfg = _toml(tmp_path / "c.toml", grad_clip=clip)  # (no CLI flag for it)
    rc = _train_cli(tmp_path / "run", cfg, "--precision", precision, "--steps", "8")
    line = _one_error(capsys.readouterr().err)
    assert rc == 2 and "step 4" in line and "not finite" in line
    monkeypatch.undo()
    ref = _reference(tmp_path, 3, precision=precision, grad_clip=clip)
    path, last = latest(tmp_path / "run")
    assert path.name == "step-00000003.pt"
    assert tensors_equal(training_state(last), training_state(ref)) == []
