"""``trainfit profile`` CLI: the --json keys, the picture, the trace, and bad input."""

import json

import pytest
import torch

from trainfit.cli import main
from trainfit.commands.profile import JSON_KEYS
from trainfit.results import ProfileReport

TINY = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16", "--micro-batch", "2",
        "--accumulation", "2"]


def test_json_keys_plot_and_trace(tmp_path, capsys, one_thread):
    png, trace = tmp_path / "p.png", tmp_path / "trace"
    rc = main(["profile", *TINY, "--steps", "3", "--warmup", "1", "--no-batch-probe", "--json",
               "--bandwidth", "1GB/s", "--plot", str(png), "--trace", str(trace)])
    out = capsys.readouterr().out
    assert rc == 0
    r = json.loads(out)  # exactly one JSON object on stdout
    assert set(JSON_KEYS) <= set(r)
    assert JSON_KEYS == ("data_wait_frac", "forward_s", "backward_s", "optimizer_s", "comm_exposed_s", "step_s",
                         "busy_frac", "tokens_per_s", "mfu", "bottleneck", "advice")
    assert r["bottleneck"] in ("input", "batch", "communication", "compute")
    assert isinstance(r["advice"], list) and r["advice"][-1]["kind"] == "scale-out"
    assert r["steps"] == 3 and r["scaling"]["bandwidth_source"].startswith("given")
    assert r["scaling"]["curves"]["zero3"]["points"][1]["n"] == 2 and r["scaling"]["curves"]["zero3"]["source"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = ProfileReport.from_dict(r)  # the printed object is the typed report (plus the plot's path)
    assert report.to_dict() == r and report.extra == {"plot": str(png)} and report.steps == 3
    # the configuration it measured, as given on the command line (the defaults for what was not)
    assert (r["model"], r["precision"], r["accumulation"], r["checkpointing"], report.micro_batch) == \
        ("gpt-tiny", "fp32", 2, "none", 2)
    traces = list(trace.glob("*.json"))
    assert traces and "traceEvents" in traces[0].read_text()[:2000]


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "steps=0"),
    (["--micro-batch", "auto"], "auto"),  # with TINY's --accumulation: refused as contradictory first
    (["--strategy", "ddp"], "process group"),
    (["--bandwidth", "fast"], "--bandwidth='fast'"),
    (["--plot", "out.jpg", "--steps", "1"], "--plot='out.jpg'"),
    (["--model", "nonexistent-model"], "model='nonexistent-model'"),
])
def test_bad_input_is_one_clear_line(flags, message, capsys):
    base = [*TINY, "--warmup", "0", "--bandwidth", "1GB/s"]
    base = [a for i, a in enumerate(base) if base[i - i % 2] not in flags]  # each flag once (issue 35, row 12)
    rc = main(["profile", *base, "--no-batch-probe", *flags])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_is_refused(capsys):
    assert main(["profile", *TINY, "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
