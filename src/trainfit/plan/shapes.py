"""Transformer shapes the planner can cost analytically, and the model configs it plans for (pure: no torch).

For models far too large to trace on this machine (a 70B Llama on 1,024 H100s) the planner
needs parameter counts, activation bytes and FLOPs from the *shape* alone. Two families:
the built-in GPT (``trainfit.tasks.gpt``) and Llama (``hf:LlamaForCausalLM`` with
``key=value`` config overrides); the presets (``trainfit.presets``: ``gpt-*``, ``llama-7b``,
``llama-70b``) are the same names every command builds.

:func:`plan_model` is where ``trainfit plan`` reads ``--model-config``: every override is applied to
the shape it costs, and one that ``trainfit train`` would refuse is refused here, before any search,
naming ``model_config.<key>``: a key that is no field of the model's config (``presets.GPTConfig``;
for ``hf:`` models the ``transformers`` config class, whose keys the caller supplies, since this
module never imports it), a value of the wrong type or range, heads that do not divide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from trainfit.errors import ConfigError, check_int
from trainfit.gate import parse_scalar, read_document
from trainfit.presets import GPT_PRESETS, GPTConfig, check_kv_heads, resolve_model


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
    head_dim: int = 0
    """Width of one attention head (0: ``d_model // n_head``; Llama's ``head_dim`` key sets it apart)."""
    tied_embeddings: bool = False
    """Head shares the token embedding's weight (Llama's ``tie_word_embeddings``)."""
    attention_bias: bool = False
    """Llama's ``attention_bias``: q, k, v, o carry biases."""
    mlp_bias: bool = False
    """Llama's ``mlp_bias``: gate, up, down carry biases."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "d_ff"):
            check_int(f"model_config.{name}", getattr(self, name), minimum=1)
        check_int("model_config.head_dim", self.head_dim, minimum=0)

    @property
    def q_dim(self) -> int:
        """Width of all query heads together (``d_model`` unless ``head_dim`` is set apart)."""
        return (self.head_dim or self.d_model // self.n_head) * self.n_head

    @property
    def kv_dim(self) -> int:
        return (self.head_dim or self.d_model // self.n_head) * self.n_kv_head

    @property
    def block_params(self) -> int:
        d, f, kv, q = self.d_model, self.d_ff, self.kv_dim, self.q_dim
        if self.family == "gpt":  # qkv + proj + fc + proj, with biases, 2 LayerNorms
            return (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        n = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d  # q,k,v,o + gate,up,down + 2 RMSNorms
        if self.attention_bias:
            n += q + 2 * kv + d
        if self.mlp_bias:
            n += 2 * f + d
        return n

    @property
    def n_params(self) -> int:
        d = self.d_model
        emb = self.vocab_size * d + self.max_seq_len * d
        final_norm = 2 * d if self.family == "gpt" else d
        head = 0 if self.tied_embeddings else self.vocab_size * d  # untied head unless tie_word_embeddings
        return emb + self.n_layer * self.block_params + final_norm + head

    @property
    def n_tensors(self) -> int:
        """Parameter tensors: GPT block = 4 linears with biases + 2 LayerNorms (w, b) = 12; top =
        token and position embeddings, final LayerNorm (2), head = 5. Llama block = q, k, v, o,
        gate, up, down + 2 RMSNorms = 9 (+4 attention, +3 MLP biases); top = embedding, final norm,
        head = 3 (2 when the head is tied to the embedding)."""
        if self.family == "gpt":
            return 12 * self.n_layer + 5
        block = 9 + (4 if self.attention_bias else 0) + (3 if self.mlp_bias else 0)
        return block * self.n_layer + (2 if self.tied_embeddings else 3)

    @property
    def matmul_params(self) -> int:
        """Parameters used in matmuls per token (everything but embeddings and norms; a tied head still multiplies)."""
        return self.n_layer * self.block_params + self.vocab_size * self.d_model

    def saved_elems_per_token(self) -> tuple[int, int]:
        """(residual-stream elements, matmul-input elements) one block saves for backward per token.

        Residual-stream tensors (norm inputs) stay fp32 under autocast; matmul inputs and
        attention tensors are cast to the compute dtype. Counted from the block's ops:
        GPT: LN in (d) | qkv in (d), q,k,v (3d), attention out (d), proj in (d) | LN in (d) |
        fc in (d), GELU in (f), proj in (f). Llama: same attention with k,v of kv_dim (and q,
        attention out, o in of q_dim), and gate/up in (d), gate out (f), up out (f), SiLU out (f), product (f).
        """
        d, f, kv, q = self.d_model, self.d_ff, self.kv_dim, self.q_dim
        if self.family == "gpt":
            return 2 * d, d + 3 * d + d + d + d + 2 * f
        return 2 * d, d + (q + 2 * kv) + q + q + d + 4 * f

    def forward_flops_per_token(self, seq_len: int) -> float:
        """Matmul FLOPs of one forward per token: 2 x matmul params + attention (QK^T and AV, full s)."""
        return 2.0 * self.matmul_params + 4.0 * self.n_layer * seq_len * self.q_dim

    def block_forward_flops_per_token(self, seq_len: int) -> float:
        return 2.0 * self.block_params + 4.0 * seq_len * self.q_dim

    @property
    def down_flops_per_token(self) -> float:
        """Forward FLOPs per token of the block's last matmul, the MLP's down projection (bias included, as in
        :meth:`block_forward_flops_per_token`). Its output feeds only the residual add, which saves nothing, so
        torch's non-reentrant checkpoint stops recomputing a block once that projection's input is back: full
        checkpointing reruns every block's forward but this matmul (both families end so; a block ending in
        dropout, as hf GPT-2's does, saves its mask last and reruns everything)."""
        bias = self.d_model if self.family == "gpt" or self.mlp_bias else 0
        return 2.0 * (self.d_ff * self.d_model + bias)


# -- the model configs plan reads --------------------------------------------------------------------------------------
LLAMA = "hf:LlamaForCausalLM"
_HF_KEYS = {"vocab_size": "vocab_size", "num_hidden_layers": "n_layer", "hidden_size": "d_model",
            "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head", "intermediate_size": "d_ff"}
_HF_DEFAULTS = {"vocab_size": 32000, "n_layer": 32, "d_model": 4096, "n_head": 32, "d_ff": 11008}  # HF LlamaConfig
LLAMA_DEFAULT_MAX_POSITIONS = 2048
"""LlamaConfig's default ``max_position_embeddings``; ``trainfit train`` refuses a longer ``seq_len``."""
LLAMA_CORE_KEYS = frozenset({*_HF_KEYS, "max_position_embeddings"})
"""LlamaConfig keys checked here completely (integers, heads that divide): a config of these alone needs
nothing from ``transformers`` to plan, whatever its size."""
LLAMA_SHAPE_KEYS = frozenset({*LLAMA_CORE_KEYS, "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias"})
"""LlamaConfig keys the analytic shape applies. Any other field of LlamaConfig (``rms_norm_eps``,
``hidden_act``, ...) changes neither parameters nor saved tensors in the shape: it is accepted and
named in a note."""
TOKEN_RULES_MIN_VOCAB = 11
"""``trainfit train``'s generated token rules use ids 0..8 for padding and rule markers
(``tasks.synthetic.check_token_rules``), so a causal LM needs this many ids."""
_LIST_KEYS = 40  # keys listed at most in a refusal


@dataclass(frozen=True, kw_only=True)
class PlannedModel:
    """What ``trainfit plan`` plans for: the model ``trainfit train`` builds, its shape, and what to tell."""

    model: str
    """The spec built (a preset expanded: ``llama-7b`` -> ``hf:LlamaForCausalLM``)."""
    model_config: str
    """Its ``--model-config`` text as ``train`` takes it (a ``max_position_embeddings`` may be added, see notes)."""
    shape: TransformerShape | None
    """The analytic shape, or None when the basis must come from the memory estimator."""
    notes: tuple[str, ...] = ()
    check_task: bool = True
    """The task builder (``trainfit.tasks.make.make_task``: train's own checks, ``transformers``' validation)
    must still see this config before planning; False where this module checked all of it."""


def parse_model_config(text: str, *, json_first: bool = False) -> dict[str, object]:
    """``key=value,...`` -> dict (ints, floats, true/false parsed, later keys win), as ``trainfit train`` reads it.
    ``json_first`` (``hf:`` models): a first part without ``=`` is a JSON config file, its keys first."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    out: dict[str, object] = {}
    if json_first and parts and "=" not in parts[0]:
        out.update(_read_json(parts.pop(0)))
    for part in parts:
        k, eq, v = (s.strip() for s in part.partition("="))
        if not eq or not k:
            raise ConfigError("model_config", part, "key=value pairs separated by commas")
        out[k] = parse_scalar(f"model_config.{k}", v)  # the one parser, as train's (tasks.builtin)
    return out


def _read_json(name: str) -> dict[str, object]:
    path = Path(name)
    if not path.is_file():
        raise ConfigError("model_config", str(path), "an existing JSON config file or key=value pairs")
    values = read_document(path, field="model_config", fmt="json")  # bounded, as train reads it (tasks.hf)
    if not isinstance(values, dict):
        raise ConfigError("model_config", str(path), 'a JSON file holding one object of config keys, e.g. '
                          '{"hidden_size": 32}', f"it holds a JSON {type(values).__name__}")
    return values


def _unknown_key(key: str, value: object, known: Collection[str], owner: str) -> ConfigError:
    names = sorted(k for k in known if not k.startswith("_"))
    listed = ", ".join(names[:_LIST_KEYS])
    if len(names) > _LIST_KEYS:
        listed += f", ... ({len(names) - _LIST_KEYS} more)"
    return ConfigError(f"model_config.{key}", value, f"a field of {owner}: {listed}", f"{key!r} is not one")


def _override_keys(text: str, *, json_first: bool) -> list[str]:
    """The keys typed as ``key=value`` (a JSON file's own keys are the file's, not checked for membership)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if json_first and parts and "=" not in parts[0]:
        parts.pop(0)
    return [p.partition("=")[0].strip() for p in parts]


def plan_model(model: str, model_config: str = "", *, seq_len: int = 0,
               config_keys: Callable[[str], Collection[str] | None] | None = None) -> PlannedModel:
    """Read ``--model-config`` for ``model`` as ``trainfit train`` would, refusing what it would refuse.

    ``config_keys(spec)``: the fields of an ``hf:`` model's config class (``transformers``' ``LlamaConfig``
    for ``hf:LlamaForCausalLM``), or None where they cannot be known (``transformers`` is not installed);
    asked only when a key needs it. Without ``config_keys`` no ``hf:`` key is checked for membership
    (what :func:`shape_of` does, for callers that checked already).

    Raises:
        ConfigError: naming ``model_config.<key>`` (or ``seq`` for a sequence longer than the model's positions).
    """
    typed = model_config
    model, model_config = resolve_model(model, model_config)
    if model in GPT_PRESETS:
        return _plan_gpt(model, model_config, seq_len)
    if model == LLAMA:  # a preset's own keys are not the user's: an error names the key the user typed
        return _plan_llama(model_config, seq_len, config_keys,
                           given=set(parse_model_config(typed, json_first=typed == model_config)))
    if model.startswith("hf:") and config_keys is not None:
        keys = _override_keys(model_config, json_first=True)
        known = config_keys(model) if keys else None
        if known is not None:
            values = parse_model_config(model_config, json_first=True)
            for k in keys:
                if k not in known:
                    raise _unknown_key(k, values[k], known, f"the config of {model}")
    return PlannedModel(model=model, model_config=model_config, shape=None)


def shape_of(model: str, model_config: str = "", *, seq_len: int = 0) -> TransformerShape | None:
    """The analytic shape of ``model`` or None when the planner cannot cost it from its shape."""
    return plan_model(model, model_config, seq_len=seq_len).shape


def _plan_gpt(model: str, model_config: str, seq_len: int) -> PlannedModel:
    ov = parse_model_config(model_config)
    fields = [f.name for f in dataclasses.fields(GPTConfig)]
    for k, v in ov.items():
        if k not in fields:
            raise _unknown_key(k, v, fields, "GPTConfig")
    cfg = dataclasses.replace(GPT_PRESETS[model], **ov)  # GPTConfig checks every value's type and range
    shape = TransformerShape(family="gpt", vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, d_model=cfg.d_model,
                             n_head=cfg.n_head, n_kv_head=cfg.n_head, d_ff=cfg.mlp_ratio * cfg.d_model,
                             max_seq_len=max(cfg.max_seq_len, seq_len))
    notes = ()
    if cfg.dropout:
        notes = (f"model_config.dropout={cfg.dropout} is not in the analytic gpt shape: its dropout masks "
                 "(about 1 byte per element dropped) are not counted",)
    return PlannedModel(model=model, model_config=model_config, shape=shape, notes=notes, check_task=True)


def _plan_llama(model_config: str, seq_len: int, config_keys: Callable[[str], Collection[str] | None] | None, *,
                given: set[str]) -> PlannedModel:
    values = parse_model_config(model_config, json_first=True)
    typed = _override_keys(model_config, json_first=True)
    extra = [k for k in values if k not in LLAMA_CORE_KEYS]
    known = config_keys(LLAMA) if config_keys is not None and extra else None
    if config_keys is not None and extra and known is None:  # no transformers: only the keys modelled here
        for k in extra:
            if k not in LLAMA_SHAPE_KEYS:
                raise _unknown_key(k, values[k], LLAMA_SHAPE_KEYS, "LlamaConfig that plan can check without "
                                   "transformers (install it to plan with the others)")
    if known is not None:
        for k in typed:
            if k not in known:
                raise _unknown_key(k, values[k], known, "LlamaConfig")
    shape = _llama_shape(values, given=given)
    notes: list[str] = []
    max_pos = values.get("max_position_embeddings")
    if seq_len and max_pos is not None and seq_len > max_pos:
        raise ConfigError("seq", seq_len, f"at most max_position_embeddings={max_pos} of {LLAMA}",
                          f"raise max_position_embeddings in --model-config to {seq_len}")
    if seq_len > LLAMA_DEFAULT_MAX_POSITIONS and max_pos is None:
        model_config = ",".join(x for x in (model_config.strip(), f"max_position_embeddings={seq_len}") if x)
        notes.append(f"model_config: max_position_embeddings={seq_len} added for --seq {seq_len} (LlamaConfig's "
                     f"default is {LLAMA_DEFAULT_MAX_POSITIONS}, which `trainfit train` would refuse; RoPE positions "
                     "hold no parameters, so memory and time are unchanged)")
    unmodelled = [k for k in values if k not in LLAMA_SHAPE_KEYS]
    if unmodelled:
        named = ", ".join(unmodelled[:10]) + (f" and {len(unmodelled) - 10} more" if len(unmodelled) > 10 else "")
        notes.append(f"model_config keys the analytic llama shape does not model (its memory and time are computed "
                     f"without them): {named}")
    return PlannedModel(model=LLAMA, model_config=model_config, shape=shape, notes=tuple(notes),
                        check_task=known is not None)


def _llama_shape(values: dict[str, object], *, given: set[str]) -> TransformerShape:
    """The Llama shape of ``values`` (LlamaConfig keys; defaults as LlamaConfig's), every modelled value checked."""
    for key in LLAMA_CORE_KEYS:
        v = values.get(key)
        if v is None and (key in ("num_key_value_heads", "max_position_embeddings") or key not in values):
            continue  # num_key_value_heads: None means one per attention head, as in LlamaConfig
        minimum = TOKEN_RULES_MIN_VOCAB if key == "vocab_size" else 1
        check_int(f"model_config.{key}", v, minimum=minimum)
    vals = _HF_DEFAULTS | {_HF_KEYS[k]: v for k, v in values.items() if k in _HF_KEYS and v is not None}
    vals.setdefault("n_kv_head", vals["n_head"])
    d, heads, kv = vals["d_model"], vals["n_head"], vals["n_kv_head"]
    head_dim = values.get("head_dim")
    if head_dim is not None:
        check_int("model_config.head_dim", head_dim, minimum=1)
    elif d % heads:
        fix = "each attention head is hidden_size / num_attention_heads wide unless head_dim is set"
        if "num_attention_heads" in given or "hidden_size" not in given:
            raise ConfigError("model_config.num_attention_heads", heads, f"a divisor of hidden_size={d}", fix)
        raise ConfigError("model_config.hidden_size", d, f"a multiple of num_attention_heads={heads}", fix)
    check_kv_heads(heads, kv, given)
    width = head_dim if head_dim is not None else d // heads
    if width % 2:
        allowed = "a value giving an even attention head width (RoPE rotates pairs of dimensions)"
        if head_dim is not None:
            raise ConfigError("model_config.head_dim", head_dim, "an even integer (RoPE rotates pairs of dimensions)")
        if "num_attention_heads" in given or "hidden_size" not in given:
            raise ConfigError("model_config.num_attention_heads", heads, allowed,
                              f"hidden_size / num_attention_heads = {d} / {heads} = {width}")
        raise ConfigError("model_config.hidden_size", d, allowed, f"hidden_size / num_attention_heads = {width}")
    flags = {}
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        v = values.get(key, False)
        if v is None:
            v = False
        if not isinstance(v, bool):
            raise ConfigError(f"model_config.{key}", v, "true or false")
        flags[key] = v
    return TransformerShape(family="llama", **vals, head_dim=head_dim or 0,
                            tied_embeddings=flags["tie_word_embeddings"], attention_bias=flags["attention_bias"],
                            mlp_bias=flags["mlp_bias"])


def run_spec(model: str, model_config: str) -> tuple[str, str]:
    """(model, model_config) that ``trainfit train`` builds for a planning name (presets expanded)."""
    return resolve_model(model, model_config)
