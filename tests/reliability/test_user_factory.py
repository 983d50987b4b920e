"""``module:callable``: imported only when the model spec names it; and the overflow storm
injected through it into the real CLI (``trainfit.cli.main`` in this process; nothing of trainfit patched)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trainfit.cli import main as cli_main

from .conftest import TINY_FLAGS, error_lines

MODULE = '''
import pathlib, torch
from torch.nn import functional as F
pathlib.Path(__file__).with_name("imported").write_text("yes")  # the side effect we watch for

def make(seq_len=16, seed=0):
    net = torch.nn.Linear(4, 2)
    return {"model": net, "batch": lambda n: {"x": torch.randn(n, 4), "y": torch.randint(0, 2, (n,))},
            "loss": lambda m, b: (F.cross_entropy(m(b["x"]), b["y"], reduction="sum"), len(b["y"]))}
'''


def test_model_factory_is_imported_only_when_named(tmp_path, monkeypatch, capsys):
    name = "tf_reliability_probe"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "imported"
    cfg = tmp_path / "c.toml"
    # Mentioned everywhere except as the model: never imported.
    cfg.write_text(f'run_dir = "{tmp_path}/{name}:make"\n')
    assert cli_main(["train", str(cfg), *TINY_FLAGS, "--steps", "1"]) == 0
    no_model_config = [f for i, f in enumerate(TINY_FLAGS) if "--model-config" not in (f, TINY_FLAGS[i - 1])]
    assert cli_main(["train", *no_model_config, "--steps", "1", "--run-dir", str(tmp_path / "x"),
                     "--model-config", f"{name}:make"]) == 2  # an invalid model_config, not an import
    assert not marker.exists() and name not in sys.modules
    # Named: imported, and trained.
    assert cli_main(["train", "--model", f"{name}:make", "--steps", "2", "--run-dir", str(tmp_path / "y")]) == 0
    assert marker.exists() and name in sys.modules
    sys.modules.pop(name, None)


@pytest.mark.timeout(180)
def test_overflow_storm_through_a_user_factory_on_the_cli(tmp_path, monkeypatch, trainfit_cli):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # tests/: `reliability.faults` by name
    r = trainfit_cli("train", "--model", "reliability.faults:fp16_storm", "--model-config",
                     "n_layer=1,d_model=32,n_head=2", "--seq", "16", "--micro-batch", "2", "--accumulation", "2",
                     "--precision", "fp16-mixed", "--steps", "9", "--checkpoint-every", "1",
                     "--run-dir", tmp_path / "run", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["skipped_steps"] == 5 and "Traceback" not in r.stderr
    assert not [ln for ln in error_lines(r.stderr) if ln.startswith("trainfit: error")]
