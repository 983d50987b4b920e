"""A tiny Llama saved with ``save_pretrained`` (nothing downloaded), shared by the weights tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=64, max_position_embeddings=64)
GPT = "n_layer=2,d_model=32,n_head=2"


def save_llama(directory: Path, seed: int = 1) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A directory holding config.json + model.safetensors of a 2-layer Llama (random weights, seed 1)."""
    return save_llama(tmp_path_factory.mktemp("pretrained") / "llama")
