"""``--quiet`` silences every bar and progress line, in every command and every rank (issue 35, row 14).

stderr is a terminal here (a stream whose ``isatty`` says yes), so every bar that may draw does: each command is
run once without ``--quiet`` (the reference: it says something -- progress lines, a bar -- so the capture sees
them) and once with it, where stderr must hold nothing but warnings. The old defect: ``train --data FILE``'s
tokenizing bar ignored the switch (and ``train --devices 2`` drew it once per rank).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainfit.cli import main

TINY = ["--model-config", "n_layer=1,d_model=16,n_head=2", "--seq", "8"]
RUN = ["--micro-batch", "2", "--accumulation", "1"]


class Terminal(io.StringIO):
    """stderr as a terminal: bars draw (tqdm, and ``prepare``'s bar, which draws only on a terminal)."""

    def isatty(self) -> bool:
        return True


def _write_corpus(path: Path, seed: int) -> Path:
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "the", "dog", "ran", "far", "away"]
    path.write_text("\n\n".join(" ".join(words[(i * 7 + j * seed) % len(words)] for j in range(40))
                                 for i in range(30)))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Two text files of different content: a run with --quiet tokenizes its own (a file already tokenized is
    read from the cache, with no bar to silence)."""
    root = tmp_path_factory.mktemp("quiet")
    _write_corpus(root / "corpus-loud.txt", 1)
    _write_corpus(root / "corpus-quiet.txt", 5)
    return root


def _run(argv: list[str], monkeypatch, cwd: Path) -> tuple[int, str]:
    err, out = Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.chdir(cwd)
    rc = main(argv)
    return rc, err.getvalue()


def _said(err: str) -> list[str]:
    """What stderr holds besides warnings: progress lines and bar frames (a bar redraws with carriage returns)."""
    return [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("trainfit: warning:")]


COMMANDS = {
    "train": lambda d: ["train", *TINY, *RUN, "--steps", "2", "--checkpoint-every", "0", "--data",
                        str(d / "corpus-{q}.txt"), "--run-dir", str(d / "run-{q}")],
    "prepare": lambda d: ["prepare", "--data", str(d / "corpus-{q}.txt"), "--out", str(d / "tokens-{q}")],
    "memory": lambda d: ["memory", *TINY, "--batch", "2", "--accumulation", "1"],
    "plan": lambda d: ["plan", "--global-batch", "8", "--device-memory", "80GiB", "--basis", "analytic",
                       "--precisions", "bf16"],
    "profile": lambda d: ["profile", *TINY, *RUN, "--steps", "2", "--warmup", "1", "--no-batch-probe",
                          "--no-precision-probe", "--bandwidth", "1GB/s"],
    "verify": lambda d: ["verify", *TINY, "--micro-batch", "2", "--accumulation", "2"],
    "verify --framework": lambda d: ["verify", "--framework", "accelerate", *TINY, "--micro-batch", "2",
                                     "--accumulation", "2"],
}
SILENT_ANYWAY = {"verify"}
"""Commands that say nothing on stderr even without --quiet (a single check: no progress to report)."""


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_quiet_leaves_nothing_but_warnings_on_stderr(name, corpus, monkeypatch):
    argv = [*COMMANDS[name](corpus), "--json"]  # the answer on stdout: stderr is for progress and warnings
    rc, err = _run([a.format(q="loud") for a in argv], monkeypatch, corpus)
    assert rc in (0, 1), err  # verify --framework's default loss fails its check (exit 1), by design
    if name not in SILENT_ANYWAY:
        assert _said(err), f"{name} says nothing even without --quiet: the test would prove nothing"
    rc_quiet, err = _run(["--quiet", *(a.format(q="quiet") for a in argv)], monkeypatch, corpus)
    assert rc_quiet == rc and _said(err) == [], err


def test_the_tokenizing_bar_draws_without_quiet_and_not_with_it(tmp_path, monkeypatch):
    """The bar the issue saw (``train --data FILE``): there by default, gone with --quiet."""
    argv = ["train", *TINY, *RUN, "--steps", "1", "--checkpoint-every", "0", "--json"]
    loud, quiet = _write_corpus(tmp_path / "a.txt", 3), _write_corpus(tmp_path / "b.txt", 7)
    _, err = _run([*argv, "--data", str(loud), "--run-dir", str(tmp_path / "loud")], monkeypatch, tmp_path)
    assert f"tokenizing {loud}" in err
    _, err = _run([*argv, "--data", str(quiet), "--run-dir", str(tmp_path / "quiet"), "--quiet"], monkeypatch,
                  tmp_path)
    assert "tokenizing" not in err and _said(err) == [], err


def test_prepare_without_json_says_its_answer_on_stdout_and_nothing_on_stderr_when_quiet(tmp_path, monkeypatch):
    data = _write_corpus(tmp_path / "c.txt", 11)
    rc, err = _run(["prepare", "--data", str(data), "--out", str(tmp_path / "loud")], monkeypatch, tmp_path)
    assert rc == 0 and f"trainfit: train on it with: trainfit train --data {tmp_path / 'loud'}" in err
    out = io.StringIO()
    err_stream = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err_stream)
    assert main(["prepare", "--quiet", "--data", str(data), "--out", str(tmp_path / "quiet")]) == 0
    assert err_stream.getvalue() == "" and out.getvalue().startswith(f"prepared {tmp_path / 'quiet'}: ")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.cli
def test_quiet_reaches_every_rank_of_train_devices_2(corpus):
    argv = [sys.executable, "-m", "trainfit", "train", "--quiet", "--json", "--devices", "2", "--strategy", "ddp",
            *TINY, *RUN,
            "--steps", "2", "--checkpoint-every", "0", "--data", str(corpus / "corpus-quiet.txt"), "--run-dir",
            str(corpus / "run-ranks")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=corpus, check=False)
    assert r.returncode == 0, r.stderr
    assert _said(r.stderr) == [], r.stderr
    assert json.loads(r.stdout)["steps"] == 2


def test_the_one_switch_follows_the_level_and_the_rank(monkeypatch):
    """``progress.bars_enabled`` -- what every bar asks -- says no under --quiet's level and on ranks other than 0
    (torchrun's ``RANK``), yes on rank 0 and outside torchrun."""
    import logging

    from trainfit.progress import QUIET, bars_enabled

    monkeypatch.delenv("RANK", raising=False)
    assert bars_enabled()
    for rank, drawn in (("0", True), ("1", False), ("7", False)):
        monkeypatch.setenv("RANK", rank)
        assert bars_enabled() is drawn, rank
    monkeypatch.setenv("RANK", "0")
    root = logging.getLogger("trainfit")
    monkeypatch.setattr(root, "level", QUIET)
    assert not bars_enabled()
