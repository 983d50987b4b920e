"""What data a job reads: :class:`DataSpec`, the RunConfig's data fields checked at construction.

Pure (no torch): ``trainfit plan`` reads it to key its cache and refuse bad flags before anything is built;
``tasks.files`` reads the files it names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from trainfit.errors import ConfigError, check_choice, check_int
from trainfit.tasks.tokenizer import BYTE


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """What data to read and how to cut it into rows (the RunConfig fields of the same names)."""

    data: str
    """A text file, a directory or glob of text files, .jsonl, .parquet, .csv, or a ``trainfit prepare`` dir."""
    val_data: str = ""
    """Validation data in any of ``data``'s formats ("" : none, or ``val_fraction``)."""
    val_fraction: float = 0.0
    """Fraction of the documents (the last ones) held out for validation."""
    text_field: str = "text"
    """JSON Lines field / Parquet or CSV column holding the text."""
    text_errors: str = "strict"
    """Bytes that are not UTF-8: "strict" refuses the file, "replace" reads U+FFFD."""
    tokenizer: str = BYTE
    """"byte" or a directory holding tokenizer.json."""
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

    @classmethod
    def from_config(cls, cfg) -> DataSpec | None:
        """The spec of a RunConfig; None when it reads no files (``data`` empty: the task's generated data)."""
        if not cfg.data:
            return None
        return cls(data=cfg.data, val_data=cfg.val_data, val_fraction=cfg.val_fraction, text_field=cfg.text_field,
                   text_errors=str(cfg.text_errors), tokenizer=cfg.tokenizer, packing=cfg.packing, seq_len=cfg.seq_len)


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
