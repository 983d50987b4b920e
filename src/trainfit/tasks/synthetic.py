"""Locally generated, deterministic datasets: nothing is downloaded.

Tokens: each sequence follows one of a few affine rules ``x[t+1] = (a*x[t] + c) mod V``
announced by its first token, with a little noise, and has a random length (so batches
are padded and micro-batches carry different numbers of loss tokens). A model can learn
the rules, so the loss falls visibly within a few dozen steps.

Images: each class is a fixed random template plus noise.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from trainfit.errors import ConfigError

PAD_ID = 0
IGNORE_INDEX = -100
N_RULES = 8


def check_token_rules(vocab_size: int, seq_len: int) -> None:
    """Refuse, naming the field, a model whose vocabulary or length cannot hold the generated token rules.
    Called when a task is built, so the error comes before a run directory is made."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= N_RULES + 2:
        raise ConfigError("model_config.vocab_size", vocab_size, f"an integer >= {N_RULES + 3}",
                          f"the generated token rules use ids 0..{N_RULES} for padding and rule markers")
    if seq_len < 2:
        raise ConfigError("seq_len", seq_len, "an integer >= 2")


class TokenRules(Dataset):
    def __init__(self, *, size: int, seq_len: int, vocab_size: int, seed: int, noise: float = 0.05) -> None:
        check_token_rules(vocab_size, seq_len)
        rng = np.random.default_rng([seed, 0x7F1])
        self.seq_len = seq_len
        body = vocab_size - N_RULES - 1  # ids 1..N_RULES announce the rule; 0 is padding
        a = rng.integers(1, body, size=N_RULES) | 1
        c = rng.integers(0, body, size=N_RULES)
        rule = rng.integers(0, N_RULES, size=size)
        lengths = rng.integers(max(2, seq_len // 4), seq_len + 1, size=size)  # tokens incl. the rule token
        toks = np.zeros((size, seq_len + 1), dtype=np.int64)
        x = rng.integers(0, body, size=size)
        toks[:, 0] = rule + 1
        for t in range(1, seq_len + 1):
            toks[:, t] = x + N_RULES + 1
            x = (a[rule] * x + c[rule]) % body
            flip = rng.random(size) < noise
            x = np.where(flip, rng.integers(0, body, size=size), x)
        mask = np.arange(seq_len + 1)[None, :] < (lengths[:, None] + 1)
        self.tokens = torch.from_numpy(np.where(mask, toks, PAD_ID))
        self.lengths = torch.from_numpy(lengths)  # input tokens per sample (= loss tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = int(self.lengths[i])
        seq = self.tokens[i, : n + 1]
        return {"input_ids": seq[:-1], "labels": seq[1:]}


def collate_tokens(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample of this micro-batch; padded labels are ignored."""
    T = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), T), PAD_ID, dtype=torch.long)
    labels = torch.full((len(samples), T), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n] = s["input_ids"]
        labels[i, :n] = s["labels"]
    return {"input_ids": ids, "labels": labels}


class TemplateImages(Dataset):
    def __init__(self, *, size: int, seed: int, n_classes: int = 10, hw: int = 16, noise: float = 1.0) -> None:
        g = torch.Generator().manual_seed(seed * 7919 + 17)
        templates = torch.randn(n_classes, 3, hw, hw, generator=g)
        self.labels = torch.randint(0, n_classes, (size,), generator=g)
        self.images = templates[self.labels] + noise * torch.randn(size, 3, hw, hw, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"images": self.images[i], "labels": self.labels[i]}


def collate_images(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"images": torch.stack([s["images"] for s in samples]), "labels": torch.stack([s["labels"] for s in samples])}
