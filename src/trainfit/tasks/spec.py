"""What data a job reads: :class:`DataSpec`, the RunConfig's data fields checked at construction, and which
tokenizer reads it (:func:`resolve_tokenizer`: the one given, else the model's own, else a prepared directory's).

Pure (no torch): ``trainfit plan`` reads it to key its cache and refuse bad flags before anything is built;
``tasks.files`` reads the files it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from trainfit.errors import ConfigError, check_choice, check_int
from trainfit.tasks.corpus import validation_split
from trainfit.tasks.prepared import is_prepared, read_sidecar
from trainfit.tasks.tokenizer import BYTE, sha256_file

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """What data to read and how to cut it into rows (the RunConfig fields of the same names)."""

    data: str
    """A text file, a directory or glob of text files, .jsonl, .parquet, .csv, a ``datasets`` save_to_disk folder,
    or a ``trainfit prepare`` dir."""
    val_data: str = ""
    """Validation data in any of ``data``'s formats ("" : none, or ``val_fraction``). Left empty with no
    ``val_fraction``, a ``datasets`` DatasetDict's validation split when ``data`` is one (set at construction,
    so every reader of the spec -- train, plan, the run's identity -- sees the same validation data)."""
    val_fraction: float = 0.0
    """Fraction of the documents (the last ones) held out for validation."""
    text_field: str = "text"
    """JSON Lines field / Parquet or CSV column holding the text."""
    text_errors: str = "strict"
    """Bytes that are not UTF-8: "strict" refuses the file, "replace" reads U+FFFD."""
    tokenizer: str = ""
    """"byte", a directory holding tokenizer.json, or "" (a prepared directory's own, else byte);
    :meth:`from_config` puts the model's own here when the RunConfig names none."""
    packing: bool = True
    """Join documents and cut seq_len rows (True) or one padded document per row (False)."""
    seq_len: int = 64
    """T: tokens per row's input."""

    def __post_init__(self) -> None:
        if not isinstance(self.data, str) or not self.data:
            raise ConfigError("data", self.data, "a path to training data")
        object.__setattr__(self, "text_errors", str(self.text_errors))
        check_choice("text_errors", self.text_errors, ("strict", "replace"))
        check_int("seq_len", self.seq_len, minimum=2)
        if not isinstance(self.packing, bool):
            raise ConfigError("packing", self.packing, "on or off (true or false)")
        if not (isinstance(self.val_fraction, (int, float)) and 0.0 <= self.val_fraction < 1.0):
            raise ConfigError("val_fraction", self.val_fraction, "a number in [0, 1)")
        if self.val_fraction and self.val_data:
            raise ConfigError("val_data", self.val_data, "empty when val_fraction is set")
        if not (self.val_data or self.val_fraction):
            object.__setattr__(self, "val_data", validation_split(self.data))

    @classmethod
    def from_config(cls, cfg) -> DataSpec | None:
        """The spec of a RunConfig; None when it reads no files (``data`` empty: the task's generated data)."""
        if not cfg.data:
            return None
        return cls(data=cfg.data, val_data=cfg.val_data, val_fraction=cfg.val_fraction, text_field=cfg.text_field,
                   text_errors=str(cfg.text_errors), packing=cfg.packing, seq_len=cfg.seq_len,
                   tokenizer=resolve_tokenizer(model=cfg.model, data=cfg.data, tokenizer=cfg.tokenizer))


def model_dir(model: str) -> Path | None:
    """The directory an ``hf:`` model spec names (``hf:DIR``: a path separator, a leading dot, or an existing
    directory), absolute; None for a class name, a built-in or a ``module:callable``."""
    spec = model.removeprefix("hf:")
    if spec == model:
        return None
    if "/" in spec or "\\" in spec or spec.startswith(".") or Path(spec).is_dir():
        return Path(spec).expanduser().resolve()
    return None


def resolve_tokenizer(*, model: str, data: str, tokenizer: str) -> str:
    """The tokenizer a job reads ``data`` with: ``tokenizer`` when given; else the model's own (``hf:DIR`` holding
    tokenizer.json: a pretrained model reads the ids it was trained on); else the one a prepared directory was
    made with; else ``"byte"``.

    Raises:
        ConfigError: naming ``tokenizer``: a prepared directory made with another tokenizer than the model's own.
    """
    if tokenizer:
        return tokenizer
    side = read_sidecar(Path(data)) if data and is_prepared(data) else None
    own = model_dir(model)
    if own is not None and (own / TOKENIZER_FILE).is_file():
        if side is not None and side["tokenizer"].get("sha256", "") != sha256_file(own / TOKENIZER_FILE):
            raise ConfigError("tokenizer", str(own), f"the tokenizer {data} was prepared with "
                              f"({side['tokenizer'].get('name', BYTE)})",
                              f"hf:{own} reads the ids of its own {TOKENIZER_FILE}, which differs; re-run trainfit "
                              f"prepare with --tokenizer {own}")
        return str(own)
    return str(side["tokenizer"].get("name", BYTE)) if side is not None else BYTE


class TokenIds(Protocol):
    """What :func:`check_model_fits` reads of the data (``tasks.files.TextData`` has it)."""

    vocab_size: int
    tokenizer_dir: str


def check_model_fits(data: TokenIds, *, vocab_size: int, max_positions: int | None, seq_len: int, model: str) -> None:
    """Refuse a model the data's ids or rows do not fit.

    Raises:
        ConfigError: ``model_config.vocab_size`` (``tokenizer`` for a pretrained directory, whose shape is fixed)
            when the tokenizer has more ids than the model's embedding; ``seq_len`` above the model's positions.
    """
    tokenizer = data.tokenizer_dir or BYTE
    if data.vocab_size > vocab_size:
        if "/" in model or "\\" in model:
            raise ConfigError("tokenizer", tokenizer, f"a tokenizer of at most {vocab_size:,} ids ({model}'s "
                              "vocab_size)", f"this one has {data.vocab_size:,}")
        raise ConfigError("model_config.vocab_size", vocab_size, f"an integer >= {data.vocab_size:,}, the ids of "
                          f"tokenizer {tokenizer}", f"set vocab_size={data.vocab_size} in --model-config")
    if max_positions is not None and seq_len > max_positions:
        raise ConfigError("seq_len", seq_len, f"at most {max_positions:,}, the positions {model} has",
                          "pass a smaller --seq-len")
