"""The callbacks log the truth and change nothing (issue 28, rows 5-8).

References: the loss recomputed by hand (plain ``F.cross_entropy`` over the logits the model returned, summed
over the window's label tokens and divided by their count), the Trainer's own per-step log of a twin run
without the callback (``logging_steps=1``), the linear schedule by hand, and the twin's final weights (bitwise:
dropout is on, so any draw from the global RNG would change them).
"""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from torch.nn import functional as F

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning")

T, B, K, STEPS, VOCAB, LR = 16, 2, 2, 3, 64, 1e-3


def _model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=T,
                                  bos_token_id=0, eos_token_id=0)  # dropout 0.1: the RNG matters
    return transformers.GPT2LMHeadModel(cfg).train()


def _rows(n=32):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (T,), generator=g)
        labels = ids.clone()
        labels[: i % 5] = -100  # micro-batches with different numbers of loss tokens: a mean of means differs
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _trainer(tmp_path, name, callbacks, **kw):
    kw = dict(dict(per_device_train_batch_size=B, gradient_accumulation_steps=K, max_steps=STEPS, learning_rate=LR,
                   max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                   dataloader_num_workers=0, seed=0), **kw)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), **kw)
    warnings.simplefilter("ignore")
    return transformers.Trainer(model=_model(), args=args, train_dataset=_rows(), callbacks=callbacks)


def test_hf_callback_logs_every_steps_window_loss_lr_and_norm_and_changes_nothing(tmp_path):
    from trainfit.integrations.hf_callback import TrainfitCallback

    with_cb = _trainer(tmp_path, "a", [TrainfitCallback(measure_step=1)])  # logging_steps: the default 500
    seen = []  # (logits, labels) of every micro-batch, in order
    with_cb.model.register_forward_hook(lambda m, a, kw, out: seen.append((out.logits.detach(), kw["labels"])),
                                        with_kwargs=True)
    with_cb.train()
    twin = _trainer(tmp_path, "b", [], logging_steps=1)
    twin.train()
    lines = _lines(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3]
    for i, r in enumerate(lines):
        window = seen[i * K:(i + 1) * K]
        total = sum(F.cross_entropy(lg[:, :-1].reshape(-1, VOCAB).double(), lb[:, 1:].reshape(-1),
                                    reduction="sum") for lg, lb in window)
        count = sum(int(lb[:, 1:].ne(-100).sum()) for lg, lb in window)
        assert r["loss"] == pytest.approx(float(total / count), rel=1e-6)  # the window's token mean
        assert r["lr"] == pytest.approx(LR * (1 - i / STEPS), rel=1e-12)  # linear decay: the rate step i used
    logged = [h for h in twin.state.log_history if "loss" in h]  # the Trainer's own log, step by step
    assert [r["grad_norm"] for r in lines] == pytest.approx([h["grad_norm"] for h in logged], rel=1e-5)
    for p, q in zip(with_cb.model.parameters(), twin.model.parameters(), strict=True):
        assert torch.equal(p, q)  # bitwise: the callback (its CPU calibration included) changed nothing
    mem = json.loads((tmp_path / "a" / "memory.json").read_text())
    assert mem["optimizer"] == "adamw" and mem["strategy"] == "single" and mem["world_size"] == 1
    assert mem["details"]["tool"] == f"transformers.Trainer {transformers.__version__}"
    assert f"measured inside transformers.Trainer {transformers.__version__}" in \
        (tmp_path / "a" / "report.html").read_text()  # the report names the tool and its version


def test_hf_callback_resume_appends_and_measures_again_with_checkpointing_detected(tmp_path):
    from trainfit.integrations.hf_callback import TrainfitCallback

    first = _trainer(tmp_path, "r", [TrainfitCallback(measure_step=1)], save_strategy="steps", save_steps=2,
                     max_steps=2)
    first.train()
    before = json.loads((tmp_path / "r" / "memory.json").read_text())
    assert before["checkpointing"] == "none" and before["details"]["measured_step"] == 2
    again = _trainer(tmp_path, "r", [TrainfitCallback(measure_step=1)], gradient_checkpointing=True)
    again.train(resume_from_checkpoint=str(tmp_path / "r" / "checkpoint-2"))
    assert [r["step"] for r in _lines(tmp_path / "r" / "metrics.jsonl")] == [1, 2, 3]
    mem = json.loads((tmp_path / "r" / "memory.json").read_text())
    assert mem["details"]["measured_step"] == 3 and mem["checkpointing"] == "full"  # this run's, as it ran


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = _model()
        self.losses = []

    def training_step(self, batch, i):
        loss = self.model(**batch).loss
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _fit(tmp_path, callbacks):
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    module = Module()
    torch.manual_seed(0)
    rows = [{k: v for k, v in r.items()} for r in _rows()]
    for r in rows:
        r["labels"] = r["input_ids"].clone()  # equal loss tokens per micro-batch: trainfit's mean is the mean

    def collate(items):  # what transformers' collators return: a BatchEncoding (a UserDict, not a dict)
        return transformers.BatchEncoding({k: torch.stack([x[k] for x in items]) for k in items[0]})

    L.Trainer(max_steps=STEPS, accumulate_grad_batches=K, accelerator="cpu", logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=str(tmp_path), callbacks=callbacks).fit(
        module, torch.utils.data.DataLoader(rows, batch_size=B, collate_fn=collate))
    return module


def test_lightning_callback_loss_not_divided_tokens_counted_and_nothing_changed(tmp_path):
    from trainfit.integrations.lightning_callback import TrainfitCallback

    with_cb = _fit(tmp_path, [TrainfitCallback(measure_step=1, output_dir=str(tmp_path / "pl"))])
    twin = _fit(tmp_path, [])
    lines = _lines(tmp_path / "pl" / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3]
    for i, r in enumerate(lines):
        assert r["loss"] == pytest.approx(sum(with_cb.losses[i * K:(i + 1) * K]) / K, rel=1e-6)
        assert r["count"] == K * B * T and r["tokens_per_s"] > 0
        assert r["grad_norm"] > 0
    assert 0 < lines[-1]["mfu"] < 1
    assert with_cb.losses == twin.losses  # bitwise, every micro-batch
    for p, q in zip(with_cb.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    mem = json.loads((tmp_path / "pl" / "memory.json").read_text())
    assert mem["details"]["tool"] == f"lightning {L.__version__}" and mem["optimizer"] == "adamw"
    assert f"measured inside lightning {L.__version__}" in (tmp_path / "pl" / "report.html").read_text()
