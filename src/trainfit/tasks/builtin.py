"""The built-in tasks: the GPT on generated token rules, the CNN on generated images."""

from __future__ import annotations

import dataclasses

import torch
from torch.nn import functional as F

from trainfit.errors import ConfigError
from trainfit.gate import parse_scalar
from trainfit.presets import GPT_PRESETS, CNNConfig, GPTConfig
from trainfit.tasks.base import GenericTask
from trainfit.tasks.cnn import SmallCNN
from trainfit.tasks.files import load_text_data, note
from trainfit.tasks.spec import DataSpec, check_model_fits
from trainfit.tasks.gpt import GPT
from trainfit.tasks.synthetic import (
    IGNORE_INDEX,
    TemplateImages,
    TokenRules,
    check_token_rules,
    collate_images,
    collate_tokens,
)

BUILTIN_MODELS = (*GPT_PRESETS, "cnn")


def parse_overrides(text: str) -> dict[str, object]:
    """``key=value,key=value`` -> dict with ints/floats/bools parsed (:func:`trainfit.gate.parse_scalar`)."""
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ConfigError("model_config", part, "key=value pairs separated by commas")
        k, v = (s.strip() for s in part.split("=", 1))
        out[k] = parse_scalar(f"model_config.{k}", v)  # the one parser: ASCII numbers only, bounded
    return out


def _known_keys(ov: dict[str, object], config_class) -> dict[str, object]:
    """``ov`` when every key is a field of ``config_class``; else the error listing the fields."""
    fields = sorted(f.name for f in dataclasses.fields(config_class))
    for k in ov:
        if k not in fields:
            raise ConfigError("model_config", k, fields, f"not a field of {config_class.__name__}")
    return ov


def gpt_loss(model, batch):
    logits = model(batch["input_ids"])  # (B, T, V)
    labels = batch["labels"]
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (labels != IGNORE_INDEX).sum()


def gpt_count(batch) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())


def full_length_tokens(n: int, seq_len: int, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """n sequences of exactly seq_len tokens (the worst case for memory), every label counted."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(1, vocab_size, (n, seq_len + 1), generator=g)
    return {"input_ids": seq[:, :-1], "labels": seq[:, 1:]}


def gpt_task(name: str, *, seq_len: int, seed: int, dataset_size: int, overrides: str = "",
             data: DataSpec | None = None) -> GenericTask:
    base = GPT_PRESETS[name]
    ov = _known_keys(parse_overrides(overrides), GPTConfig)
    text = load_text_data(data) if data is not None else None
    if text is not None and "vocab_size" not in ov:  # the tokenizer sets the vocabulary the user left open
        ov["vocab_size"] = text.vocab_size
        note(f"{name} vocab_size={text.vocab_size} from tokenizer {text.tokenizer_dir or 'byte'}")
    if "vocab_size" in ov and text is None:  # the generated rules' minimum, not GPTConfig's (>= 1), is the one to name
        check_token_rules(ov["vocab_size"], seq_len)
    cfg = dataclasses.replace(base, **ov)  # GPTConfig checks every value's type and range
    if seq_len > cfg.max_seq_len:
        cfg = dataclasses.replace(cfg, max_seq_len=seq_len)
    if text is not None:
        check_model_fits(text, vocab_size=cfg.vocab_size, max_positions=None, seq_len=seq_len, model=name)
        return _gpt(name, cfg, seed, dataset=lambda: text.train, example_batch=text.example_batch,
                    val_dataset=lambda: text.val, data_source=text.source, data_description=text.description)
    check_token_rules(cfg.vocab_size, seq_len)
    return _gpt(name, cfg, seed,
                dataset=lambda: TokenRules(size=dataset_size, seq_len=seq_len, vocab_size=cfg.vocab_size, seed=seed),
                example_batch=lambda n: full_length_tokens(n, seq_len, cfg.vocab_size, seed))


def _gpt(name: str, cfg: GPTConfig, seed: int, **data) -> GenericTask:

    def build():
        torch.manual_seed(seed)
        return GPT(cfg)

    return GenericTask(
        name=name,
        unit="tokens",
        build_model=build,
        collate=collate_tokens,
        count=gpt_count,
        loss=gpt_loss,
        block_classes=("Block",),
        depth_key="n_layer",
        depth=cfg.n_layer,
        **data,
    )


def cnn_loss(model, batch):
    dtype = next(model.parameters()).dtype  # bf16-true/fp16-true store half weights: feed half images
    logits = model(batch["images"].to(dtype))
    return F.cross_entropy(logits.float(), batch["labels"], reduction="sum"), batch["labels"].numel()


def cnn_task(*, seed: int, dataset_size: int, overrides: str = "") -> GenericTask:
    cfg = CNNConfig(**_known_keys(parse_overrides(overrides), CNNConfig))  # checks types and ranges

    def build():
        torch.manual_seed(seed)
        return SmallCNN(channels=cfg.channels, n_classes=cfg.n_classes)

    return GenericTask(
        name="cnn",
        unit="samples",
        build_model=build,
        dataset=lambda: TemplateImages(size=dataset_size, seed=seed, n_classes=cfg.n_classes),
        collate=collate_images,
        count=lambda b: int(b["labels"].numel()),
        loss=cnn_loss,
        block_classes=("ConvBlock",),
        example_batch=lambda n: collate_images([TemplateImages(size=n, seed=seed, n_classes=cfg.n_classes)[i]
                                                for i in range(n)]),
    )
