"""Model presets: the names every command takes for the same model (pure: no torch).

``--model`` accepts, in every command: a built-in GPT (``gpt-tiny``, ``gpt-small``, ``gpt2-small``),
``cnn``, a Llama preset (``llama-7b``, ``llama-70b``: shorthands for ``hf:LlamaForCausalLM`` with that
config), any ``hf:ArchitectureClass`` or a ``module:callable``. :func:`resolve_model` expands a preset
into what is built; the planner costs the same names from their shapes (``plan.shapes``).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.errors import ConfigError, check_int


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Token vocabulary size."""
    max_seq_len: int = 64
    """Positions in the learned position embedding."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    d_model: int = 256
    """Residual stream width."""
    mlp_ratio: int = 4
    """MLP hidden width = mlp_ratio x d_model."""
    dropout: float = 0.0
    """Dropout probability (0 keeps runs bitwise reproducible without RNG bookkeeping)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            check_int(f"model_config.{name}", getattr(self, name), minimum=1)
        if self.d_model % self.n_head:
            raise ConfigError("model_config.n_head", self.n_head, f"a divisor of d_model={self.d_model}")
        d = self.dropout  # a string or a bool is refused before any comparison (no TypeError, no True == 1)
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d < 1.0:
            raise ConfigError("model_config.dropout", d, "a number in [0, 1)")


CNN_MAX_CLASSES = 100_000
"""The most classes the built-in CNN's generated images take: they keep one 3x16x16 float template per
class (100,000 classes: 300 MiB), made before the first step."""


@dataclass(frozen=True, kw_only=True)
class CNNConfig:
    """The built-in CNN's ``--model-config`` keys."""

    channels: int = 32
    """Channels of the first conv block (the second has twice as many)."""
    n_classes: int = 10
    """Classes of the generated images (and outputs of the head)."""

    def __post_init__(self) -> None:
        check_int("model_config.channels", self.channels, minimum=1)
        # One class would make the cross-entropy identically 0: no gradient, nothing to learn.
        check_int("model_config.n_classes", self.n_classes, minimum=2, maximum=CNN_MAX_CLASSES,
                  fix="the generated images keep one template per class")


def check_kv_heads(heads: int, kv: int, given) -> None:
    """Grouped-query attention: ``num_key_value_heads`` must divide ``num_attention_heads``; the refusal names
    the key the user set (``given``: the keys of their ``--model-config``)."""
    if heads % kv:
        fix = "grouped-query attention shares each key/value head among a whole group of heads"
        if "num_key_value_heads" in given or "num_attention_heads" not in given:
            raise ConfigError("model_config.num_key_value_heads", kv, f"a divisor of num_attention_heads={heads}", fix)
        raise ConfigError("model_config.num_attention_heads", heads, f"a multiple of num_key_value_heads={kv}", fix)


GPT_PRESETS = {
    # ~3.3M parameters: trains visibly in a couple of minutes on 2 CPU cores.
    "gpt-tiny": GPTConfig(),
    # ~25M parameters: a middle size for benchmarks.
    "gpt-small": GPTConfig(n_layer=6, d_model=512, n_head=8, max_seq_len=256),
    # GPT-2 small's shape (124M with tied embeddings; untied here), for planning.
    "gpt2-small": GPTConfig(vocab_size=50257, max_seq_len=1024, n_layer=12, n_head=12, d_model=768),
}

# Llama 2 7B (Touvron et al. 2023, table 1 / HF config) and Llama 3 70B (Meta's HF config: GQA, 8 KV heads).
HF_PRESETS: dict[str, tuple[str, str]] = {
    "llama-7b": ("hf:LlamaForCausalLM", "vocab_size=32000,num_hidden_layers=32,hidden_size=4096,"
                                        "num_attention_heads=32,num_key_value_heads=32,intermediate_size=11008,"
                                        "max_position_embeddings=4096"),
    "llama-70b": ("hf:LlamaForCausalLM", "vocab_size=128256,num_hidden_layers=80,hidden_size=8192,"
                                         "num_attention_heads=64,num_key_value_heads=8,intermediate_size=28672,"
                                         "max_position_embeddings=8192"),
}
"""name -> (the ``hf:`` spec it builds, its config as ``key=value`` overrides)."""

MODEL_HELP = (f"{', '.join(GPT_PRESETS)}, cnn, {', '.join(HF_PRESETS)}, hf:ArchitectureClass or module:callable "
              "(default gpt-tiny)")


def resolve_model(model: str, model_config: str = "") -> tuple[str, str]:
    """(model, model_config) that is built for ``model``: a Llama preset becomes its ``hf:`` spec with the
    preset's config, the user's ``model_config`` overriding it key by key (later keys win)."""
    if model in HF_PRESETS:
        spec, preset = HF_PRESETS[model]
        if model_config.strip().endswith(".json"):
            raise ConfigError("model_config", model_config, "key=value,... overrides with a preset model",
                              f"{model} is {spec} with {preset}; pass --model {spec} to start from a JSON config")
        return spec, ",".join(x for x in (preset, model_config.strip()) if x)
    return model, model_config
