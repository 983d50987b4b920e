"""Transformer shapes the planner can cost analytically (pure: no torch).

For models far too large to trace on this machine (a 70B Llama on 1,024 H100s) the planner
needs parameter counts, activation bytes and FLOPs from the *shape* alone. Two families:
the built-in GPT (``trainfit.tasks.gpt``) and Llama (``hf:LlamaForCausalLM`` with
``key=value`` config overrides); the presets (``trainfit.presets``: ``gpt-*``, ``llama-7b``,
``llama-70b``) are the same names every command builds.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.errors import ConfigError, check_int
from trainfit.presets import GPT_PRESETS, resolve_model


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    family: str
    """"gpt" (LayerNorm, GELU MLP, learned positions, biases) or "llama" (RMSNorm, SwiGLU, RoPE, no biases)."""
    vocab_size: int
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int
    """MLP hidden width."""
    max_seq_len: int = 0
    """Learned position embeddings (GPT only; 0 for RoPE)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff"):
            check_int(f"model_config.{name}", getattr(self, name), minimum=1)

    @property
    def kv_dim(self) -> int:
        return self.d_model // self.n_head * self.n_kv_head

    @property
    def block_params(self) -> int:
        d, f, kv = self.d_model, self.d_ff, self.kv_dim
        if self.family == "gpt":  # qkv + proj + fc + proj, with biases, 2 LayerNorms
            return (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        return d * (d + 2 * kv) + d * d + 3 * d * f + 2 * d  # q,k,v,o + gate,up,down + 2 RMSNorms

    @property
    def n_params(self) -> int:
        d = self.d_model
        emb = self.vocab_size * d + self.max_seq_len * d
        final_norm = 2 * d if self.family == "gpt" else d
        return emb + self.n_layer * self.block_params + final_norm + self.vocab_size * d  # untied head

    @property
    def n_tensors(self) -> int:
        """Parameter tensors: GPT block = 4 linears with biases + 2 LayerNorms (w, b) = 12; top =
        token and position embeddings, final LayerNorm (2), head = 5. Llama block = q, k, v, o,
        gate, up, down + 2 RMSNorms = 9; top = embedding, final norm, head = 3."""
        if self.family == "gpt":
            return 12 * self.n_layer + 5
        return 9 * self.n_layer + 3

    @property
    def matmul_params(self) -> int:
        """Parameters used in matmuls per token (everything but embeddings and norms)."""
        return self.n_layer * self.block_params + self.vocab_size * self.d_model

    def saved_elems_per_token(self) -> tuple[int, int]:
        """(residual-stream elements, matmul-input elements) one block saves for backward per token.

        Residual-stream tensors (norm inputs) stay fp32 under autocast; matmul inputs and
        attention tensors are cast to the compute dtype. Counted from the block's ops:
        GPT: LN in (d) | qkv in (d), q,k,v (3d), attention out (d), proj in (d) | LN in (d) |
        fc in (d), GELU in (f), proj in (f). Llama: same attention with k,v of kv_dim, and
        gate/up in (d), gate out (f), up out (f), SiLU out (f), product (f).
        """
        d, f, kv = self.d_model, self.d_ff, self.kv_dim
        if self.family == "gpt":
            return 2 * d, d + 3 * d + d + d + d + 2 * f
        return 2 * d, d + (d + 2 * kv) + d + d + d + 4 * f

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Matmul FLOPs of one forward per token: 2 x matmul params + attention (QK^T and AV, full s)."""
        return 2.0 * self.matmul_params + 4.0 * self.n_layer * seq_len * self.d_model

    def block_forward_flops_per_token(self, seq_len: int) -> float:
        return 2.0 * self.block_params + 4.0 * seq_len * self.d_model


_HF_KEYS = {"vocab_size": "vocab_size", "num_hidden_layers": "n_layer", "hidden_size": "d_model",
            "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head", "intermediate_size": "d_ff"}
_HF_DEFAULTS = {"vocab_size": 32000, "n_layer": 32, "d_model": 4096, "n_head": 32, "d_ff": 11008}  # HF LlamaConfig


def _kv(text: str) -> dict[str, int]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, _, v = part.partition("=")
        try:
            out[k.strip()] = int(v)
        except ValueError:
            raise ConfigError("model_config", part, "key=integer pairs for planning from the shape") from None
    return out


def shape_of(model: str, model_config: str = "", *, seq_len: int = 0) -> TransformerShape | None:
    """The analytic shape of ``model`` or None when the planner cannot cost it from its shape."""
    model, model_config = resolve_model(model, model_config)
    if model in GPT_PRESETS:
        base = GPT_PRESETS[model].__dict__ | _kv(model_config)
        return TransformerShape(family="gpt", vocab_size=base["vocab_size"], n_layer=base["n_layer"],
                                d_model=base["d_model"], n_head=base["n_head"], n_kv_head=base["n_head"],
                                d_ff=base["mlp_ratio"] * base["d_model"],
                                max_seq_len=max(base["max_seq_len"], seq_len))
    if model == "hf:LlamaForCausalLM":
        given = {_HF_KEYS[k]: v for k, v in _kv(model_config).items() if k in _HF_KEYS}
        vals = _HF_DEFAULTS | given
        vals.setdefault("n_kv_head", vals["n_head"])
        return TransformerShape(family="llama", **vals)
    return None


def run_spec(model: str, model_config: str) -> tuple[str, str]:
    """(model, model_config) that ``trainfit train`` builds for a planning name (presets expanded)."""
    return resolve_model(model, model_config)
