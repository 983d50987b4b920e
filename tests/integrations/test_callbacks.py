"""The Trainer and Lightning callbacks: measured parts of one step vs ``trainfit memory --measure`` of the same
model, batch, precision (fp32) and accumulation; the files they write; bad construction arguments."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings

import pytest
import torch

from trainfit.cli import main as cli
from trainfit.errors import ConfigError
from trainfit.report.html import PAGE_START

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning")

T, B, VOCAB, STEPS = 32, 2, 512, 3
PARTS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny GPT-2 written with save_pretrained, and trainfit's own measurement of it."""
    d = tmp_path_factory.mktemp("cb") / "model"
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli(["memory", "--measure", "--model", f"hf:{d}", "--batch", str(B), "--seq-len", str(T),
                  "--precision", "fp32", "--optimizer", "adamw", "--json"])
    assert rc == 0
    return d, json.loads(out.getvalue())


def load_model(d):
    m = transformers.GPT2LMHeadModel.from_pretrained(d)
    return m.train()  # from_pretrained returns eval mode; trainfit trains with dropout on


def check_parts(mem: dict, ref: dict) -> None:
    for k in PARTS:
        assert ref[k] > 0
        assert abs(mem[k] - ref[k]) <= 0.03 * ref[k], (k, mem[k], ref[k])


def check_files(out, n_steps: int, measured: int) -> list[dict]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, n_steps + 1))
    assert [r.get("measured", False) for r in lines] == [i + 1 == measured for i in range(n_steps)]
    for r in lines:
        assert r["count"] == B * T and r["stepped"] and r["skipped_steps"] == 0
        assert r["step_s"] >= r["forward_s"] > 0 and r["backward_s"] > 0 and r["optimizer_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(B * T / r["step_s"])
    assert all("mfu" not in r for r in lines[: measured - 1]) and all(0 < r["mfu"] < 1 for r in lines[measured - 1:])
    mem = json.loads((out / "memory.json").read_text())
    assert mem["batch"] == B and mem["seq_len"] == T and mem["accumulation"] == 1
    assert (out / "report.html").read_text().startswith(PAGE_START)
    return lines


def test_hf_trainer_callback_matches_trainfit_memory(saved, tmp_path):
    from trainfit.integrations.hf_callback import TrainfitCallback
    d, ref = saved
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), per_device_train_batch_size=B, max_steps=STEPS, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=load_model(d), args=args, train_dataset=Rows(),
                                   callbacks=[TrainfitCallback(measure_step=1)])
    trainer.train()
    lines = check_files(tmp_path / "hf", STEPS, measured=2)
    check_parts(json.loads((tmp_path / "hf" / "memory.json").read_text()), ref)
    logged = [h for h in trainer.state.log_history if "loss" in h]  # the Trainer's own log: loss per step
    # GPT-2 (loss_type=None): the Trainer divides the loss sum by all T labels of a row, T - 1 are predicted;
    # metrics.jsonl holds trainfit's token mean (sum over the predicted tokens / their count)
    assert [r["loss"] for r in lines] == pytest.approx([h["loss"] * T / (T - 1) for h in logged], rel=1e-6)


class Module(L.LightningModule):
    def __init__(self, d):
        super().__init__()
        self.model = load_model(d)

    def training_step(self, batch, i):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_callback_matches_trainfit_memory(saved, tmp_path):
    from trainfit.integrations.lightning_callback import TrainfitCallback
    d, ref = saved
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    cb = TrainfitCallback(measure_step=1, output_dir=str(tmp_path / "pl"))
    L.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
              callbacks=[cb]).fit(Module(d), torch.utils.data.DataLoader(Rows(), batch_size=B))
    check_files(tmp_path / "pl", STEPS, measured=2)
    check_parts(json.loads((tmp_path / "pl" / "memory.json").read_text()), ref)
    assert cb.report_path == tmp_path / "pl" / "report.html"


@pytest.mark.parametrize("kw, field", [({"measure_step": 0}, "measure_step"), ({"measure_step": 1.5}, "measure_step"),
                                       ({"measure_step": True}, "measure_step"), ({"output_dir": ""}, "output_dir")])
def test_bad_arguments_refused_at_construction(kw, field, tmp_path):
    from trainfit.integrations.hf_callback import TrainfitCallback as HF
    from trainfit.integrations.lightning_callback import TrainfitCallback as PL
    for cls in (HF, PL):
        with pytest.raises(ConfigError) as e:
            cls(**kw)
        assert e.value.field == field
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError):
        HF(output_dir=str(f))
    assert f.read_text() == "x"


def test_fp16_skipped_steps_and_loss_scale_from_a_real_grad_scaler(tmp_path):
    """The meter's skipped count and loss scale vs what torch's GradScaler did (the weights did not move)."""
    from trainfit.integrations.measure import MeasureOptions, StepMeter
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    meter = StepMeter(MeasureOptions(measure_step=99), tool="loop")
    meter.open(tmp_path)
    moved = []
    for i, poison in enumerate([1.0, float("inf"), 1.0]):
        before = model.weight.detach().clone()
        meter.step_begin(i, model, opt)
        x = torch.randn(2, 4)
        meter.micro_batch(x)
        loss = model(x).sum() * poison
        scaler.scale(loss).backward()
        meter.optimizer_begin(scaler)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        meter.step_end(i + 1, scaler=scaler, loss=loss.detach())
        moved.append(not torch.equal(before, model.weight))
    meter.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert moved == [True, False, True]
    assert [r["stepped"] for r in lines] == moved
    assert [r["skipped_steps"] for r in lines] == [0, 1, 1]
    assert [r["loss_scale"] for r in lines] == [1024.0, 512.0, 512.0]  # GradScaler halves on overflow (backoff 0.5)
    assert (tmp_path / "report.html").exists() and not (tmp_path / "memory.json").exists()
