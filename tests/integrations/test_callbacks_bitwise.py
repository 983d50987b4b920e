"""The callbacks change nothing, for every model family (issue 35, row 16): a HF Trainer or Lightning run with
trainfit's callback ends with the same weights, bit for bit, as the same run without it.

The cause found: the measured step ran under torch's ``FlopCounterMode``, which runs an op it has no formula for
as that op's *decomposition* (``silu_backward`` as sigmoid, mul, add ...): other float roundings. GPT-2 (gelu,
built from elementary ops) stayed bitwise; every SiLU model (Llama, Mistral, Qwen) moved by up to ~1e-8. The
references here are plain runs without the callback (the twin), and plain PyTorch gradients without any mode.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
L = pytest.importorskip("lightning")

T, B, K, STEPS, VOCAB, LR = 16, 2, 2, 3, 64, 1e-3


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=T)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=T,
                                  bos_token_id=0, eos_token_id=0)  # dropout 0.1: any RNG draw would show
    return transformers.GPT2LMHeadModel(cfg)


def _qwen2():
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=T)
    return transformers.Qwen2ForCausalLM(cfg)


FAMILIES = {"llama": _llama, "gpt2": _gpt2, "qwen2": _qwen2}


def _model(family: str):
    torch.manual_seed(0)
    return FAMILIES[family]().train()


def _rows(n=16):
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (T,), generator=g)
        labels = ids.clone()
        labels[: i % 3] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _hf_run(tmp_path, family: str, callbacks):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=B, gradient_accumulation_steps=K, max_steps=STEPS,
        learning_rate=LR, max_grad_norm=0.0, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0)
    warnings.simplefilter("ignore")
    trainer = transformers.Trainer(model=_model(family), args=args, train_dataset=_rows(), callbacks=callbacks)
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train()
    return trainer.model


def _assert_bitwise(with_cb, twin) -> None:
    pairs = list(zip(with_cb.named_parameters(), twin.parameters(), strict=True))
    moved = [(name, float((p - q).abs().max())) for (name, p), q in pairs if not torch.equal(p, q)]
    assert not moved, f"{len(moved)} of {len(pairs)} parameters differ, e.g. {moved[:3]}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_trainer_with_and_without_the_callback_ends_with_bitwise_equal_weights(tmp_path, family):
    from trainfit.integrations.hf_callback import TrainfitCallback

    with_cb = _hf_run(tmp_path / "a", family, [TrainfitCallback(measure_step=1)])
    twin = _hf_run(tmp_path / "b", family, [])
    assert (tmp_path / "a" / "memory.json").is_file()  # the step was measured
    _assert_bitwise(with_cb, twin)


class Module(L.LightningModule):
    def __init__(self, family: str):
        super().__init__()
        self.model = _model(family)

    def training_step(self, batch, i):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _fit(tmp_path, family: str, callbacks):
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    module = Module(family)
    L.Trainer(max_steps=STEPS, accumulate_grad_batches=K, accelerator="cpu", logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=str(tmp_path), callbacks=callbacks).fit(
        module, torch.utils.data.DataLoader(_rows(), batch_size=B))
    return module


def test_lightning_with_and_without_the_callback_ends_with_bitwise_equal_llama_weights(tmp_path):
    from trainfit.integrations.lightning_callback import TrainfitCallback

    with_cb = _fit(tmp_path, "llama", [TrainfitCallback(measure_step=1, output_dir=str(tmp_path / "pl"))])
    twin = _fit(tmp_path, "llama", [])
    assert (tmp_path / "pl" / "memory.json").is_file()
    _assert_bitwise(with_cb, twin)


ACTIVATIONS = (torch.nn.SiLU, torch.nn.GELU, torch.nn.Mish, torch.nn.Hardswish, torch.nn.ELU, torch.nn.Softplus,
               torch.nn.Hardsigmoid, torch.nn.SELU, torch.nn.LeakyReLU, torch.nn.Tanh, torch.nn.Sigmoid,
               torch.nn.LogSigmoid, torch.nn.GLU)


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: a.__name__)
def test_the_flop_counter_runs_every_activation_as_it_is(act):
    """The class: any op whose backward torch could decompose. Gradients under the counter equal plain PyTorch's
    bitwise, and the FLOPs equal torch's FlopCounterMode (its count, not its arithmetic, is the reference)."""
    from trainfit.integrations.measure import WatchingFlopCounter

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 48), act(), torch.nn.Linear(48 // (2 if act is torch.nn.GLU
                                                                                      else 1), 8))
    x = torch.randn(5, 24) * 3

    def grads(mode=None):
        net.zero_grad()
        if mode is None:
            net(x).square().sum().backward()
        else:
            with mode:
                net(x).square().sum().backward()
        return [p.grad.clone() for p in net.parameters()]

    plain = grads()
    counter = WatchingFlopCounter()
    watched = grads(counter)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))
    reference = torch.utils.flop_counter.FlopCounterMode(display=False)
    grads(reference)
    first, second = 2 * 5 * 24 * 48, 2 * 5 * (48 // (2 if act is torch.nn.GLU else 1)) * 8  # matmuls by hand
    # forward both; backward: the second's input and weight gradients, the first's weight gradient (x needs none)
    assert counter.get_total_flops() == reference.get_total_flops() == 2 * first + 3 * second
