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

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from trainfit.config import RunConfig
from trainfit.data import global_indices
from trainfit.errors import ConfigError, TrainfitError
from trainfit.run import task_of
from trainfit.tasks.hf import parse_hf_config, pretrained_dir, quiet_progress, weight_files
from trainfit.tasks.synthetic import IGNORE_INDEX

HEADS = {"causal": "causal LM", "masked": "masked LM", "token": "token classification",
         "sequence": "sequence classification", "seq2seq": "sequence-to-sequence"}
"""The heads ``verify --framework hf-trainer`` checks, and how reports name them."""
MASK_EVERY = 3
"""masked LM rows: one masked, labelled token in every 3."""

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


def load_hf_model(cfg: RunConfig) -> HFModel:
    """``hf:DIR`` or ``hf:<Class>``: the class and config, and a factory (same seed, same weights, dropout off).

    Raises:
        ConfigError: not an hf: model, an unreadable directory, a head not checked, a bad --model-config.
    """
    import transformers as tf  # noqa: PLC0415 - the caller checked it is installed (an optional extra)

    if not cfg.model.startswith("hf:"):
        raise ConfigError("model", cfg.model, "hf:DIR or hf:<a transformers class> with --framework hf-trainer",
                          "the Trainer trains transformers models; check a module:callable model with "
                          "--framework accelerate or lightning")
    spec = cfg.model.removeprefix("hf:")
    directory = pretrained_dir(spec)
    if directory is not None:
        cls, config = _pretrained(tf, directory, cfg.model_config)
    else:
        cls = getattr(tf, spec, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "config_class")):
            raise ConfigError("model", cfg.model, "hf:DIR or hf:<a transformers model class>",
                              "check the class name's spelling and case")
        config = parse_hf_config(cls.config_class, cfg.model_config)
    head = head_of(cls.__name__, config)
    _no_dropout(config)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    if head == "sequence" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # decoders find each row's last token through the pad id
    if head == "seq2seq" and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0  # T5's checkpoints say 0 (pad)

    def build() -> nn.Module:
        torch.manual_seed(cfg.seed)
        if directory is not None:
            with quiet_progress():
                model = cls.from_pretrained(str(directory), config=config, dtype=torch.float32, local_files_only=True)
        else:
            model = cls(config)
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return model.float().train()

    return HFModel(spec=cfg.model, cls=cls, config=config, build=build, head=head)


def _pretrained(tf, directory, model_config: str):
    if model_config.strip():
        raise ConfigError("model_config", model_config, "empty with hf:DIR", "a checkpoint's shape is fixed")
    if not (directory / "config.json").is_file():
        raise ConfigError("model", f"hf:{directory}", "a directory holding config.json (as written by save_pretrained)")
    try:
        config = tf.AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - JSON errors, an unknown model_type: one line naming the file
        raise ConfigError("model", f"hf:{directory}", "a config.json transformers can read",
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    archs = getattr(config, "architectures", None) or [None]
    cls = getattr(tf, str(archs[0]), None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ConfigError("model", f"hf:{directory}", 'a config.json naming a transformers class in "architectures"')
    weight_files(directory)  # missing or corrupt weights are refused before anything is built
    return cls, config


# ----------------------------------------------------------------- rows, targets, the reference

@dataclass
class HFRows:
    """K micro-batches of M rows (transformers' row format: 1-D input_ids, labels), longest first."""

    model: HFModel
    groups: list[list[dict[str, torch.Tensor]]]

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

    def collate(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-padded input_ids with an attention mask; padded labels -100 (what a padding collator does)."""
        t = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), t), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), t), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r["input_ids"])], mask[i, :len(r["input_ids"])] = r["input_ids"], 1
        out = {"input_ids": ids, "attention_mask": mask}
        if rows[0]["labels"].dim() == 0:
            out["labels"] = torch.stack([r["labels"] for r in rows])
        else:
            tl = max(len(r["labels"]) for r in rows)
            out["labels"] = torch.full((len(rows), tl), IGNORE_INDEX, dtype=torch.long)
            for i, r in enumerate(rows):
                out["labels"][i, :len(r["labels"])] = r["labels"]
        return out

    def row_loss(self, model: nn.Module, row: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sum of the row's per-target losses from the model's logits (plain PyTorch, the row alone)."""
        x = {"input_ids": row["input_ids"][None]}
        if self.head == "seq2seq":
            x["labels"] = row["labels"][None]  # the model builds its decoder inputs from them, as in the Trainer
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


def hf_rows(cfg: RunConfig, model: HFModel) -> HFRows:
    """K x M rows of clearly different lengths (``--data`` rows for a causal LM), longest first, cut in K.

    Raises:
        ConfigError: --data with a head other than causal LM; seq_len beyond the model's positions.
    """
    n, head, config = cfg.micro_batch * cfg.accumulation, model.head, model.config
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and cfg.seq_len + 1 > max_pos:
        raise ConfigError("seq_len", cfg.seq_len, f"below max_position_embeddings={max_pos} of {model.spec}")
    if cfg.data:
        if head != "causal":
            raise ConfigError("data", cfg.data, f"no --data with a {HEADS[head]} (--framework hf-trainer)",
                              "text data feeds causal LMs; the other heads are checked on generated rows")
        task = task_of(cfg)
        ds = task.dataset()
        samples = [ds[i] for i in global_indices(0, n, len(ds), cfg.seed)]
        rows = [{"input_ids": torch.cat([s["input_ids"][:1], s["labels"]]),
                 "labels": torch.cat([s["input_ids"][:1], s["labels"]])} for s in samples]
    else:
        g = torch.Generator().manual_seed(cfg.seed)
        vocab = getattr(config, "vocab_size", None)
        if not isinstance(vocab, int):
            raise ConfigError("model", model.spec, "a text model (its config has vocab_size)")
        allowed = _allowed_ids(config, vocab)
        lengths = [max(3, round((cfg.seq_len + 1) * (n - i) / n)) for i in range(n)]  # seq_len+1 down to a few
        rows = [_row(head, allowed[torch.randint(0, len(allowed), (L,), generator=g)], config, g) for L in lengths]
    out = HFRows(model=model, groups=[])
    rows.sort(key=lambda r: -out.targets(r) if head != "sequence" else -len(r["input_ids"]))
    m = cfg.micro_batch
    out.groups = [rows[i * m:(i + 1) * m] for i in range(cfg.accumulation)]
    if sum(out.counts) == 0:
        raise TrainfitError("verify --framework hf-trainer: the window's rows hold no prediction target")
    return out


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
