"""The loss chart and table: validation loss points, the learning rate on a second axis when it changes,
final val loss/perplexity in the table; older logs without these keys read as before."""

import json
import math

import numpy as np
import pytest

from trainfit.report.data import loss_series
from trainfit.report.html import write_report

from .test_report import decode, parse

pytest.importorskip("matplotlib")

ORANGE = (0xDD, 0x84, 0x52)  # validation loss
PURPLE = (0x81, 0x72, 0xB3)  # learning rate


def _pixels(im, rgb) -> int:
    return int((np.abs(np.asarray(im).astype(int) - rgb).max(axis=2) < 10).sum())  # tight: blue edges blend


def _rows(*, val: bool, lr) -> list[dict]:
    rows = []
    for step in range(1, 21):
        r = {"step": step, "loss": 5.0 - 0.1 * step, "stepped": True, "loss_scale": 1.0, "lr": lr(step)}
        if val and step % 5 == 0:
            r |= {"val_loss": 5.2 - 0.1 * step, "val_perplexity": math.exp(5.2 - 0.1 * step), "val_tokens": 640}
        rows.append(r)
    return rows


def _write(tmp_path, name: str, rows: list[dict]):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def warmup_cosine(step: int) -> float:
    return 1e-3 * step / 5 if step <= 5 else 1e-3 * 0.5 * (1 + math.cos(math.pi * (step - 5) / 15))


def test_loss_series_reads_val_points_and_lr_and_tolerates_old_logs():
    s = loss_series(_rows(val=True, lr=warmup_cosine))
    assert s.val_steps == [5, 10, 15, 20]
    assert s.val_loss == pytest.approx([4.7, 4.2, 3.7, 3.2])
    assert s.final_val == (20, pytest.approx(3.2), pytest.approx(math.exp(3.2)))
    assert s.lr_varies and s.lr[4] == pytest.approx(1e-3)
    old = loss_series([{"step": i, "loss": 1.0 / i, "stepped": True, "loss_scale": 1.0} for i in range(1, 4)])
    assert old.val_steps == [] and old.final_val is None and not old.lr_varies
    assert all(math.isnan(v) for v in old.lr)


def test_chart_draws_val_points_and_a_varying_lr_only_when_present(tmp_path):
    page = parse(write_report(_write(tmp_path, "sched", _rows(val=True, lr=warmup_cosine))))
    chart = decode(page.imgs[0])
    assert _pixels(chart, ORANGE) > 30 and _pixels(chart, PURPLE) > 30
    text = " ".join(page.text)
    assert "final validation loss (step 20)" in text and "3.2" in text
    assert "final validation perplexity" in text and "24.5" in text  # exp(3.2) = 24.53
    assert "learning rate (first → last)" in text

    page = parse(write_report(_write(tmp_path, "const", _rows(val=False, lr=lambda s: 3e-3))))
    chart = decode(page.imgs[0])
    assert _pixels(chart, ORANGE) == 0 and _pixels(chart, PURPLE) == 0  # no evaluation, a constant lr: no axis
    text = " ".join(page.text)
    assert "validation" not in text and "learning rate" in text and "0.003" in text
