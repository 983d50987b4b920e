"""``trainfit memory``: pinned JSON keys, the plot, the table's lever line, one-line errors."""

import json
from pathlib import Path

import pytest

from trainfit.cli import main
from trainfit.commands.memory import JSON_KEYS

TINY = ["--model", "gpt-tiny", "--model-config", "n_layer=2,d_model=32,n_head=2", "--seq", "16", "--batch", "2",
        "--accumulation", "1"]


def _run(capsys, *args):
    rc = main(["memory", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_has_the_pinned_keys_and_budget(capsys, tmp_path):
    plot = tmp_path / "m.png"
    rc, out, err = _run(capsys, *TINY, "--estimate", "--json", "--budget", "64MiB", "--plot", str(plot))
    assert rc == 0, err
    d = json.loads(out)
    assert set(JSON_KEYS) | {"max_micro_batch"} <= set(d)
    assert d["peak_phase"] in ("forward", "backward", "optimizer")
    assert d["activations_per_sample_bytes"] > 0
    # Independent check of the budget answer: the peak at max_micro_batch fits, one more does not.
    s = d["scaling"]
    peak = lambda b: max(a + per * b for a, per in s["phase_fits"].values())  # noqa: E731
    assert peak(d["max_micro_batch"]) <= 64 * 2**20 < peak(d["max_micro_batch"] + 1)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_table_names_the_dominant_part_and_its_lever(capsys):
    rc, out, _ = _run(capsys, *TINY, "--measure", "--precision", "bf16-mixed")
    assert rc == 0
    assert "largest part at the peak:" in out and "lever:" in out
    assert "NOT halved" in out


@pytest.mark.parametrize("args, needle", [
    (["--model", "gpt-huge"], "model='gpt-huge' is not valid; allowed: one of: gpt-tiny"),
    (["--model", "no_such_module_xyz:make"], "cannot import module 'no_such_module_xyz'"),
    (["--model", "trainfit_linear_stack:not_a_task"], "returned int; it must return a trainfit Task"),
    (["--model", "trainfit_linear_stack:missing"], "has no attribute 'missing'"),
    (["--model", "trainfit_linear_stack:broken"], "calling it raised RuntimeError: the user's factory failed"),
    (["--model", "trainfit_linear_stack:bad_loss"], "loss(model, batch) must return (loss_sum tensor, count)"),
    (TINY + ["--budget", "100KiB"], "not even micro-batch 1 fits"),
    (TINY + ["--budget", "lots"], "budget='lots' is not valid"),
])
def test_bad_input_is_one_line(capsys, monkeypatch, args, needle):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    split = [] if "--batch" in args else ["--batch", "2", "--accumulation", "1"]  # each flag once (issue 35)
    rc, out, err = _run(capsys, "--estimate", *split, *args)
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err
