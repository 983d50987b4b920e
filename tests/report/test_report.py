"""The HTML report: data read as written, every chart a real, non-blank image, no network needed."""

import base64
import io
import json
import math
from html.parser import HTMLParser

import numpy as np
import pytest

from trainfit.cli import main
from trainfit.report.data import load_run, loss_series, memory_parts, time_parts
from trainfit.report.html import write_report
from trainfit.results import MemoryReport, ProfileReport, ResultFormatError

from .conftest import MEMORY, MIB, PROFILE, fp16_rows

pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")

RED = (0xC4, 0x4E, 0x52)  # the skipped-step marker colour


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.imgs: list[dict] = []
        self.external: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a)
        for key in ("src", "href"):
            if a.get(key) and not a[key].startswith("data:"):
                self.external.append(a[key])

    def handle_data(self, data):
        self.text.append(data)


def parse(path) -> Page:
    p = Page()
    p.feed(path.read_text())
    return p


def decode(img: dict):
    head, b64 = img["src"].split(",", 1)
    assert head == "data:image/png;base64"
    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    im.load()  # raises on a truncated or corrupt PNG
    return im.convert("RGB")


def ink_share(im) -> float:
    """Share of pixels that are not (near) white."""
    return float((np.asarray(im).min(axis=2) < 240).mean())


def red_pixels(im) -> int:
    return int((np.abs(np.asarray(im).astype(int) - RED).max(axis=2) < 30).sum())


def test_loss_series_keeps_the_last_line_of_a_repeated_step_and_lists_skips():
    s = loss_series(fp16_rows())
    assert s.steps == list(range(1, 11))
    # by hand: 5.0 - 0.1*step, step 4 non-finite, step 5's second line wins over the 99.0 of the first
    assert s.loss[4] == pytest.approx(4.5) and math.isnan(s.loss[3]) and s.loss[0] == pytest.approx(4.9)
    assert s.skipped == [3, 4]
    assert s.loss_scale[:3] == [65536.0] * 3 and s.loss_scale[3] == 32768.0 and s.loss_scale[4:] == [16384.0] * 6
    assert s.scaled


def test_parts_read_from_the_commands_keys():
    mem = MemoryReport.from_dict({**MEMORY[0], "params_bytes": 1, "grads_bytes": 2, "optimizer_bytes": 3,
                                  "activations_bytes": 4, "temporaries_bytes": 0})
    assert memory_parts(mem) == {"params": 1, "grads": 2, "optimizer": 3, "activations": 4, "temporaries": 0}
    prof = ProfileReport.from_dict({**PROFILE, "forward_s": 0.5, "backward_s": 1.0, "junk": 3})
    assert time_parts(prof) == {"data_wait": 0.04, "h2d": 0.0, "forward": 0.5, "backward": 1.0, "comm_exposed": 0.0,
                                "optimizer": 0.01, "rest": 0.002}
    assert prof.extra == {"junk": 3}  # kept, not read as a phase
    with pytest.raises(ResultFormatError, match="backward_s"):  # a phase is the median in seconds, not a spread
        ProfileReport.from_dict({**PROFILE, "backward_s": {"median": 1.0, "p25": 0.9}})


def test_report_is_self_contained_and_every_chart_decodes_non_blank(run_dir):
    path = write_report(run_dir)
    page = parse(path)
    assert page.external == []  # nothing to fetch: opens offline
    alts = [i["alt"] for i in page.imgs]
    assert alts == ["loss curve", "loss scale", "memory parts", "step time breakdown"]
    for img in page.imgs:
        im = decode(img)
        assert im.width >= 300 and im.height >= 150
        assert ink_share(im) > 0.02, img["alt"]  # axes, bars, lines: not a blank canvas
        assert len(np.unique(np.asarray(im).reshape(-1, 3), axis=0)) > 20, img["alt"]
    text = " ".join(page.text)
    assert "skipped steps" in text and "3, 4" in text  # the two skipped steps, by number
    assert "zero2 halves gradient memory per rank" in text and "does not fit: 95 GiB > 80 GiB" in text
    assert "raise loader_workers from 0 to 2" in text  # profile advice
    assert "master copy adds 12 MiB" in text  # memory note
    assert "metrics.jsonl line 12" in text  # the line cut short by a crash is reported, not fatal


def test_skipped_steps_are_drawn_only_when_there_are_some(run_dir, tmp_path):
    imgs = parse(write_report(run_dir)).imgs
    assert red_pixels(decode(imgs[0])) > 20  # red crosses at steps 3 and 4
    clean = tmp_path / "clean"
    clean.mkdir()
    rows = [{"step": i, "loss": 3.0 / i, "stepped": True, "loss_scale": 1.0} for i in range(1, 8)]
    (clean / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = parse(write_report(clean))
    assert [i["alt"] for i in page.imgs] == ["loss curve"]  # no scaler: no loss-scale chart
    assert red_pixels(decode(page.imgs[0])) == 0


def test_memory_table_shows_the_parts_in_mib(run_dir):
    art = load_run(run_dir)
    assert [memory_parts(r)["optimizer"] for r in art.memory] == [24 * MIB, 36 * MIB]
    text = " ".join(parse(write_report(run_dir)).text)
    assert "fp32 / none" in text and "bf16-true / full" in text and "36" in text


def test_cli_report_writes_the_page_and_refuses_an_empty_dir(run_dir, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["report", str(run_dir), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"report": str(out)}
    assert out.stat().st_size > 10_000
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run_dir=" in err[0] and "metrics.jsonl" in err[0]


def test_train_phase_medians_from_metrics_by_hand():
    from trainfit.report.data import train_time_parts

    rows = [{"step": i, "forward_s": f, "backward_s": b, "backward_sync_s": 0.01, "optimizer_s": 0.002,
             "data_wait_s": 0.001, "step_s": s}
            for i, (f, b, s) in enumerate([(9.0, 9.0, 30.0), (0.1, 0.2, 0.4), (0.3, 0.1, 0.5), (0.2, 0.3, 0.6)], 1)]
    t = train_time_parts(rows)  # the first (warm-up) step is left out; medians of the other three
    assert t["forward"] == pytest.approx(0.2) and t["backward"] == pytest.approx(0.21)
    assert t["rest"] == pytest.approx(0.5 - (0.001 + 0.2 + 0.21 + 0.002))


def test_train_report_flag_writes_the_page(tmp_path, tiny_gpt_overrides):
    d = tmp_path / "run"
    assert main(["train", "--model-config", tiny_gpt_overrides, "--seq", "16", "--micro-batch", "2",
                 "--accumulation", "2", "--steps", "3", "--run-dir", str(d), "--report"]) == 0
    page = parse(d / "report.html")
    assert [i["alt"] for i in page.imgs] == ["loss curve", "step time breakdown"]
    assert all(ink_share(decode(i)) > 0.02 for i in page.imgs)


def test_saved_memory_reports_keep_one_entry_per_configuration(tmp_path):
    from trainfit.commands.report import save_and_report

    keys = ("precision", "checkpointing")
    for prec, ckpt, peak in [("fp32", "none", 1), ("bf16-true", "none", 2), ("fp32", "none", 3)]:
        save_and_report(tmp_path, "memory.json", {"precision": prec, "checkpointing": ckpt, "peak_bytes": peak},
                        report=False, keep_others=keys)
    saved = json.loads((tmp_path / "memory.json").read_text())
    # the second fp32/none run replaced the first; bf16-true kept beside it
    assert sorted((d["precision"], d["peak_bytes"]) for d in saved) == [("bf16-true", 2), ("fp32", 3)]
