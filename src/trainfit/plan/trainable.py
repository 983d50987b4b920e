"""Which parameters train under ``--freeze`` and ``--lora``, from a transformer's shape alone (pure: no torch).

Fine-tuning holds every weight but trains few: a frozen parameter keeps its weight and nothing else (no
gradient, no optimizer state, no fp32 master copy); LoRA freezes every base weight and adds, beside each
targeted module, ``A`` (r x in) and ``B`` (out x r): ``r * (in + out)`` parameters, the only ones that train.
The names are the ones ``trainfit train`` matches (``levers.finetune``): ``--freeze`` patterns are fnmatch
globs over the model's parameter names (``model.layers.0.self_attn.q_proj.weight``); a LoRA target matches a
module's whole name or its last dotted parts (peft's rule). This module rebuilds those names from the shape
(a 70B model is never built), so the planner can count.

What the activations model (per token, in :func:`Trainable.saved_mm_elems`):

- a Linear whose weight is frozen does not save its input: autograd saves a matmul's input only for its
  weight's gradient (checked with ``torch.autograd.graph.saved_tensors_hooks``), so that input leaves the
  block's saved tensors unless a trainable Linear or an adapter reads the same tensor;
- an adapter saves its input (shared with the other adapters on that input, unless LoRA dropout makes
  each its own copy, plus a 1-byte mask per element) and its r-wide ``A`` output;
- everything else a block saves (norms, attention, activation functions) is kept as for full training:
  backward still runs through a frozen block to reach the trainable ones below it;
- blocks below the lowest block holding a trainable parameter save nothing, when the embeddings are
  frozen too: no tensor there needs a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.errors import ConfigError
from trainfit.plan.shapes import TransformerShape
from trainfit.vocabulary import LoraSpec, freeze_patterns, lora_target_matches, match_frozen

INPUTS = ("attn_in", "o_in", "mlp_in", "down_in")
"""The saved matmul inputs of a block, by the Linear layers that read them: the attention input (q, k, v
read it), the output projection's input, the MLP input (gate and up, or fc) and the down projection's input."""


@dataclass(frozen=True, kw_only=True)
class Module:
    """One module LoRA can adapt (a Linear or an Embedding), as ``named_modules`` names it."""

    name: str
    in_features: int
    """Embedding: the number of ids (LoRA's A is r x num_embeddings)."""
    out_features: int
    bias: bool = False
    block: int | None = None
    """The block index; None outside the blocks (embeddings, head)."""
    input: str = ""
    """Which of :data:`INPUTS` it reads (blocks only)."""
    embedding: bool = False

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def _block_linears(shape: TransformerShape) -> list[tuple[str, int, int, bool, str]]:
    """(name within the block, in, out, bias, saved input) of a block's Linear layers."""
    d, f, q, kv = shape.d_model, shape.d_ff, shape.q_dim, shape.kv_dim
    if shape.family == "gpt":
        return [("attn.qkv", d, 3 * d, True, "attn_in"), ("attn.proj", d, d, True, "o_in"),
                ("mlp.fc", d, f, True, "mlp_in"), ("mlp.proj", f, d, True, "down_in")]
    ab, mb = shape.attention_bias, shape.mlp_bias
    return [("self_attn.q_proj", d, q, ab, "attn_in"), ("self_attn.k_proj", d, kv, ab, "attn_in"),
            ("self_attn.v_proj", d, kv, ab, "attn_in"), ("self_attn.o_proj", q, d, ab, "o_in"),
            ("mlp.gate_proj", d, f, mb, "mlp_in"), ("mlp.up_proj", d, f, mb, "mlp_in"),
            ("mlp.down_proj", f, d, mb, "down_in")]


def _block_prefix(shape: TransformerShape, i: int) -> str:
    return f"blocks.{i}." if shape.family == "gpt" else f"model.layers.{i}."


def modules(shape: TransformerShape) -> list[Module]:
    """Every module LoRA can adapt, in model order, named as the built model names it."""
    V, d = shape.vocab_size, shape.d_model
    if shape.family == "gpt":
        out = [Module(name="tok_emb", in_features=V, out_features=d, embedding=True),
               Module(name="pos_emb", in_features=shape.max_seq_len, out_features=d, embedding=True)]
    else:
        out = [Module(name="model.embed_tokens", in_features=V, out_features=d, embedding=True)]
    for i in range(shape.n_layer):
        out += [Module(name=_block_prefix(shape, i) + n, in_features=a, out_features=b, bias=bias, block=i, input=inp)
                for n, a, b, bias, inp in _block_linears(shape)]
    if shape.family == "gpt":
        out.append(Module(name="head", in_features=d, out_features=V))
    else:  # the module exists when tied too (it shares the embedding's weight)
        out.append(Module(name="lm_head", in_features=d, out_features=V))
    return out


def parameters(shape: TransformerShape) -> list[tuple[str, int, int | None]]:
    """(name, elements, block index or None) of every parameter, as ``model.named_parameters()`` lists them
    (a tied head shares the embedding's tensor, listed once)."""
    d = shape.d_model
    out: list[tuple[str, int, int | None]] = []
    if shape.family == "gpt":
        out += [("tok_emb.weight", shape.vocab_size * d, None), ("pos_emb.weight", shape.max_seq_len * d, None)]
    else:
        out.append(("model.embed_tokens.weight", shape.vocab_size * d, None))
    for i in range(shape.n_layer):
        p = _block_prefix(shape, i)
        norms = (["ln1", "ln2"] if shape.family == "gpt" else ["input_layernorm", "post_attention_layernorm"])
        block: list[tuple[str, int]] = []
        for j, (n, a, b, bias, _) in enumerate(_block_linears(shape)):
            if shape.family == "gpt" and j in (0, 2):  # ln1 before attn, ln2 before the MLP
                norm = norms[j // 2]
                block += [(f"{norm}.weight", d), (f"{norm}.bias", d)]
            block.append((f"{n}.weight", a * b))
            if bias:
                block.append((f"{n}.bias", b))
        if shape.family == "llama":
            block = ([("self_attn." + n.split(".", 1)[1], k) for n, k in block if n.startswith("self_attn.")]
                     + [(f"mlp.{n.split('.', 1)[1]}", k) for n, k in block if n.startswith("mlp.")]
                     + [(f"{norm}.weight", d) for norm in norms])
        out += [(p + n, k, i) for n, k in block]
    if shape.family == "gpt":
        out += [("ln_f.weight", d, None), ("ln_f.bias", d, None), ("head.weight", shape.vocab_size * d, None)]
    else:
        out.append(("model.norm.weight", d, None))
        if not shape.tied_embeddings:
            out.append(("lm_head.weight", shape.vocab_size * d, None))
    return out


def _targets_matching(name: str, targets: tuple[str, ...]) -> bool:
    return any(lora_target_matches(name, t) for t in targets)


@dataclass(frozen=True, kw_only=True)
class Trainable:
    """What trains, per block, for one (shape, --freeze, --lora)."""

    n_params: int
    """All parameters held: the base model's and the adapters'."""
    n_trainable: int
    n_trainable_tensors: int
    n_adapters: int = 0
    """Adapted modules (each adds two tensors, A and B)."""
    lowest_block: int = 0
    """Blocks below this save no activations (nothing below them trains); 0 when an embedding trains."""
    frozen_inputs: tuple[frozenset[str], ...] = ()
    """Per block: the :data:`INPUTS` no trainable Linear and no adapter reads (not saved)."""
    adapter_elems: tuple[int, ...] = ()
    """Per block: saved elements per token the adapters add (A's r outputs; with dropout their own inputs)."""
    adapter_mask_bytes: tuple[int, ...] = ()
    """Per block: LoRA dropout masks, bytes per token."""
    frozen_weight_params: tuple[int, ...] = ()
    """Per block: Linear weight elements that get no gradient (their weight-gradient matmuls are skipped)."""
    adapter_flops_per_token: tuple[float, ...] = ()
    """Per block: forward FLOPs of the adapters per token (2 r (in + out) each)."""
    top_frozen_weight_params: int = 0
    """Head weight elements that get no gradient (the head outside the blocks)."""
    head_adapter_elems: int = 0
    """Saved elements per token of adapters outside the blocks (embeddings, head)."""
    head_adapter_flops: float = 0.0
    description: str = ""
    """One line for the plan's header."""

    @property
    def fraction(self) -> float:
        return self.n_trainable / self.n_params if self.n_params else 0.0


def full_training(shape: TransformerShape) -> Trainable:
    """Every parameter trains (no --freeze, no --lora)."""
    L = shape.n_layer
    return Trainable(n_params=shape.n_params, n_trainable=shape.n_params, n_trainable_tensors=shape.n_tensors,
                     frozen_inputs=(frozenset(),) * L, adapter_elems=(0,) * L, adapter_mask_bytes=(0,) * L,
                     frozen_weight_params=(0,) * L, adapter_flops_per_token=(0.0,) * L)


def trainable(shape: TransformerShape, *, freeze: str = "", lora: LoraSpec | None = None) -> Trainable:
    """What trains under ``freeze`` (comma-separated fnmatch patterns) and ``lora``.

    Raises:
        ConfigError: ``freeze``: a pattern matching no parameter name of the shape, or patterns freezing all
            of them; ``lora.targets``: a target naming no module LoRA can adapt (listing the shape's names).
    """
    params = parameters(shape)
    names = [n for n, _, _ in params]
    patterns = freeze_patterns(freeze)
    if lora is None and not patterns:
        return full_training(shape)
    # the rule train applies; with LoRA the adapters train, so freezing every base weight is allowed
    frozen = set(match_frozen(names, freeze, of=f" of {shape.family}", allow_all=lora is not None))
    mods = modules(shape)
    adapted: list[Module] = []
    if lora is not None:
        frozen = set(names)  # LoRA freezes every base weight
        adapted = _adapted_modules(shape, mods, lora)
    r = lora.r if lora else 0
    n_adapter = sum(r * (m.in_features + m.out_features) for m in adapted)
    trainable_params = [(n, k, b) for n, k, b in params if n not in frozen]
    lowest = _lowest_block(shape, mods, trainable_params, adapted)
    per_block = _per_block(shape, mods, adapted, frozen, r=r, dropout=bool(lora and lora.dropout))
    top = [m for m in adapted if m.block is None]
    n_all = shape.n_params + n_adapter
    n_train = sum(k for _, k, _ in trainable_params) + n_adapter
    what = _what_trains(shape, freeze=freeze, patterns=patterns, lora=lora, adapted=adapted, n_frozen=len(frozen),
                        n_names=len(names))
    return Trainable(
        n_params=n_all, n_trainable=n_train, n_trainable_tensors=len(trainable_params) + 2 * len(adapted),
        n_adapters=len(adapted), lowest_block=max(0, lowest), **per_block,
        top_frozen_weight_params=shape.vocab_size * shape.d_model if _head_weight(shape) in frozen else 0,
        head_adapter_elems=r * len(top),
        head_adapter_flops=sum(2.0 * r * (m.in_features + m.out_features) for m in top),
        description=f"trainable parameters: {n_train:,} of {n_all:,} ({n_train / n_all:.2%}): " + "; ".join(what),
    )


def _adapted_modules(shape: TransformerShape, mods: list[Module], lora: LoraSpec) -> list[Module]:
    """The modules of ``mods`` that get an adapter under ``lora``.

    Raises:
        ConfigError: ``lora.targets``: a target naming no module of ``mods`` (listing their short names).
    """
    for t in lora.targets:
        if not any(_targets_matching(m.name, (t,)) for m in mods):
            listed = ", ".join(dict.fromkeys(m.short for m in mods))
            raise ConfigError("lora.targets", t, f"module names of the {shape.family} shape: {listed}",
                              "a target matches a module's name or its last dotted parts")
    return [m for m in mods if _targets_matching(m.name, lora.targets)]


def _lowest_block(shape: TransformerShape, mods: list[Module], trainable_params: list[tuple[str, int, int | None]],
                  adapted: list[Module]) -> int:
    """The lowest block backward reaches: an embedding that trains takes it through all of them (-1), a
    trainable head or final norm through none (``n_layer``)."""
    L = shape.n_layer
    embeddings = {m.name for m in mods if m.embedding}

    def depth(block: int | None, name: str) -> int:
        return block if block is not None else (-1 if name.rsplit(".", 1)[0] in embeddings else L)

    return min([depth(b, n) for n, _, b in trainable_params]
               + [depth(m.block, m.name + ".weight") for m in adapted] + [L])


def _per_block(shape: TransformerShape, mods: list[Module], adapted: list[Module], frozen: set[str], *, r: int,
               dropout: bool) -> dict[str, tuple]:
    """The per-block fields of :class:`Trainable` (``frozen_inputs``, ``adapter_elems``, ``adapter_mask_bytes``,
    ``frozen_weight_params``, ``adapter_flops_per_token``), by field name, for weights ``frozen`` and the
    ``adapted`` modules of rank ``r``."""
    linears = [m for m in mods if m.block is not None]
    frozen_inputs, extra, masks, frozen_w, flops = [], [], [], [], []
    for i in range(shape.n_layer):
        mine = [m for m in linears if m.block == i]
        ada = [m for m in adapted if m.block == i]
        read = {m.input for m in mine if f"{m.name}.weight" not in frozen}
        if not dropout:
            read |= {m.input for m in ada}
        frozen_inputs.append(frozenset(x for x in INPUTS if x not in read))
        extra.append(sum(r + (m.in_features if dropout else 0) for m in ada))
        masks.append(sum(m.in_features for m in ada) if dropout else 0)
        frozen_w.append(sum(m.in_features * m.out_features for m in mine if f"{m.name}.weight" in frozen))
        flops.append(sum(2.0 * r * (m.in_features + m.out_features) for m in ada))
    return {"frozen_inputs": tuple(frozen_inputs), "adapter_elems": tuple(extra), "adapter_mask_bytes": tuple(masks),
            "frozen_weight_params": tuple(frozen_w), "adapter_flops_per_token": tuple(flops)}


def _head_weight(shape: TransformerShape) -> str:
    """The name of the head's weight (a tied head's is the embedding's)."""
    return ("head.weight" if shape.family == "gpt" else
            "model.embed_tokens.weight" if shape.tied_embeddings else "lm_head.weight")


def _what_trains(shape: TransformerShape, *, freeze: str, patterns: list[str], lora: LoraSpec | None,
                 adapted: list[Module], n_frozen: int, n_names: int) -> list[str]:
    """The parts of the plan header's line on what trains: the LoRA adapters, then what ``--freeze``
    (``patterns``, parsed) froze: ``n_frozen`` of the ``n_names`` parameter tensors."""
    what = []
    if lora is not None:
        short = ", ".join(dict.fromkeys(m.short for m in adapted))
        blocks = len({m.block for m in adapted if m.block is not None})
        what.append(f"LoRA r={lora.r} on {short} ({len(adapted)} modules"
                    + (f" in {blocks} of {shape.n_layer} blocks" if blocks else "") + ")")
    if patterns and lora is None:
        what.append(f"--freeze {freeze}: {n_frozen} of {n_names} parameter tensors frozen")
    elif patterns:
        what.append(f"--freeze {freeze} (the base weights are frozen under LoRA anyway)")
    return what


def saved_input_elems(shape: TransformerShape) -> dict[str, int]:
    """Elements per token of each of :data:`INPUTS` (part of ``saved_elems_per_token``'s matmul inputs)."""
    d, f, q = shape.d_model, shape.d_ff, shape.q_dim
    return {"attn_in": d, "o_in": q if shape.family == "llama" else d, "mlp_in": d, "down_in": f}
