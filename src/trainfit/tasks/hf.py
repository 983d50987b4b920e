"""``hf:ArchitectureClass``: any Hugging Face ``transformers`` model, from a config, random weights.

Nothing is downloaded: the model is built from its config class (defaults, a JSON file,
and/or ``key=value`` overrides) with random weights. The head decides the task:

==========================  =================================================  ======
class name ends with         batch (generated locally)                          unit
==========================  =================================================  ======
ForCausalLM / LMHeadModel   token rules (learnable), next-token labels        tokens
ForMaskedLM                 random tokens, every 7th position is a label      tokens
ForConditionalGeneration    source tokens, target = source reversed            tokens
(encoder-decoder)
ForSequenceClassification   random tokens, class = first token mod num_labels samples
ForImageClassification      class templates + noise, (C, H, W) from config     samples
==========================  =================================================  ======

The loss is trainfit's (sum of per-item cross-entropy, item count) computed from the
logits, not the model's internal mean loss, so accumulation normalises exactly.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn import functional as F
from torch.utils.data import Dataset

from trainfit.errors import ConfigError, ModelError, TrainfitError, check_int
from trainfit.gate import RECORD, read_document
from trainfit.presets import check_kv_heads
from trainfit.tasks.base import GenericTask
from trainfit.tasks.builtin import full_length_tokens, parse_overrides
from trainfit.tasks.files import load_text_data
from trainfit.tasks.spec import DataSpec, check_model_fits, model_dir
from trainfit.tasks.synthetic import IGNORE_INDEX, TokenRules, check_token_rules, collate_tokens

HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration", "ForSequenceClassification",
         "ForImageClassification")
MLM_EVERY = 7  # masked-LM: one label every 7 tokens (about BERT's 15%)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ModelError("hf: models need the transformers package; install it with "
                         "`pip install 'trainfit[hf]'`") from None
    return transformers


def _kind(arch: str, config) -> str:
    if arch.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    if arch.endswith("ForMaskedLM"):
        return "mlm"
    if arch.endswith("ForConditionalGeneration") and getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    if arch.endswith("ForSequenceClassification"):
        return "seqcls"
    if arch.endswith("ForImageClassification"):
        return "image"
    raise ConfigError("model", f"hf:{arch}", "a transformers class whose name ends with one of: " + ", ".join(HEADS))


_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "num_encoder_layers",
               "encoder_layers", "decoder_layers")
# Keys that size the model (widths, heads, labels, positions): an integer >= 1 (None where the default is None).
_SIZE_KEY = re.compile(r"(^|_)(size|dim|heads?|labels|channels|embd|embeddings|positions|inner|ctx|ff|kv)$|^d_model$")
_MISSING = object()


def _one_line(e: BaseException, limit: int = 240) -> str:
    """An exception as one short line: transformers' strict-dataclass errors span two lines."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines = lines[1:]  # "Validation error for field 'x':" / "    TypeError: ..." -> the second
    text = " ".join(lines) or type(e).__name__
    if not text.startswith(type(e).__name__) and ":" not in text.split(" ", 1)[0]:
        text = f"{type(e).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_default(d: object) -> bool:
    return d is None or (isinstance(d, int) and not isinstance(d, bool))


def _check_values(config_class, default, values: dict[str, Any], minimums: dict[str, int]) -> None:
    """Refuse, naming the key, a value of the wrong type or range before transformers sees it (it would
    raise at model construction, a step later, or never: a float layer count, a negative width)."""
    for key, v in values.items():
        d = getattr(default, key, _MISSING)
        field = f"model_config.{key}"
        if v is None:  # JSON null: transformers' own default or its own error
            continue
        if (key in minimums or key in _DEPTH_KEYS or _SIZE_KEY.search(key)) and _int_default(d):
            if d is not None and d < 0:  # a sentinel default (-1: "off"): its meaning is the model's
                continue
            minimum = minimums.get(key, 1 if d is None or d >= 1 else 0)
            for item in v if isinstance(v, (list, tuple)) and v else (v,):  # image_size=[32, 32]
                check_int(field, item, minimum=minimum)
        elif re.match(r"(num|n)_", key) and _int_default(d) and d is not None and d >= 0:
            check_int(field, v, minimum=0)
        elif _number(d) and isinstance(v, str):  # e.g. rms_norm_eps=abc
            raise ConfigError(field, v, "a number", f"{config_class.__name__}.{key} defaults to {d!r}")
        elif isinstance(d, bool) and not isinstance(v, bool):
            raise ConfigError(field, v, "true or false")


def _key_named(message: str, values: dict[str, Any], config_class) -> str | None:
    """The user's key that transformers' ``message`` is about, if it names one (or its alias, or its value)."""
    field = re.search(r"field '(\w+)'", message)
    if field and field.group(1) in values:
        return field.group(1)
    words = re.sub(r"[^a-z0-9]+", "_", message.lower())
    alias = {v: k for k, v in getattr(config_class, "attribute_map", {}).items()}  # n_embd -> hidden_size
    synonyms = {"embed_dim": "hidden_size", "num_heads": "num_attention_heads"}
    found = []
    for key in values:
        names = {key, alias.get(key, key)}
        names |= {s for s, full in synonyms.items() if full in names}
        hits = [m.start() for n in names for m in [re.search(rf"(^|_){re.escape(n)}(_|$)", words)] if m]
        if hits:
            found.append((min(hits), key))
    if found:
        return min(found)[1]  # the key the message names first
    for key, v in values.items():  # hidden_act=nope -> KeyError: 'nope'
        if isinstance(v, str) and len(v) > 1 and v in message:
            return key
    return None


def _transformers_error(e: Exception, values: dict[str, Any], config_class, what: str, spec: str = "") -> ConfigError:
    message = _one_line(e)
    key = _key_named(message, values, config_class)
    if key is None and not values and spec:  # no --model-config was given: the model itself is the cause
        return ConfigError("model", spec, f"a model {what} accepts", f"transformers: {message}")
    if key is None:
        text = ",".join(f"{k}={v}" for k, v in values.items())
        return ConfigError("model_config", text if len(text) <= 120 else text[:117] + "...",
                           f"a config {what} accepts", f"transformers: {message}")
    return ConfigError(f"model_config.{key}", values[key], f"a value {what} accepts", f"transformers: {message}")


def _is_resource_error(e: BaseException) -> bool:
    """Errors that are about memory or trainfit itself, never about the config: passed through unchanged
    (auto-fit re-cuts a step on out-of-memory)."""
    return isinstance(e, (TrainfitError, MemoryError, torch.OutOfMemoryError))


def read_hf_values(config_class, text: str) -> dict[str, Any]:
    """``path/to/config.json``, ``key=value,...`` or both (path first) -> the keys the user set
    (later ones win); an override that is no field of ``config_class`` is refused."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    values: dict[str, Any] = {}
    if parts and "=" not in parts[0]:
        path = Path(parts.pop(0))
        if not path.is_file():
            raise ConfigError("model_config", str(path), "an existing JSON config file or key=value pairs")
        values = read_document(path, field="model_config", fmt="json")  # bounded: size, depth, keys
        if not isinstance(values, dict):
            raise ConfigError("model_config", str(path), 'a JSON file holding one object of config keys, e.g. '
                              '{"hidden_size": 32}', f"it holds a JSON {type(values).__name__}")
    overrides = parse_overrides(",".join(parts))
    default = config_class()
    known = set(default.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    for k in overrides:
        if k not in known and not hasattr(default, k):  # hasattr: properties such as num_labels
            raise ConfigError("model_config", k, sorted(known)[:40], f"not a field of {config_class.__name__}")
    return {**values, **overrides}


def parse_hf_config(config_class, text: str, *, minimums: dict[str, int] | None = None,
                    values: dict[str, Any] | None = None):
    """``path/to/config.json``, ``key=value,...`` or both (path first) -> a config instance.
    ``values``: what :func:`read_hf_values` read from ``text``, when the caller has it already.

    Raises:
        ConfigError: naming ``model_config.<key>`` where a value has the wrong type or range, or
            transformers refuses it (its message, shortened to one line, is kept).
    """
    if values is None:
        values = read_hf_values(config_class, text)
    _check_values(config_class, config_class(), values, minimums or {})
    try:
        return config_class(**values)
    except Exception as e:  # ValueError, huggingface_hub's StrictDataclass*Error, TypeError, ...
        if _is_resource_error(e):
            raise
        raise _transformers_error(e, values, config_class, config_class.__name__) from None


WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def pretrained_dir(spec: str) -> Path | None:
    """The directory an ``hf:`` spec names (it holds a path separator or names an existing directory), or
    None for a class name. Absolute, so a LoRA export can name its base model from anywhere."""
    return model_dir(f"hf:{spec}")  # the same rule that finds the model's own tokenizer (tasks.spec)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory (one file, or the shards its index names).

    Raises:
        ConfigError: no weights file, an index naming a missing shard, or a file safetensors cannot read
            (its header is parsed here, before anything is built).
    """
    spec = f"hf:{directory}"
    files = safetensors_files(directory, field="model", value=spec)
    if files is None:
        raise ConfigError("model", spec, f"a directory holding {WEIGHTS} (or {WEIGHTS_INDEX} and its shards)",
                          "save the model with save_pretrained(DIR) (safetensors is its default)")
    for f in files:
        if not f.is_file():
            raise ConfigError("model", spec, f"every shard {WEIGHTS_INDEX} names", f"{f} is missing")
    weight_shapes(files, spec)  # every header parsed here, before anything is built
    return files


def safetensors_files(directory: Path, *, field: str, value: str) -> list[Path] | None:
    """The weight files of a ``save_pretrained``-style directory: ``model.safetensors``, or the shards its index
    names (read through the gate); None when it holds neither. ``hf:DIR`` and ``--init-from RUN/model`` ask here.

    Raises:
        ConfigError: naming ``field`` and ``value``: an index that is not a ``weight_map`` of file names.
    """
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    index = directory / WEIGHTS_INDEX
    if not index.is_file():
        return None
    found = read_document(index, field=field, fmt="json", limits=RECORD)
    weight_map = found.get("weight_map") if isinstance(found, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(field, value, f"a {WEIGHTS_INDEX} with a weight_map of file names", str(index))
    return [directory / s for s in sorted(set(weight_map.values()))]


def weight_shapes(files: list[Path], spec: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the safetensors ``files``, from their headers alone (no tensor is read:
    a 100 GB checkpoint costs its few kilobytes of header).

    Raises:
        ConfigError: naming ``model``: a file safetensors cannot read (corrupt, truncated).
    """
    from safetensors import safe_open  # lazy, like transformers: only hf:DIR reads safetensors

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: the file is unusable either way
            raise ConfigError("model", spec, "readable safetensors weights",
                              f"{f} is corrupt or truncated ({_one_line(e, 160)})") from None
    return shapes


_INDEX = re.compile(r"[0-9]+", flags=re.ASCII)
_DEPTH_KEY = re.compile(r"^(num_hidden_layers|n_layers?|num_layers|num_(en|de)coder_layers|(en|de)coder_layers)$")
"""Config keys that set how many blocks a stack holds (``max_window_layers`` and the like only name some)."""
_LEGACY_NAMES = re.compile(r"LayerNorm\.(gamma|beta)$|\.weight_[gv]$|(^|\.)model\.model\.")
"""Tensor names transformers renames when loading an old checkpoint (its "legacy" renamings)."""


def _stacks(names) -> dict[str, int]:
    """``prefix -> blocks`` of every numbered list in tensor ``names`` (``model.layers.0.x``, ``model.layers.1.x``
    -> ``{"model.layers": 2}``): the depth the names hold, counted as distinct indices."""
    found: dict[str, set[int]] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if _INDEX.fullmatch(part) and len(part) <= 9:
                found.setdefault(".".join(parts[:i]), set()).add(int(part))
    return {prefix: len(indices) for prefix, indices in found.items()}


def _depths(values: dict[str, Any], where: str = "") -> Iterator[tuple[str, int]]:
    """``(key, n)`` of every depth key in a config's dict, sub-configs (``text_config``) included."""
    for key, v in values.items():
        if isinstance(v, dict):
            yield from _depths(v, f"{where}{key}.")
        elif _DEPTH_KEY.search(str(key)) and isinstance(v, int) and not isinstance(v, bool):
            yield f"{where}{key}", v


def _check_depth_bound(config, shapes: dict[str, tuple[int, ...]], spec: str) -> None:
    """No depth in config.json above the longest numbered list of the weights: a config saying 100,000 layers
    over weights for 2 is refused here, before transformers spends minutes and gigabytes building it."""
    stacks = _stacks(shapes)
    longest = max(stacks.values(), default=0)
    for key, n in _depths(config.to_dict()):
        if n > longest:
            where = max(stacks, key=stacks.get) if stacks else ""
            held = f"{longest:,} block(s) at most ({where}.0 to {where}.{longest - 1})" if stacks else "no block list"
            raise ConfigError("model", spec, "weights matching config.json",
                              f"config.json says {key}={n:,}, but the weights hold {held}; fix config.json or the "
                              "weights")


def _names_convert(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> bool:
    """True where transformers renames or reshapes this checkpoint's tensors when loading (a conversion mapping
    for the model, or old names): then only the depth is checked here, the names are transformers' to match."""
    if any(_LEGACY_NAMES.search(k) for k in shapes):
        return True
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4: no conversion mapping, only the legacy names above
        return False
    try:
        return bool(get_model_conversion_mapping(model, add_legacy=False))
    except Exception:  # noqa: BLE001 - a mapping transformers cannot build: trust nothing by name
        return True


def _tied(model: nn.Module) -> set[str]:
    """Names of the parameters tied to another (saved once: absent from the checkpoint by design)."""
    if hasattr(model, "all_tied_weights_keys"):  # transformers 5: the ties this config makes
        return set(model.all_tied_weights_keys or ())
    if getattr(model.config, "tie_word_embeddings", False):  # transformers 4: the ties the class can make
        return set(getattr(model, "_tied_weights_keys", None) or ())
    return set()


def _ignored(cls, names: set[str], which: str) -> set[str]:
    patterns = getattr(cls, f"_keys_to_ignore_on_load_{which}", None) or ()
    return {n for n in names if any(re.search(p, n) for p in patterns)}


def _aligned(expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]],
             prefix: str) -> dict[str, tuple[int, ...]]:
    """The checkpoint's names as the model names them: a base model's weights in a model with a head gain the
    ``base_model_prefix``, a head model's weights in a base model lose it (as transformers loads them)."""
    if not prefix:
        return shapes
    mine = any(k.startswith(prefix + ".") for k in expected)
    theirs = any(k.startswith(prefix + ".") for k in shapes)
    if mine and not theirs:
        return {f"{prefix}.{k}": v for k, v in shapes.items()}
    if theirs and not mine:
        return {k.removeprefix(prefix + "."): v for k, v in shapes.items()}
    return shapes


def _mismatch(model: nn.Module, cls, shapes: dict[str, tuple[int, ...]], convert: bool) -> str:
    """How the model config.json builds differs from the weights ("" when it does not): a stack's depth, a
    tensor's shape, and (where names are compared as they are) a tensor one side lacks."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes = _aligned(expected, shapes, getattr(cls, "base_model_prefix", ""))
    held = _stacks(shapes)
    for prefix, n in _stacks(expected).items():
        if prefix in held and held[prefix] != n:
            return f"config.json builds {n:,} block(s) under {prefix}, the weights hold {held[prefix]:,}"
    wrong = [k for k in expected if k in shapes and shapes[k] != expected[k]]
    if wrong:
        return (f"{wrong[0]} is {shapes[wrong[0]]} in the weights, {expected[wrong[0]]} by config.json "
                f"({len(wrong):,} tensor(s) differ)")
    if convert:
        return ""
    missing = set(expected) - set(shapes) - _tied(model) - _ignored(cls, set(expected), "missing")
    if missing:
        return f"the weights lack {min(missing)}, which config.json builds ({len(missing):,} in all)"
    extra = set(shapes) - set(expected) - _ignored(cls, set(shapes), "unexpected")
    if extra:
        return f"the weights hold {min(extra)}, which config.json does not build ({len(extra):,} in all)"
    return ""


_CHECKED: set[tuple] = set()
"""Directories whose config and weights were found to match (keyed by their files' sizes and times)."""


def check_pretrained(directory: Path, cls, config) -> None:
    """Refuse, in one line before a model is built, a ``save_pretrained`` directory whose config.json does not
    match its weights: every depth bounded by the weights' headers first (so the check itself stays cheap),
    then the model built on the meta device (no memory) compared tensor by tensor with the headers. ``train``,
    ``plan`` and the integrations ask here, so each refuses what the other refuses.

    Raises:
        ConfigError: naming ``model``: a depth, a shape, or (names compared as they are) a tensor one side lacks.
    """
    spec = f"hf:{directory}"
    files = weight_files(directory)
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in [directory / "config.json", *files])
    if key in _CHECKED:
        return
    shapes = weight_shapes(files, spec)
    _check_depth_bound(config, shapes, spec)
    try:
        with torch.device("meta"), quiet_progress():
            model = cls(copy.deepcopy(config))
    except Exception as e:  # noqa: BLE001 - a config transformers accepts but cannot build a model from
        if _is_resource_error(e):
            raise
        raise ConfigError("model", spec, f"a config.json {cls.__name__} can be built from",
                          f"transformers: {_one_line(e, 200)}") from None
    problem = _mismatch(model, cls, shapes, _names_convert(model, shapes))
    if problem:
        raise ConfigError("model", spec, "weights matching config.json", problem)
    _CHECKED.add(key)


def _pretrained_config(tf, directory: Path, model_config: str):
    """(model class, config) of a ``save_pretrained`` directory, refused in one line where unusable."""
    spec = f"hf:{directory}"
    if model_config.strip():
        raise ConfigError("model_config", model_config, "empty with hf:DIR",
                          "a pretrained checkpoint's shape is fixed; drop --model-config")
    if not directory.is_dir():
        raise ConfigError("model", spec, "hf:DIR naming an existing directory, or hf:<a transformers model class>")
    if not (directory / "config.json").is_file():
        raise ConfigError("model", spec, "a directory holding config.json (as written by save_pretrained)")
    read_document(directory / "config.json", field="model", fmt="json")  # bounded before transformers reads it
    try:
        config = tf.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - JSON errors, an unknown model_type, ...: one line naming the file
        if _is_resource_error(e):
            raise
        raise ConfigError("model", spec, "a config.json transformers can read",
                          f"{directory / 'config.json'}: {_one_line(e, 160)}") from None
    archs = getattr(config, "architectures", None)
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        raise ConfigError("model", spec, 'a config.json naming its class in "architectures"',
                          'add e.g. "architectures": ["LlamaForCausalLM"] to config.json')
    cls = getattr(tf, archs[0], None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "from_pretrained")):
        raise ConfigError("model", spec, "architectures[0] naming a transformers model class",
                          f"config.json names {archs[0]!r}")
    check_pretrained(directory, cls, config)
    return cls, config


@contextmanager
def quiet_progress() -> Iterator[None]:
    """transformers' progress bars off (loading and saving weights): trainfit's stderr is one line per problem."""
    logging = _transformers().utils.logging
    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def _load_pretrained(cls, directory: Path, config) -> nn.Module:
    """The model saved in ``directory`` with its weights, in fp32 (the precision lever casts later).
    Deterministic: every weight comes from the file (a missing one is refused, not initialised)."""
    with quiet_progress():
        model, info = cls.from_pretrained(str(directory), config=config, dtype=torch.float32, local_files_only=True,
                                          output_loading_info=True, ignore_mismatched_sizes=True)  # named below
    missing = [k for k in info.get("missing_keys", ()) if k]
    mismatched = [m for m in info.get("mismatched_keys", ()) if m]
    extra = [k for k in info.get("unexpected_keys", ()) if k]  # a tensor the model has no place for: not dropped
    if missing or mismatched or extra:
        if missing:
            what, n = f"lack {missing[0]}", len(missing)
        elif mismatched:
            key, *shapes = mismatched[0]
            found = f" ({' in the file, '.join(str(tuple(s)) for s in shapes[:2])} here)" if len(shapes) >= 2 else ""
            what, n = f"have a wrong shape for {key}{found}", len(mismatched)
        else:
            what, n = f"hold {', '.join(extra[:3])}, which {cls.__name__} has not", len(extra)
        raise ConfigError("model", f"hf:{directory}", "weights matching config.json",
                          f"{directory}'s weights {what} ({n} in all)")
    return model


class GeneratedSamples(Dataset):
    """Samples made on demand from (seed, index): nothing is stored or downloaded."""

    def __init__(self, make, size: int, seed: int) -> None:
        self.make, self.size, self.seed = make, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.make(torch.Generator().manual_seed(self.seed * 1_000_003 + i))


def _stack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def _block_classes(model: nn.Module) -> tuple[str, ...]:
    """Class names of modules repeated in a ModuleList (the transformer layers)."""
    names = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            classes = {type(c).__name__ for c in m}
            if len(classes) == 1:
                names.append(classes.pop())
    return tuple(dict.fromkeys(names))


def _token_loss(logits: torch.Tensor, labels: torch.Tensor):
    loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (labels != IGNORE_INDEX).sum()


def hf_task(arch: str, *, model_config: str = "", seq_len: int = 64, seed: int = 0, dataset_size: int = 4096,
            data: DataSpec | None = None) -> GenericTask:
    """Build a Task for ``transformers.<arch>`` from a config with random weights (no hub access), or, when
    ``arch`` is a directory written by ``save_pretrained``, for the model saved there with its weights."""
    tf = _transformers()
    pretrained = pretrained_dir(arch)
    cls, config, arch, given = _class_and_config(tf, arch, pretrained, model_config)
    kind = _kind(arch, config)
    _for_training(config, kind)
    vocab = _checked_fit(config, kind, arch, seq_len, given, pretrained)
    task = GenericTask(name=f"hf:{pretrained or arch}", unit="tokens", build_model=lambda: None,
                       dataset=lambda: None, collate=_stack, count=lambda b: 0, loss=lambda m, b: (None, 0))
    task.build_model = _model_builder(task, cls, config, pretrained, seed, arch, given)
    task.fake_trace = _real_mask_decisions
    # A pretrained checkpoint's depth is fixed: the estimate traces it in full rather than at 3 and 4 blocks.
    if pretrained is None:
        task.depth_key, task.depth = _depth_keys(config)
    _attach_data(task, kind, config, seq_len, seed, dataset_size, vocab, data)
    task.loss = _first_forward_checked(task.loss, given, cls.config_class, arch, f"hf:{pretrained or arch}")
    return task


def _class_and_config(tf, arch: str, pretrained: Path | None, model_config: str):
    """(model class, config, class name, the keys the user set) of ``hf:DIR`` (its config.json, nothing set) or
    of ``hf:<Class>`` (its config class from ``model_config``, at least what the generated data needs)."""
    if pretrained is not None:  # hf:DIR -- the class and the config come from DIR/config.json
        cls, config = _pretrained_config(tf, pretrained, model_config)
        return cls, config, cls.__name__, {}
    cls = getattr(tf, arch, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "config_class")):
        raise ConfigError("model", f"hf:{arch}", "hf:<a transformers model class>, e.g. hf:LlamaForCausalLM, "
                          "hf:BertForMaskedLM, hf:T5ForConditionalGeneration, hf:ViTForImageClassification, "
                          "or hf:DIR (a directory written by save_pretrained)",
                          "check the class name's spelling and case")
    classifies = arch.endswith(("ForSequenceClassification", "ForImageClassification"))
    # The generated data's needs: token rules need 11 ids; a classification needs 2 classes (with one the
    # cross-entropy is identically 0, nothing to learn).
    minimums = {"num_labels": 2} if classifies else {"vocab_size": 11}
    given = read_hf_values(cls.config_class, model_config)
    config = parse_hf_config(cls.config_class, model_config, minimums=minimums, values=dict(given))
    return cls, config, arch, given


def _for_training(config, kind: str) -> None:
    """Set what training needs on the config: no KV cache; a pad id for a sequence classifier."""
    if hasattr(config, "use_cache"):
        config.use_cache = False  # training: no KV cache
    if kind == "seqcls" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # decoders find each sequence's last token through the pad id


def _checked_fit(config, kind: str, arch: str, seq_len: int, given: dict[str, Any], pretrained: Path | None) -> int:
    """The config's vocabulary size, after refusing in one line a config the generated data or ``seq_len`` does
    not fit: fewer than 2 classes, key/value heads not dividing the heads, too few positions or ids."""
    classifies = arch.endswith(("ForSequenceClassification", "ForImageClassification"))
    if classifies and not (isinstance(config.num_labels, int) and config.num_labels >= 2):  # e.g. from id2label
        raise ConfigError("model_config.num_labels", config.num_labels, "an integer >= 2",
                          "the generated samples are classified into num_labels classes")
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and kv >= 1:  # a mismatch fails only in the forward
        check_kv_heads(heads, kv, given)
    max_pos = getattr(config, "max_position_embeddings", None)
    if kind != "image" and isinstance(max_pos, int) and seq_len > max_pos:
        raise ConfigError("seq_len", seq_len, f"at most max_position_embeddings={max_pos} of {arch}",
                          f"{pretrained} was trained with {max_pos} positions; pass --seq-len {max_pos} or less"
                          if pretrained else f"add max_position_embeddings={seq_len} to --model-config")
    vocab = getattr(config, "vocab_size", 0) or 0
    if kind != "image" and not (isinstance(vocab, int) and vocab >= 11):
        raise ConfigError("model_config.vocab_size", vocab, "an integer >= 11")
    return vocab


def _model_builder(task: GenericTask, cls, config, pretrained: Path | None, seed: int, arch: str,
                   given: dict[str, Any]):
    """The task's ``build_model``: the model seeded, from ``pretrained``'s weights (real tensors) or the config;
    an error of transformers reported as the config's in one line; the task's block classes recorded."""
    def build() -> nn.Module:
        torch.manual_seed(seed)
        try:
            if pretrained is not None and detect_fake_mode() is None and torch.get_default_device().type != "meta":
                model = _load_pretrained(cls, pretrained, config)
            else:  # fake tensors or the meta device (estimate, plan): only shapes matter, the config builds them
                model = cls(config)
        except Exception as e:  # a config transformers accepts but its model cannot be built from
            if _is_resource_error(e):
                raise
            if pretrained is not None:  # no --model-config here: DIR's config.json and weights are the cause
                raise ConfigError("model", f"hf:{pretrained}", f"a config.json and weights {arch} loads",
                                  f"transformers: {_one_line(e, 200)}") from None
            raise _transformers_error(e, given, cls.config_class, arch, f"hf:{arch}") from None
        model.train()
        task.block_classes = _block_classes(model)
        return model

    return build


_ENCODER_DECODER_DEPTHS = (("num_layers", "num_decoder_layers"), ("encoder_layers", "decoder_layers"))
"""(encoder, decoder) depth keys of encoder-decoder configs (T5 and its kin; BART, Marian, Whisper)."""


def _depth_keys(config) -> tuple[str, int]:
    """(the model_config key(s) that set the depth, the depth) for the estimator's block shortcut, or ("", 0).

    A decoder or encoder stack: ``num_hidden_layers``. An encoder-decoder whose two stacks have the same depth:
    both keys, comma-separated (the shortcut sets them together, so one depth variable grows both stacks and
    every segment stays linear in it); stacks of different depths are traced in full."""
    if not getattr(config, "is_encoder_decoder", False):
        n = getattr(config, "num_hidden_layers", None)
        return ("num_hidden_layers", n) if isinstance(n, int) and not isinstance(n, bool) else ("", 0)
    for enc, dec in _ENCODER_DECODER_DEPTHS:
        a, b = getattr(config, enc, None), getattr(config, dec, None)
        if isinstance(a, int) and not isinstance(a, bool) and a == b:
            return f"{enc},{dec}", a
    return "", 0


def _first_forward_checked(loss, given: dict[str, Any], config_class, arch: str, spec: str = ""):
    """``loss`` that, until one call has succeeded, reports an error of the forward pass as the config's
    (a shape transformers checks nowhere earlier) in one line. Later errors, out-of-memory, and counting
    on the meta device (FLOP counting falls back to CPU on its errors) pass through unchanged."""
    ok = False

    def checked(m, b):
        nonlocal ok
        if ok:
            return loss(m, b)
        try:
            out = loss(m, b)
        except Exception as e:
            if _is_resource_error(e) or _on_meta(m, b):
                raise
            raise _transformers_error(e, given, config_class, f"{arch}'s forward pass", spec) from None
        ok = True
        return out

    return checked


def _on_meta(model: nn.Module, batch: Any) -> bool:
    p = next(model.parameters(), None)
    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return any(t.device.type == "meta" for t in ([p] if p is not None else []) + leaves)


@contextmanager
def _real_mask_decisions() -> Iterator[None]:
    """Make ``transformers`` take, under fake tensors, the attention-mask branch a real step takes.

    transformers treats a fake tensor like a compile trace: it cannot look at the position ids,
    so it assumes they may hold packed sequences and materialises a (batch, 1, q, kv) mask
    instead of passing ``is_causal=True`` to SDPA -- memory a real step never allocates (on a
    2-layer Llama at 3 x 64 tokens, +196,608 activation bytes, +5% of the peak). Our batches never
    pass position ids or packed sequences, so the model derives them from ``arange``, and the
    real answer is always "not packed"; only that branch is replaced, and only for fake tensors.
    """
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - hf tasks need transformers anyway
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # older/newer transformers without this branch: nothing to replace
        yield
        return

    def find_packed(position_ids):
        if isinstance(position_ids, FakeTensor):
            return None
        return original(position_ids)

    masking_utils.find_packed_sequence_indices = find_packed
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _attach_data(task: GenericTask, kind: str, config, seq_len: int, seed: int, size: int, vocab: int,
                 data: DataSpec | None = None) -> None:
    """The task's data and loss by head: token rows from ``data`` files (causal LMs only), else generated
    samples; then how a batch is counted and an example batch made."""
    def tokens(g):
        return torch.randint(1, vocab, (seq_len,), generator=g)

    if data is not None and kind != "causal":
        raise ConfigError("data", data.data, f"no --data with {task.name} (a {kind} head)",
                          "data files feed the GPT built-ins and hf: causal LMs (...ForCausalLM, ...LMHeadModel)")
    if data is not None:
        _attach_files(task, config, seq_len, vocab, data)
    elif kind == "causal":
        _attach_token_rules(task, seq_len, seed, size, vocab)
    elif kind == "mlm":
        _attach_mlm(task, config, tokens, size, seed)
    elif kind == "seq2seq":
        _attach_seq2seq(task, config, tokens, size, seed)
    elif kind == "seqcls":
        _attach_seqcls(task, config, tokens, size, seed)
    else:  # image
        _attach_image(task, config, size, seed)
    _attach_counting(task)


def _attach_files(task: GenericTask, config, seq_len: int, vocab: int, data: DataSpec) -> None:
    """Token rows from files: the model must hold the tokenizer's ids and the rows' length."""
    text = load_text_data(data)
    max_pos = getattr(config, "max_position_embeddings", None)
    check_model_fits(text, vocab_size=vocab, max_positions=max_pos if isinstance(max_pos, int) else None,
                     seq_len=seq_len, model=task.name)
    task.dataset, task.val_dataset = (lambda: text.train), (lambda: text.val)
    task.collate, task.example_batch = text.collate, text.example_batch
    task.data_source, task.data_description = text.source, text.description
    task.loss = lambda m, b: _token_loss(m(input_ids=b["input_ids"]).logits, b["labels"])


def _attach_token_rules(task: GenericTask, seq_len: int, seed: int, size: int, vocab: int) -> None:
    """A causal LM's generated data: learnable token rules, next-token labels."""
    check_token_rules(vocab, seq_len)
    task.dataset = lambda: TokenRules(size=size, seq_len=seq_len, vocab_size=vocab, seed=seed)
    task.collate = collate_tokens
    task.example_batch = lambda n: full_length_tokens(n, seq_len, vocab, seed)
    task.loss = lambda m, b: _token_loss(m(input_ids=b["input_ids"]).logits, b["labels"])


def _attach_mlm(task: GenericTask, config, tokens, size: int, seed: int) -> None:
    """A masked LM's generated data: random tokens, every :data:`MLM_EVERY`-th one masked and labelled."""
    def make(g):
        ids = tokens(g)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[::MLM_EVERY] = ids[::MLM_EVERY]
        ids = ids.clone()
        ids[::MLM_EVERY] = getattr(config, "mask_token_id", None) or 0
        return {"input_ids": ids, "labels": labels}
    task.dataset = lambda: GeneratedSamples(make, size, seed)
    task.loss = lambda m, b: _token_loss(m(input_ids=b["input_ids"]).logits, b["labels"])


def _attach_seq2seq(task: GenericTask, config, tokens, size: int, seed: int) -> None:
    """An encoder-decoder's generated data: random source tokens, the target the source reversed; the loss
    teacher-forced from the decoder start id."""
    start = getattr(config, "decoder_start_token_id", None)
    start = start if start is not None else (getattr(config, "pad_token_id", None) or 0)

    def make(g):
        ids = tokens(g)
        return {"input_ids": ids, "labels": ids.flip(0)}

    def loss(m, b):
        labels = b["labels"]
        dec = torch.cat([torch.full_like(labels[:, :1], start), labels[:, :-1]], dim=1)  # teacher forcing
        return _token_loss(m(input_ids=b["input_ids"], decoder_input_ids=dec).logits, labels)
    task.dataset = lambda: GeneratedSamples(make, size, seed)
    task.loss = loss


def _attach_seqcls(task: GenericTask, config, tokens, size: int, seed: int) -> None:
    """A sequence classifier's generated data: random tokens, the class the first token mod num_labels."""
    n_labels = config.num_labels

    def make(g):
        ids = tokens(g)
        return {"input_ids": ids, "labels": ids[0] % n_labels}
    task.unit = "samples"
    task.dataset = lambda: GeneratedSamples(make, size, seed)
    task.loss = lambda m, b: (F.cross_entropy(m(input_ids=b["input_ids"]).logits.float(), b["labels"],
                                              reduction="sum"), b["labels"].numel())


def _attach_image(task: GenericTask, config, size: int, seed: int) -> None:
    """An image classifier's generated data: a fixed template per class plus noise, (C, H, W) from the config."""
    c, hw, n_labels = config.num_channels, config.image_size, config.num_labels
    hw = hw if isinstance(hw, int) else hw[0]

    def make(g):
        label = int(torch.randint(0, n_labels, (1,), generator=g))
        template = torch.randn(c, hw, hw, generator=torch.Generator().manual_seed(seed * 7919 + label))
        return {"pixel_values": template + torch.randn(c, hw, hw, generator=g), "labels": torch.tensor(label)}

    def loss(m, b):
        dtype = next(m.parameters()).dtype  # half weights (bf16-true/fp16-true) take half pixels
        logits = m(pixel_values=b["pixel_values"].to(dtype)).logits
        return F.cross_entropy(logits.float(), b["labels"], reduction="sum"), b["labels"].numel()
    task.unit = "samples"
    task.dataset = lambda: GeneratedSamples(make, size, seed)
    task.loss = loss


def _attach_counting(task: GenericTask) -> None:
    """How a batch is counted (samples, or labelled tokens) and, where the data gave none, an example batch."""
    if task.unit == "samples":
        task.count = lambda b: int(b["labels"].numel())
    else:
        task.count = lambda b: int((b["labels"] != IGNORE_INDEX).sum())
    if task.example_batch is None:
        task.example_batch = lambda n: _stack([task.dataset()[i] for i in range(n)])
