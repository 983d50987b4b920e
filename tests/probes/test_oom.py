"""An out-of-memory that explains itself: a capped run names the change that fits, and that change does fit."""

import json
import shlex

from tests.reliability.cli_harness import cli, error_lines
from trainfit.probes.oom import Change, rank_changes

BASE = ["train", "--model", "gpt-tiny", "--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "32",
        "--accumulation", "1", "--memory-cap", "1.4MiB", "--checkpoint-every", "0"]


def test_capped_run_names_a_change_and_the_change_fits(tmp_path):
    r = cli([*BASE, "--micro-batch", "8", "--steps", "2", "--run-dir", str(tmp_path / "oom")], cwd=tmp_path)
    assert r.rc == 2, r.err
    lines = [ln for ln in error_lines(r.err) if ln.startswith("trainfit: error:")]
    assert len(lines) == 1  # one paragraph
    msg = lines[0]
    assert "out of memory in " in msg and "activations" in msg and "frees" in msg
    snap = json.loads((tmp_path / "oom" / "oom.json").read_text())
    assert snap["reproduced"] and snap["phase"] in ("forward", "backward", "optimizer")
    assert set(snap["parts"]) == {"params", "grads", "optimizer", "activations", "temporaries"}
    assert sum(snap["parts"].values()) == snap["live_bytes"] > snap["cap_bytes"]  # the replay hit the same cap
    flags = msg.split("global batch kept")[1].split(": ", 1)[1].split(". Snapshot")[0]
    assert flags == " ".join(snap["fits"])
    args = shlex.split(flags)
    # The named change keeps the global batch: micro-batch x accumulation stays 8 x 1.
    if "--micro-batch" in args:
        assert int(args[args.index("--micro-batch") + 1]) * int(args[args.index("--accumulation") + 1]) == 8
    given = dict(zip(BASE[1::2], BASE[2::2]))
    ok = cli(["train", *[x for k, v in given.items() if k not in args for x in (k, v)], *args,
              *([] if "--micro-batch" in args else ["--micro-batch", "8"]), "--steps", "2",
              "--run-dir", str(tmp_path / "fits")], cwd=tmp_path)
    assert ok.rc == 0, ok.err[-1500:]


def test_the_smallest_fitting_change_is_chosen():
    def ch(lever, fits, peak=1):
        return Change(lever=lever, flags=(lever,), peak_bytes=peak, frees_bytes=0, fits=fits)

    changes = [ch("micro-batch / 2", True), ch("checkpointing selective", True), ch("bf16-mixed", True)]
    assert rank_changes(changes).lever == "checkpointing selective"
    assert rank_changes([ch("checkpointing selective", False), ch("micro-batch / 2", True)]).lever == "micro-batch / 2"
    assert rank_changes([ch("micro-batch / 2 + checkpointing full", True), ch("bf16-true", True)]).lever == "bf16-true"
    assert rank_changes([ch("bf16-mixed", False)]) is None


def test_auto_fit_names_what_it_changed(tmp_path):
    base = [x for x in BASE if x not in ("--accumulation", "1")]  # auto-fit chooses the split itself
    r = cli([*base, "--micro-batch", "auto", "--global-batch", "8", "--steps", "2", "--run-dir", str(tmp_path / "a")],
            cwd=tmp_path)
    assert r.rc == 0, r.err[-1500:]
    assert "auto-fit: out of memory in step 2: micro-batch 8 x accumulation 1 -> 4 x 2 (global batch kept)" in r.err
