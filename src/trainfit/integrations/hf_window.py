"""The user's transformers model, rows and TrainingArguments for ``verify --framework hf-trainer``: any head.

The model is the user's own -- ``hf:DIR`` (a ``save_pretrained`` directory, loaded with ``from_pretrained``)
or ``hf:<Class>`` with ``--model-config`` -- with every dropout at 0 (the Trainer calls ``model.train()``; a
random mask would hide the accumulation in noise). The head decides what one *prediction target* is, which
is what the token mean divides by:

=====================  ==========================================  ==========================================
head                   rows (generated here, lengths uneven)       prediction targets of a row
=====================  ==========================================  ==========================================
causal (ForCausalLM,   random tokens, labels = input_ids (or the   labels[1:] != -100: the model shifts, the
LMHeadModel)           user's ``--data`` rows)                     first label is never predicted
masked (ForMaskedLM)   every 3rd token masked and labelled          labels != -100
token (ForToken...)    a label per token, the first -100 ([CLS])   labels != -100
sequence (ForSeq...)   one class (or value) per row                one per row
seq2seq (encoder-      labels = the row reversed; the model        labels != -100
decoder)               builds its decoder inputs from labels
=====================  ==========================================  ==========================================

The reference is plain PyTorch: each row alone, unpadded, through the same initial weights; the loss computed
here from the model's logits (``sum of per-target CE / all targets`` of the window), never the model's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from trainfit.config import DataSection, LeversSection, ModelSection, RunConfig, RunSection
from trainfit.data import global_indices
from trainfit.errors import ConfigError, TrainfitError, shown
from trainfit.gate import read_document
from trainfit.run import task_of
from trainfit.tasks.corpus import find_sources
from trainfit.tasks.hf import check_pretrained, parse_hf_config, pretrained_dir, quiet_progress
from trainfit.tasks.synthetic import IGNORE_INDEX

HEADS = {"causal": "causal LM", "masked": "masked LM", "token": "token classification",
         "sequence": "sequence classification", "seq2seq": "sequence-to-sequence"}
"""The heads ``verify --framework hf-trainer`` checks, and how reports name them."""
MASK_EVERY = 3
"""masked LM rows: one masked, labelled token in every 3."""
PAD_VALUES = {"labels": -100, "attention_mask": 0, "token_type_ids": 0, "special_tokens_mask": 1,
              "decoder_attention_mask": 0}
"""What a padding collator fills each field with past a row's end (input_ids: the pad id)."""

FORCED = {"per_device_train_batch_size": None, "gradient_accumulation_steps": None, "max_steps": 1,
          "max_grad_norm": 0.0, "report_to": [], "use_cpu": True, "train_sampling_strategy": "sequential",
          "save_strategy": "no", "logging_strategy": "no", "eval_strategy": "no", "disable_tqdm": True,
          "remove_unused_columns": False, "bf16": False, "fp16": False, "fsdp": None, "fsdp_config": None,
          "deepspeed": None, "torch_compile": False, "push_to_hub": False, "load_best_model_at_end": False}
"""TrainingArguments the check sets whatever the user's file says: one fp32 optimizer step in this process,
clipping off (the raw gradient is compared), the rows in order. Everything else of the file is kept."""


def head_of(cls_name: str, config) -> str:
    """The head of a transformers class, or a ConfigError naming the heads checked."""
    if getattr(config, "is_encoder_decoder", False) and cls_name.endswith(("ForConditionalGeneration", "LMHeadModel")):
        return "seq2seq"
    for suffix, head in (("ForCausalLM", "causal"), ("LMHeadModel", "causal"), ("ForMaskedLM", "masked"),
                         ("ForTokenClassification", "token"), ("ForSequenceClassification", "sequence")):
        if cls_name.endswith(suffix):
            return head
    raise ConfigError("model", cls_name, "a transformers model with one of the heads: " + ", ".join(HEADS.values()),
                      "verify --framework hf-trainer compares the Trainer's loss with the token mean of that head")


def _no_dropout(config) -> None:
    """Every dropout probability of the config at 0 (attention dropout is a functional argument, not a module)."""
    for key, value in config.to_dict().items():
        if "drop" in key and isinstance(value, float) and not isinstance(value, bool) and value > 0:
            setattr(config, key, 0.0)


@dataclass
class HFModel:
    """How to build the user's model the same way each call."""

    spec: str
    cls: type
    config: Any
    build: Callable[[], nn.Module]
    head: str


def hf_model(model: ModelSection, run: RunSection) -> HFModel:
    """``hf:DIR`` or ``hf:<Class>``: the class and config, and a factory (same seed, same weights, dropout off).

    Raises:
        ConfigError: not an hf: model, an unreadable directory, a head not checked, a bad --model-config.
    """
    import transformers as tf

    if not model.model.startswith("hf:"):
        raise ConfigError("model", model.model, "hf:DIR or hf:<a transformers class> with --framework hf-trainer",
                          "the Trainer trains transformers models; check a module:callable model with "
                          "--framework accelerate or lightning")
    spec = model.model.removeprefix("hf:")
    directory = pretrained_dir(spec)
    if directory is not None:
        cls, config = _pretrained(tf, directory, model.model_config)
    else:
        cls = getattr(tf, spec, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "config_class")):
            raise ConfigError("model", model.model, "hf:DIR or hf:<a transformers model class>",
                              "check the class name's spelling and case")
        config = parse_hf_config(cls.config_class, model.model_config)
    head = head_of(cls.__name__, config)
    _no_dropout(config)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    if head == "sequence" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # decoders find each row's last token through the pad id
    if head == "seq2seq" and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0  # T5's checkpoints say 0 (pad)

    def build() -> nn.Module:
        torch.manual_seed(run.seed)
        if directory is not None:
            with quiet_progress():
                built = cls.from_pretrained(str(directory), config=config, dtype=torch.float32, local_files_only=True)
        else:
            built = cls(config)
        for m in built.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return built.float().train()

    return HFModel(spec=model.model, cls=cls, config=config, build=build, head=head)


def _pretrained(tf, directory, model_config: str):
    if model_config.strip():
        raise ConfigError("model_config", model_config, "empty with hf:DIR", "a checkpoint's shape is fixed")
    if not (directory / "config.json").is_file():
        raise ConfigError("model", f"hf:{directory}", "a directory holding config.json (as written by save_pretrained)")
    read_document(directory / "config.json", field="model", fmt="json")  # bounded before transformers reads it
    try:
        config = tf.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - JSON errors, an unknown model_type: one line naming the file
        raise ConfigError("model", f"hf:{directory}", "a config.json transformers can read",
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    archs = getattr(config, "architectures", None) or [None]
    cls = getattr(tf, str(archs[0]), None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ConfigError("model", f"hf:{directory}", 'a config.json naming a transformers class in "architectures"')
    check_pretrained(directory, cls, config)  # weights missing, corrupt or not of this config: refused before a build
    return cls, config


# ----------------------------------------------------------------- the user's own code, named when it fails

@contextlib.contextmanager
def blamed(field: str, value: str, allowed: str, who: str) -> Iterator[None]:
    """Run the user's code (their collator, model forward, Trainer, compute_loss) inside the block: any exception
    it raises becomes one :class:`ConfigError` naming their object (``field=value``), what it raised and where
    (``who``, e.g. ``mods:MyTrainer.compute_loss``) -- not a traceback from deep inside the tool. A trainfit
    error raised inside (a nested block naming a more precise object) passes unchanged."""
    try:
        yield
    except TrainfitError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: any exception is theirs, said in one line
        text = str(e).strip().splitlines()
        raise ConfigError(field, value, allowed, f"{who} raised {type(e).__name__}"
                          + (f": {text[0][:160]}" if text else "")) from None


ROW_SHAPED = ("attention_mask", "token_type_ids", "special_tokens_mask")
"""Fields that hold one value per input token, as long as ``input_ids``."""


def _dtype_words(value: Any) -> str:
    """The dtype of what a collator returned, as a user reads it (``str``, ``torch.float32``, ``object``)."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype)
    import numpy as np

    try:
        kind = np.asarray(value).dtype
    except Exception:  # noqa: BLE001 - ragged or exotic: its Python type says enough
        return type(value).__name__
    return {"U": "str", "S": "bytes", "O": "object"}.get(kind.kind, str(kind))


def as_row(batch: Any, refuse: Callable[[str, str], ConfigError]) -> dict[str, torch.Tensor]:
    """One collated row (a batch of one) as tensors without the batch dimension; anything that is not a mapping
    of numeric arrays is refused through ``refuse(allowed, what it returned)``."""
    if not isinstance(batch, Mapping):
        raise refuse("a mapping of field names to tensors (a dict or BatchEncoding)",
                     f"a {type(batch).__name__}: {shown(batch, 60)}")
    row = {}
    for key, value in batch.items():
        try:
            t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        except Exception:  # noqa: BLE001 - strings, ragged lists, objects: not a tensor a model takes
            raise refuse("numeric tensors in every field", f"{key} of dtype {_dtype_words(value)}") from None
        if t.dtype == torch.bool or t.is_complex() or not (t.is_floating_point() or _is_int(t)):
            raise refuse("numeric tensors in every field", f"{key} of dtype {t.dtype}")
        row[str(key)] = t[0] if t.dim() >= 1 and t.shape[0] == 1 else t
    return row


def _is_int(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _bad_values(t: torch.Tensor, high: int | None, *, ignore: bool) -> Any:
    """The first value of ``t`` outside ``[0, high)`` (``-100`` allowed when ``ignore``), else None."""
    bad = t.lt(0) if high is None else (t.lt(0) | t.ge(high))
    if ignore:
        bad &= t.ne(IGNORE_INDEX)
    return t[bad][0].item() if bool(bad.any()) else None


def _id_problem(row: dict[str, torch.Tensor], vocab: int | None) -> tuple[str, str] | None:
    """(what is allowed, what the row holds) when its input_ids are not token ids of the model, else None."""
    ids = row.get("input_ids")
    if ids is None:
        return "input_ids and labels", f"no input_ids (fields: {', '.join(row) or 'none'})"
    if not _is_int(ids):
        return "input_ids of an integer dtype (token ids)", f"input_ids of dtype {ids.dtype}"
    if ids.dim() != 1 or ids.numel() == 0:
        return "input_ids of one row: a 1-D sequence of token ids", f"input_ids of shape {tuple(ids.shape)}"
    bad = _bad_values(ids, vocab, ignore=False)
    if bad is not None:
        return f"input_ids in [0, {vocab}) (the model's vocab_size)", f"input_ids holding {bad}"
    return None


def _label_problem(row: dict[str, torch.Tensor], head: str, config) -> tuple[str, str] | None:
    """(what is allowed, what the row holds) when its labels do not fit the head, else None."""
    labels, n = row.get("labels"), len(row["input_ids"])
    if labels is None:
        return "input_ids and labels", f"no labels (fields: {', '.join(row)})"
    num_labels = getattr(config, "num_labels", None)
    if head == "sequence":
        if labels.numel() != 1:
            return "one label per row", f"labels of shape {tuple(labels.shape)}"
        if num_labels == 1:
            return None if labels.is_floating_point() else ("a float label (num_labels=1: regression)",
                                                            f"labels of dtype {labels.dtype}")
        if not _is_int(labels):
            return "an integer class per row", f"labels of dtype {labels.dtype}"
        bad = _bad_values(labels.reshape(-1), num_labels, ignore=False)
        return None if bad is None else (f"a class in [0, {num_labels}) (the model's num_labels)",
                                         f"labels holding {bad}")
    if not _is_int(labels):
        return "labels of an integer dtype: token ids or -100", f"labels of dtype {labels.dtype}"
    if labels.dim() != 1 or (head != "seq2seq" and len(labels) != n):
        want = "a 1-D sequence" if head == "seq2seq" else f"one label per input id ({n})"
        return f"labels of one row: {want}", f"labels of shape {tuple(labels.shape)}"
    high = num_labels if head == "token" else getattr(config, "vocab_size", None)
    bad = _bad_values(labels, high, ignore=True)
    what = "num_labels" if head == "token" else "vocab_size"
    return None if bad is None else (f"labels in [0, {high}) (the model's {what}) or -100", f"labels holding {bad}")


def _field_problem(row: dict[str, torch.Tensor], forward_params: set[str] | None) -> tuple[str, str] | None:
    n = len(row["input_ids"])
    for key, t in row.items():
        if forward_params is not None and key not in forward_params:
            return "fields the model's forward takes", f"a field {key!r}, which its forward does not take"
        if key in ROW_SHAPED and (t.dim() != 1 or len(t) != n or not _is_int(t)):
            return f"{key}: one integer per input id ({n})", f"{key} of shape {tuple(t.shape)}, dtype {t.dtype}"
        if key == "attention_mask" and bool(((t != 0) & (t != 1)).any()):
            return "attention_mask of 0 and 1", f"attention_mask holding {t[(t != 0) & (t != 1)][0].item()}"
    return None


def _forward_params(cls: type) -> set[str] | None:
    """The keyword arguments ``cls.forward`` takes; None when it takes any (``**kwargs``)."""
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params) - {"self"}


def check_rows(rows: list[dict[str, torch.Tensor]], model: HFModel, field: str, value: str, source: str) -> None:
    """THE check of the rows the Trainer will get, whoever made them (the user's collator, their ``--data``):
    fields the model takes, integer token ids within the vocabulary, labels of the head's dtype, shape and range
    (-100 ignored), masks as long as the ids. A row that breaks one is refused in one line naming ``field=value``
    and saying ``source`` (``--collator mods:fn returned``) and what it held -- before any model sees it.

    Raises:
        ConfigError: the first row that breaks one (with its index)."""
    params = _forward_params(model.cls)
    vocab = getattr(model.config, "vocab_size", None)
    for i, row in enumerate(rows):
        found = _id_problem(row, vocab if isinstance(vocab, int) else None)
        found = found or _label_problem(row, model.head, model.config) or _field_problem(row, params)
        if found:
            allowed, held = found
            raise ConfigError(field, value, f"rows a {HEADS[model.head]} takes: {allowed}",
                              f"{source} {held} for row {i}")


# ----------------------------------------------------------------- rows, targets, the reference

@dataclass
class HFRows:
    """K micro-batches of M rows (transformers' row format: 1-D input_ids, labels), longest first."""

    model: HFModel
    groups: list[list[dict[str, torch.Tensor]]]
    source: str = ""
    """Where the rows came from and how they were collated (said in the report's path)."""

    @property
    def head(self) -> str:
        return self.model.head

    @property
    def pad_id(self) -> int:
        pad = getattr(self.model.config, "pad_token_id", None)
        return pad if isinstance(pad, int) else 0

    def targets(self, row: dict[str, torch.Tensor]) -> int:
        """Prediction targets of one row under the head's token-mean definition."""
        labels = row["labels"]
        if self.head == "sequence":
            return 1
        return int((labels[1:] if self.head == "causal" else labels).ne(IGNORE_INDEX).sum())

    @property
    def counts(self) -> list[int]:
        return [sum(self.targets(r) for r in g) for g in self.groups]

    @property
    def rows(self) -> list[dict[str, torch.Tensor]]:
        return [r for g in self.groups for r in g]

    def model_code(self, method: str) -> contextlib.AbstractContextManager:
        """Where the user's model runs (its ``method``): an exception there is one line naming the model."""
        return blamed("model", self.model.spec, f"a model whose {method} runs on the rows",
                      f"{self.model.cls.__name__}.{method}")

    def collate(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every field right-padded (input_ids with the pad id, labels -100, the masks 0), with an attention mask
        when the rows carry none; per-row scalars (a class) stacked -- what a padding collator does."""
        out: dict[str, torch.Tensor] = {}
        for key in rows[0]:
            ts = [r[key] for r in rows]
            if ts[0].dim() == 0:
                out[key] = torch.stack(ts)
                continue
            t = max(len(x) for x in ts)
            fill = self.pad_id if key == "input_ids" else PAD_VALUES.get(key, 0)
            out[key] = torch.full((len(rows), t), fill, dtype=ts[0].dtype)
            for i, x in enumerate(ts):
                out[key][i, :len(x)] = x
        if "attention_mask" not in out:
            mask = torch.zeros_like(out["input_ids"])
            for i, r in enumerate(rows):
                mask[i, :len(r["input_ids"])] = 1
            out = {"input_ids": out.pop("input_ids"), "attention_mask": mask, **out}
        return out

    def row_loss(self, model: nn.Module, row: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of the row's per-target losses from the model's logits (plain PyTorch, the row alone)."""
        x = {k: v[None] for k, v in row.items() if k != "labels"}  # the row's model inputs, unpadded
        if self.head == "seq2seq":
            x["labels"] = row["labels"][None]  # the model builds its decoder inputs from them, as in the Trainer
        with self.model_code("forward"):
            logits = model(**x).logits[0].float()
        labels = row["labels"]
        if self.head == "sequence":
            if labels.is_floating_point():
                return F.mse_loss(logits.reshape(-1), labels.reshape(-1), reduction="sum")
            return F.cross_entropy(logits.reshape(1, -1), labels.reshape(1), reduction="sum")
        if self.head == "causal":
            logits, labels = logits[:-1], labels[1:]
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")

    def grads(self, model: nn.Module, *, mean_of_means: bool = False) -> list[torch.Tensor]:
        """The token mean's gradient over the window (or the mean over micro-batches of each one's mean)."""
        model.zero_grad(set_to_none=True)
        total = sum(self.counts)
        for group, n in zip(self.groups, self.counts):
            for r in group:
                loss = self.row_loss(model, r)
                (loss / max(n, 1) / len(self.groups) if mean_of_means else loss / total).backward()
        out = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out


def _allowed_ids(config, vocab: int) -> torch.Tensor:
    special = {getattr(config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id",
                                                  "cls_token_id", "sep_token_id", "decoder_start_token_id")}
    ids = torch.tensor([i for i in range(min(vocab, 4096)) if i not in special])
    if len(ids) < 2:
        raise ConfigError("model_config.vocab_size", vocab, "an integer >= 8")
    return ids


def _row(head: str, ids: torch.Tensor, config, g: torch.Generator) -> dict[str, torch.Tensor]:
    if head in ("causal",):
        return {"input_ids": ids, "labels": ids.clone()}
    if head == "masked":
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[1::MASK_EVERY] = ids[1::MASK_EVERY]
        masked = ids.clone()
        mask_id = getattr(config, "mask_token_id", None)
        masked[1::MASK_EVERY] = mask_id if isinstance(mask_id, int) else 0
        return {"input_ids": masked, "labels": labels}
    if head == "token":
        labels = ids % config.num_labels
        labels[0] = IGNORE_INDEX  # the first position is not labelled ([CLS] in a tokenizer's rows)
        return {"input_ids": ids, "labels": labels}
    if head == "seq2seq":
        return {"input_ids": ids, "labels": ids.flip(0)}
    if config.num_labels == 1:  # regression: one value per row
        return {"input_ids": ids, "labels": torch.rand((), generator=g)}
    if getattr(config, "problem_type", None) == "multi_label_classification":
        raise ConfigError("model_config.problem_type", "multi_label_classification",
                          "single_label_classification or regression with --framework hf-trainer")
    return {"input_ids": ids, "labels": ids[0] % config.num_labels}


def hf_rows(cfg: RunConfig, model: HFModel, *, collator: str = "") -> HFRows:
    """K x M rows of clearly different target counts, longest first, cut in K.

    Without ``--data`` the rows are generated (:func:`_row`); with it they are the user's: a causal LM reads any
    data ``train`` reads (packed by its task), every other head -- and any head with ``--collator`` -- the first
    K x M rows of a JSON Lines / CSV / Parquet file (:func:`user_rows`). ``collator`` (``module:callable``) turns
    each row into the model's inputs once, seeded (:func:`collate_rows`); a masked LM without one is masked by
    transformers' ``DataCollatorForLanguageModeling``, as its users' training is.

    Raises:
        ConfigError: seq_len beyond the model's positions; a missing field, tokenizer or collator (one line).
    """
    n, head, config = cfg.micro_batch * cfg.accumulation, model.head, model.config
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and cfg.seq_len + 1 > max_pos:
        raise ConfigError("seq_len", cfg.seq_len, f"below max_position_embeddings={max_pos} of {model.spec}")
    source = ""
    if cfg.data and head == "causal" and not collator:
        task = task_of(cfg)
        ds = task.dataset()
        samples = [ds[i] for i in global_indices(0, n, len(ds), cfg.seed)]
        rows = [{"input_ids": torch.cat([s["input_ids"][:1], s["labels"]]),
                 "labels": torch.cat([s["input_ids"][:1], s["labels"]])} for s in samples]
        source = f"{n} rows of {cfg.data} (the run's first global batch)"
    elif cfg.data:
        tok_dir = tokenizer_dir(cfg.section("data"), model)
        features = user_rows(cfg.section("data"), cfg.section("levers"), model, tok_dir)
        rows, source = collate_rows(cfg.section("run"), model, features, tok_dir, collator)
        if not collator:
            check_rows(rows, model, "data", cfg.data, f"--data {cfg.data} holds")
        source = f"the first {n} rows of {cfg.data}, {source}"
    else:
        g = torch.Generator().manual_seed(cfg.seed)
        vocab = getattr(config, "vocab_size", None)
        if not isinstance(vocab, int):
            raise ConfigError("model", model.spec, "a text model (its config has vocab_size)")
        allowed = _allowed_ids(config, vocab)
        lengths = [max(3, round((cfg.seq_len + 1) * (n - i) / n)) for i in range(n)]  # seq_len+1 down to a few
        rows = [_row(head, allowed[torch.randint(0, len(allowed), (L,), generator=g)], config, g) for L in lengths]
        if collator:
            features = [{k: (v.tolist() if k == "input_ids" or v.dim() else v.item()) for k, v in r.items()
                         if head not in ("masked", "causal") or k == "input_ids"} for r in rows]
            if head == "masked":  # the collator masks: give it the unmasked tokens
                features = [{"input_ids": torch.where(r["labels"] != IGNORE_INDEX, r["labels"],
                                                      r["input_ids"]).tolist()} for r in rows]
            rows, source = collate_rows(cfg.section("run"), model, features, tokenizer_dir(cfg.section("data"), model),
                                        collator)
            source = f"{n} generated rows, {source}"
    out = HFRows(model=model, groups=[], source=source)
    rows.sort(key=lambda r: -out.targets(r) if head != "sequence" else -len(r["input_ids"]))
    m = cfg.micro_batch
    out.groups = [rows[i * m:(i + 1) * m] for i in range(cfg.accumulation)]
    if sum(out.counts) == 0:
        raise TrainfitError("verify --framework hf-trainer: the window's rows hold no prediction target")
    return out


# ----------------------------------------------------------------- the user's own rows and collator

LABEL_FIELDS = ("label", "labels")
"""Where a row's class (sequence classification) or per-token/per-word classes (token classification) are read,
in this order: the names of the Hugging Face datasets and collators."""
TARGET_FIELDS = ("target", "labels")
"""Where a sequence-to-sequence row's target is read: a text (tokenized like the input) or token ids."""
NEEDS = {"causal": "a text field (or input_ids)", "masked": "a text field (or input_ids); the collator masks it",
         "token": "a text field (or input_ids) and labels: one class per word of the text (per id of input_ids)",
         "sequence": "a text field (or input_ids) and a label: one class (or value) per row",
         "seq2seq": "a text field (or input_ids) and a target text (or labels: token ids)"}
"""What one row of ``--data`` must hold for each head."""
MAX_RECORDS = 1_000_000
"""Rows read from a file at most (the check uses the first K x M)."""


def tokenizer_dir(data: DataSection, model: HFModel):
    """The directory whose tokenizer.json reads the rows: ``--tokenizer DIR``, else the model's ``hf:DIR``."""
    if data.tokenizer and data.tokenizer != "byte":
        directory = Path(data.tokenizer)
    else:
        directory = pretrained_dir(model.spec.removeprefix("hf:"))
    if directory is None or not (Path(directory) / "tokenizer.json").is_file():
        raise ConfigError("tokenizer", data.tokenizer or model.spec, "a directory holding tokenizer.json",
                          f"--data rows of a {HEADS[model.head]} (and --collator) are tokenized with the model's own "
                          "tokenizer: save it into the model directory (tokenizer.save_pretrained) or pass "
                          "--tokenizer DIR")
    return Path(directory)


def _backend(directory):
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("tokenizer", str(directory), "an installed tokenizers package",
                          "pip install 'trainfit[data]'") from None
    try:
        return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - the library raises bare Exception for a malformed file
        raise ConfigError("tokenizer", str(directory), "a tokenizer.json the tokenizers library reads",
                          f"{str(e).splitlines()[0][:160] if str(e) else type(e).__name__}") from None


def hf_tokenizer(directory):
    """The directory's tokenizer as transformers loads it (what a collator takes), special tokens included."""
    import transformers as tf

    try:
        with quiet_progress():
            if (directory / "tokenizer_config.json").is_file():
                return tf.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
            return tf.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - one line naming the directory
        raise ConfigError("tokenizer", str(directory), "a tokenizer transformers loads (tokenizer.json)",
                          f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}") from None


def _records(path: str, n: int) -> list[tuple[str, dict[str, Any]]]:
    """The first ``n`` rows of ``path`` as ``(where, row)``: JSON Lines objects, CSV or Parquet rows."""
    import json

    out: list[tuple[str, dict[str, Any]]] = []
    for src in find_sources(path, field="data").files:
        if src.kind == "text":
            raise ConfigError("data", src.path, "JSON Lines, CSV or Parquet rows with fields (text, label, ...)",
                              "a text file is one document with no fields; the heads other than causal LM read rows")
        if src.kind == "jsonl":
            with open(src.path, encoding="utf-8-sig") as f:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError as e:
                        raise ConfigError("data", f"{src.path}:{lineno}", "JSON Lines: one JSON object per line",
                                          f"not JSON: {e}") from None
                    if not isinstance(obj, dict):
                        raise ConfigError("data", f"{src.path}:{lineno}", "a JSON object per line",
                                          f"a JSON {type(obj).__name__}")
                    out.append((f"{src.path}:{lineno}", obj))
                    if len(out) >= n:
                        return out
        else:
            try:
                import pyarrow.csv
                import pyarrow.parquet
            except ImportError:
                raise ConfigError("data", src.path, "JSON Lines (pyarrow is not installed)",
                                  "pip install 'trainfit[data]'") from None
            try:
                table = (pyarrow.parquet.read_table(src.path) if src.kind == "parquet"
                         else pyarrow.csv.read_csv(src.path))
            except Exception as e:  # noqa: BLE001 - pyarrow's errors: one line naming the file
                raise ConfigError("data", src.path, f"a readable {src.kind} file",
                                  str(e).splitlines()[0][:160] if str(e) else type(e).__name__) from None
            for i, row in enumerate(table.slice(0, n - len(out)).to_pylist(), start=1):
                out.append((f"{src.path} row {i}", row))
            if len(out) >= n:
                return out
    return out


def _ids(value: Any, field: str, where: str) -> list[int]:
    """A list of ints from a JSON list or a CSV cell of whitespace-separated ints."""
    if isinstance(value, str):
        value = value.replace(",", " ").replace("[", " ").replace("]", " ").split()
    try:
        return [int(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError("data", where, f"{field}: a list of integers",
                          f"it holds {str(value)[:60]!r}") from None


def _missing(field: str, where: str, head: str, row: Mapping[str, Any]) -> ConfigError:
    keys = ", ".join(list(row)[:10]) or "no fields"
    return ConfigError("data", where, f"a row with {field}: a {HEADS[head]} needs {NEEDS[head]}",
                       f"it holds {keys}" + ("; pass --text-field NAME" if "text" in field else ""))


def user_rows(data: DataSection, levers: LeversSection, model: HFModel, tok_dir) -> list[dict[str, Any]]:
    """The first K x M rows of ``--data`` as a tokenized dataset's rows (``input_ids`` and, by head, ``labels``):
    text tokenized by ``tok_dir``'s tokenizer.json with its special tokens (what ``tokenizer(text)`` gives),
    token classes aligned to the first token of each word (-100 elsewhere, as transformers' token-classification
    examples do), everything cut at ``seq_len``.

    Raises:
        ConfigError: fewer rows than K x M; a row missing a field the head needs, naming the field, the file and
            row, and what the head needs; a class outside ``num_labels``.
    """
    n, head, config = levers.micro_batch * levers.accumulation, model.head, model.config
    records = _records(data.data, n)
    if len(records) < n:
        raise ConfigError("data", data.data, f"at least micro_batch x accumulation = {n} rows",
                          f"it holds {len(records)}")
    backend = _backend(tok_dir)
    cut = data.seq_len
    num_labels = getattr(config, "num_labels", None)
    out = []
    for where, rec in records:
        ids, words = _input_ids(rec, where, head, backend, data.text_field)
        ids = ids[:cut]
        row: dict[str, Any] = {"input_ids": ids}
        if head == "sequence":
            row["labels"] = _sequence_label(rec, where, num_labels)
        elif head == "token":
            row["labels"] = _token_labels(rec, where, ids, words, num_labels, data.text_field)
        elif head == "seq2seq":
            row["labels"] = _seq2seq_labels(rec, where, backend)[:cut]
        elif head == "causal":
            row["labels"] = list(ids)
        out.append(row)
    return out


def _input_ids(rec: Mapping[str, Any], where: str, head: str, backend,
               text_field: str) -> tuple[list[int], list[int | None] | None]:
    """A row's token ids -- its ``input_ids``, else its text tokenized by ``backend`` -- and, for a text, the word
    of each token (None where the ids were given)."""
    if "input_ids" in rec:
        return _ids(rec["input_ids"], "input_ids", where), None
    if isinstance(rec.get(text_field), str):
        enc = backend.encode(rec[text_field])
        return list(enc.ids), list(enc.word_ids)
    raise _missing(f"a {text_field!r} field" + (" (a string)" if text_field in rec else ""), where, head, rec)


def _sequence_label(rec: Mapping[str, Any], where: str, num_labels: Any) -> int | float:
    """A sequence classification row's label: a value (``num_labels`` 1, regression) or a class id."""
    label = next((rec[k] for k in LABEL_FIELDS if rec.get(k) is not None), None)
    if label is None:
        raise _missing("a 'label' field", where, "sequence", rec)
    if num_labels == 1:
        return float(label)
    try:
        value = int(label)
    except (TypeError, ValueError):
        raise ConfigError("data", where, f"label: a class id in [0, {num_labels})",
                          f"it holds {str(label)[:40]!r}") from None
    if not 0 <= value < (num_labels or 0):
        raise ConfigError("data", where, f"label: a class id in [0, {num_labels}) (the model's "
                          "num_labels)", f"it holds {value}")
    return value


def _token_labels(rec: Mapping[str, Any], where: str, ids: list[int], words: list[int | None] | None,
                  num_labels: Any, text_field: str) -> list[int]:
    """A token classification row's labels: one class per id of ``input_ids``, or one per word of the text put on
    the word's first token (-100 on the others)."""
    field = next((k for k in LABEL_FIELDS if rec.get(k) is not None), None)
    if field is None:
        raise _missing("a 'labels' field", where, "token", rec)
    if isinstance(rec[field], (int, float)):
        raise ConfigError("data", where, f"{field}: a list of classes, one per word of {text_field!r} "
                          "(a token classification labels every word)", f"it holds one value {rec[field]!r}")
    classes = _ids(rec[field], field, where)
    if words is None:
        if len(classes) < len(ids):
            raise ConfigError("data", where, f"{field}: one class per id of input_ids ({len(ids)})",
                              f"it holds {len(classes)}")
        labels = classes[:len(ids)]
    else:
        n_words = len({w for w in words if w is not None})
        if len(classes) != n_words:
            raise ConfigError("data", where, f"{field}: one class per word of {text_field!r} "
                              f"({n_words} words as the tokenizer splits it)", f"it holds {len(classes)}")
        labels, last = [], None
        for w in words[:len(ids)]:
            labels.append(classes[w] if w is not None and w != last else -100)
            last = w
    bad = [c for c in labels if c != -100 and not 0 <= c < (num_labels or 0)]
    if bad:
        raise ConfigError("data", where, f"{field}: class ids in [0, {num_labels}) or -100",
                          f"it holds {bad[0]}")
    return labels


def _seq2seq_labels(rec: Mapping[str, Any], where: str, backend) -> list[int]:
    """A sequence-to-sequence row's target ids (uncut): its target text tokenized by ``backend``, or its ids."""
    field = next((k for k in TARGET_FIELDS if rec.get(k) is not None), None)
    if field is None:
        raise _missing("a 'target' field", where, "seq2seq", rec)
    value = rec[field]
    return list(backend.encode(value).ids) if isinstance(value, str) else _ids(value, field, where)


def import_spec(spec: str, field: str, what: str) -> Any:
    import importlib

    mod_name, _, attr = spec.rpartition(":")
    if not mod_name or not attr:
        raise ConfigError(field, spec, f"module:callable ({what})")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - ImportError, or the module failing at import
        raise ConfigError(field, spec, f"an importable module:callable ({what})",
                          f"importing {mod_name!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                          ) from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if obj is None:
        raise ConfigError(field, spec, f"module:callable ({what})", f"{mod_name!r} has no attribute {attr!r}")
    return obj


def load_collator(spec: str, tokenizer: Any) -> tuple[Callable[[list[dict[str, Any]]], Any], str]:
    """``module:callable`` -> (the collator, its name). A class (``transformers:DataCollatorWithPadding``) or a
    function taking ``tokenizer`` is called with the model's tokenizer; any other callable is the collator.

    Raises:
        ConfigError: not importable, or building it failed (one line naming the spec).
    """
    import inspect

    obj = import_spec(spec, "collator", "a data collator, its class, or a function of tokenizer returning one")
    if not callable(obj):
        raise ConfigError("collator", spec, "a callable: a data collator, its class, or a function of tokenizer",
                          f"it is a {type(obj).__name__}")
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        params = {}
    try:
        if isinstance(obj, type):
            collator = obj(tokenizer=tokenizer) if "tokenizer" in params else obj()
        elif "tokenizer" in params and len(params) == 1 or list(params)[:1] == ["tokenizer"]:
            collator = obj(tokenizer=tokenizer)
        else:
            collator = obj
    except Exception as e:  # noqa: BLE001 - one line naming the spec
        raise ConfigError("collator", spec, "a collator built from the model's tokenizer",
                          f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}") from None
    if not callable(collator):
        raise ConfigError("collator", spec, "a callable collator (features -> batch)",
                          f"it returned a {type(collator).__name__}")
    return collator, type(collator).__name__ if not inspect.isfunction(collator) else collator.__name__


def row_seed(seed: int, i: int) -> int:
    """The seed the ``i``-th row of the window is collated under (torch, ``random`` and numpy): ``seed + i``."""
    return seed + i


def _seeded(fn: Callable[[list[dict[str, Any]]], Any], features: list[dict[str, Any]], seed: int) -> Any:
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            return fn(features)
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def collate_rows(run: RunSection, model: HFModel, features: list[dict[str, Any]], tok_dir,
                 spec: str) -> tuple[list[dict[str, torch.Tensor]], str]:
    """Each row through the collator alone, once, under :func:`row_seed` (a random mask is drawn once and every
    run -- the Trainer at K x M, at 1 x KM and the reference -- sees the same): the rows the Trainer pads together.

    Without ``spec``: a masked LM's rows go through ``DataCollatorForLanguageModeling(tokenizer, mlm=True)``;
    the other heads' rows are their tensors as read.

    Raises:
        ConfigError: a collator that cannot be built or fails on a row, or returns no labels (one line).
    """
    import transformers as tf

    name = spec
    if spec:
        collator, name = load_collator(spec, hf_tokenizer(tok_dir))
        name = f"{name} ({spec})"
    elif model.head == "masked":
        tok = hf_tokenizer(tok_dir)
        if tok.mask_token is None:
            raise ConfigError("tokenizer", str(tok_dir), "a tokenizer with a mask token for a masked LM",
                              "its tokenizer_config.json names no mask_token; pass --collator module:callable")
        collator, name = tf.DataCollatorForLanguageModeling(tokenizer=tok, mlm=True), "DataCollatorForLanguageModeling"
        name = f"{name}(mlm=True), transformers' default for a masked LM"
    else:
        rows = [{k: torch.tensor(v) for k, v in f.items()} for f in features]
        return rows, (f"tokenized by {tok_dir / 'tokenizer.json'}, no --collator: padded as "
                      "DataCollatorWithPadding pads")
    rows = []
    said = f"--collator {spec}" if spec else name
    for i, f in enumerate(features):
        with blamed("collator", spec or name, f"a collator of rows with {', '.join(f)} (a {HEADS[model.head]})",
                    said):
            batch = _seeded(collator, [dict(f)], row_seed(run.seed, i))

        def refuse(allowed: str, held: str, i: int = i) -> ConfigError:
            return ConfigError("collator", spec or name, f"a collator returning {allowed}",
                               f"{said} returned {held} for row {i}")

        rows.append(as_row(batch, refuse))
    if spec:  # the default collator's rows are the data's: hf_rows checks them as --data
        check_rows(rows, model, "collator", spec, f"{said} returned")
    return rows, f"collated by {name}, each row once (seed {run.seed} + its index)"


def replaced(user: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The user's TrainingArguments settings the check replaces (:data:`FORCED`), as ``key=value (file: ...)``;
    the batch size and accumulation are the split checked, not replaced."""
    user = user or {}
    return tuple(f"{k}={v!r} (file: {user[k]!r})" for k, v in FORCED.items()
                 if v is not None and k in user and user[k] is not None and user[k] != v)


def training_arguments(tf, user: Mapping[str, Any] | None, *, output_dir: str, micro_batch: int,
                       accumulation: int, seed: int) -> Any:
    """The user's TrainingArguments (from their file) with :data:`FORCED` over them.

    Raises:
        ConfigError: the file's values are not TrainingArguments this transformers accepts.
    """
    fields = {f.name for f in dataclasses.fields(tf.TrainingArguments) if f.init}
    kept = {k: v for k, v in (user or {}).items() if k in fields}
    forced = {**FORCED, "output_dir": output_dir, "per_device_train_batch_size": micro_batch,
              "gradient_accumulation_steps": accumulation, "seed": seed}
    try:
        return tf.TrainingArguments(**{**kept, **forced})
    except (TypeError, ValueError) as e:
        raise ConfigError("from", "TrainingArguments", "settings this transformers accepts",
                          f"transformers: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
