"""trainfit verify: passes correct levers, fails planted bugs with a message naming the cause.

The bugs are planted from outside the library (a subclass swapped in with monkeypatch),
so the library has no test-only branches.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import trainfit.engine as engine
import trainfit.levers.precision.base as precision_base
from trainfit.cli import main
from trainfit.config import make_config
from trainfit.errors import ConfigError
from trainfit.levers.accumulation import AccumulationWindow
from trainfit.levers.scaler import DynamicLossScaler, Phase
from trainfit.probes.verify import (
    VerifyReport,
    cosine,
    fp16_underflow_fraction,
    rel_error,
    update_rel_error,
    verify,
)
from trainfit.results import VerifyReport as TypedVerifyReport

TINY = "n_layer=2,d_model=32,n_head=2"


def cfg(**kw):
    base = dict(model_config=TINY, seq_len=32, micro_batch=4, accumulation=3, precision="fp32")
    base.update(kw)
    return make_config(base)


class MeanOfMeansWindow(AccumulationWindow):
    """Planted bug: each micro-batch normalised by its own token count, then averaged."""

    def __init__(self, micro_batches, count, **kw):
        super().__init__(micro_batches, count, **kw)
        self._count = count

    def __iter__(self):
        n = len(self.micro_batches)
        for mb, is_last in super().__iter__():
            self.weight = 1.0 / (n * max(self._count(mb), 1))  # read by the engine after the yield
            yield mb, is_last


class NeverUnscaled(DynamicLossScaler):
    """Planted bug: checks for overflow but never divides the gradients by the scale."""

    def unscale_(self, grads, all_reduce_max=None):
        grads = [g for g in grads if g is not None]
        self._found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        self.phase = Phase.UNSCALED
        return not self._found_inf


# ------------------------------------------------------------------ pure helpers vs hand values

def test_metrics_against_hand_values():
    a, b = torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([4.0, 3.0], dtype=torch.float64)
    assert cosine(a, b) == pytest.approx(24 / 25)
    assert rel_error(a, b) == pytest.approx(math.sqrt(2) / 5)
    assert update_rel_error([torch.tensor([1.0, 0.0]), torch.tensor([2.0])],
                            [torch.tensor([1.0, 0.0]), torch.tensor([1.0])]) == pytest.approx(1.0)
    # 1e-9 and -2e-8 round to zero in fp16 (below 2**-25 ~ 2.98e-8); 1e-7 and 0.5 do not; exact zeros are not counted.
    g = [torch.tensor([1e-9, -2e-8, 1e-7, 0.5, 0.0])]
    assert fp16_underflow_fraction(g) == pytest.approx(2 / 4)


# ------------------------------------------------------------------ correct configurations pass

@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"])
def test_correct_levers_pass(precision):
    r = verify(cfg(precision=precision))
    assert r.passed, r.causes
    assert r.skipped_steps == 0 and r.global_batch == 12
    assert r.grad_norm_ratio == pytest.approx(1.0, rel=0.02)
    if precision == "fp32":
        assert r.grad_rel_error < 1e-5 and r.update_max_rel_error < 1e-3
    assert 0.0 <= r.fp16_underflow_frac < 1.0


def test_report_is_the_typed_result_and_reads_back_from_its_json():
    assert VerifyReport is TypedVerifyReport  # still importable from trainfit.probes.verify
    r = verify(cfg(precision="bf16-mixed", accumulation=2))
    assert isinstance(r, TypedVerifyReport) and isinstance(r.causes, tuple)
    assert VerifyReport.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_checkpointing_sgd_no_accumulation_pass():
    assert verify(cfg(checkpointing="full", optimizer="sgd", accumulation=1, micro_batch=8)).passed
    r = verify(cfg(checkpointing="every:2", grad_clip=0.0))
    assert r.passed and r.update_max_rel_error < 1e-3


def test_warmup_and_decay_groups_pass():
    """The run's first step uses the warm-up's lr and the standard no-decay groups; so must the reference."""
    r = verify(cfg(warmup_steps=4, schedule="cosine", weight_decay=0.5, lr=0.05))
    assert r.passed, r.causes
    assert r.update_max_rel_error < 1e-3


# ------------------------------------------------------------------ planted bugs fail, naming the cause

@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_mean_of_means_is_caught(monkeypatch, precision):
    monkeypatch.setattr(engine, "AccumulationWindow", MeanOfMeansWindow)
    r = verify(cfg(precision=precision))
    assert not r.passed
    assert "mis-normalised accumulation" in r.causes[0] and "mean of per-micro-batch means" in r.causes[0]


@pytest.mark.parametrize("precision", ["fp16-mixed", "fp16-true"])
def test_scaler_never_unscaled_is_caught(monkeypatch, precision):
    monkeypatch.setattr(precision_base, "DynamicLossScaler", NeverUnscaled)  # every policy builds its scaler there
    r = verify(cfg(precision=precision))
    assert not r.passed
    assert r.grad_norm_ratio == pytest.approx(2.0**16, rel=0.01)
    assert "never unscaled" in r.causes[0]


def test_cnn_passes_without_accumulation_and_batchnorm_with_it_is_named():
    assert verify(make_config(dict(model="cnn", model_config="channels=4", micro_batch=8, accumulation=1))).passed
    r = verify(make_config(dict(model="cnn", model_config="channels=4", micro_batch=4, accumulation=2)))
    assert not r.passed and "BatchNorm" in r.causes[0]


def test_auto_micro_batch_refused():
    with pytest.raises(ConfigError, match="micro_batch"):
        verify(cfg(micro_batch="auto"))


# ------------------------------------------------------------------ CLI

KEYS = {"precision", "strategy", "micro_batch", "accumulation", "world_size", "global_batch", "grad_cosine",
        "grad_rel_error", "grad_norm_ratio", "update_max_rel_error", "skipped_steps", "fp16_underflow_frac",
        "loss_scale", "tolerance", "passed", "causes", "checkpointing"}


def test_cli_json_and_exit_codes(capsys, monkeypatch, tmp_path):
    args = ["verify", "--model-config", TINY, "--seq", "32", "--micro-batch", "2", "--accumulation", "2"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == KEYS and out["passed"] is True
    report = VerifyReport.from_dict(out)  # the printed object is the typed report, read back unchanged
    assert report.to_dict() == out and report.extra == {} and report.passed
    toml = tmp_path / "c.toml"
    toml.write_text(f'model_config = "{TINY}"\nseq_len = 32\nmicro_batch = 2\naccumulation = 2\n')
    monkeypatch.setattr(engine, "AccumulationWindow", MeanOfMeansWindow)
    assert main(["verify", str(toml)]) == 1
    assert "FAIL: mis-normalised accumulation" in capsys.readouterr().out
