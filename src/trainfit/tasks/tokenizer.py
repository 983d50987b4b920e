"""Text -> token ids: the byte tokenizer (nothing to download) or a local Hugging Face ``tokenizer.json``.

Every document the data reads is followed by one end-of-document (EOD) id, so a packed stream keeps
the boundaries and the model learns where a document stops.

* ``byte``: ids 0..255 are the document's UTF-8 bytes, 256 is EOD; vocabulary 257. Any text round-trips
  (``decode(encode(t)) == t``), and the token count of a text is its UTF-8 length (known without tokenizing).
* ``DIR``: ``DIR/tokenizer.json`` loaded with the ``tokenizers`` library. EOD is the tokenizer's end token:
  ``tokenizer_config.json``'s ``eos_token`` (refused when the vocabulary does not hold it), else the first of
  :data:`EOD_NAMES` the vocabulary holds; without one the tokenizer is refused (packing needs it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from trainfit.errors import ConfigError
from trainfit.gate import RECORD, read_document

BYTE = "byte"
BYTE_EOD = 256
BYTE_VOCAB = 257
EOD_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
"""End-of-document tokens looked for in a tokenizer's vocabulary, in this order."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _tokenizers():
    try:
        import tokenizers  # lazy: only --tokenizer DIR needs it
    except ImportError:
        raise ConfigError("tokenizer", "DIR", "byte (the tokenizers package is not installed)",
                          "install it with `pip install 'trainfit[data]'`") from None
    return tokenizers


@dataclass(frozen=True, kw_only=True)
class TextTokenizer:
    """A tokenizer the data reads text with: its ids, its EOD id and where it came from."""

    name: str
    """"byte" or the tokenizer directory (as given)."""
    vocab_size: int
    """Ids are in [0, vocab_size) (added tokens included)."""
    eod_id: int
    """The id appended after every document."""
    sha256: str = ""
    """sha256 of tokenizer.json ("" for byte): what a prepared token file records and checks."""
    backend: Any = field(default=None, repr=False, compare=False)
    """The ``tokenizers.Tokenizer`` (None for byte)."""

    @property
    def directory(self) -> str:
        return "" if self.name == BYTE else self.name

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no EOD, no special tokens added), int64."""
        if self.backend is None:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        return np.asarray(self.backend.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text; a Hugging Face tokenizer encodes the batch on its own threads."""
        if self.backend is None or len(texts) < 2:
            return [self.encode(t) for t in texts]
        return [np.asarray(e.ids, dtype=np.int64) for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def count(self, text: str) -> int | None:
        """Tokens in ``text`` when known without tokenizing (byte: its UTF-8 length), else None."""
        return len(text.encode("utf-8")) if self.backend is None else None

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if int(i) != self.eod_id]
        if self.backend is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.backend.decode(ids)


CONFIG_LIMITS = replace(RECORD, max_int=10**40)
"""Bounds of ``tokenizer_config.json``: the gate's RECORD bounds, with integers up to 10**40 (transformers writes
``model_max_length: 1000000000000000019884624838656``, its int(1e30) for "no limit")."""


def _eos_from_config(directory: Path) -> str | None:
    """``tokenizer_config.json``'s ``eos_token``, read through the gate (RECORD bounds: a machine-written file,
    thousands of added tokens in some); one it cannot read is refused in one line, never silently ignored (the
    end-of-document id would change)."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    config = read_document(path, field="tokenizer", fmt="json", limits=CONFIG_LIMITS)
    eos = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(eos, dict):  # {"content": "</s>", ...} in older files
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def load_tokenizer(spec: str) -> TextTokenizer:
    """``"byte"`` or a directory holding ``tokenizer.json`` -> a :class:`TextTokenizer`.

    Raises:
        ConfigError: naming ``tokenizer``: no such directory, no tokenizer.json, a file ``tokenizers`` cannot
            read, no end-of-document token, or an ``eos_token`` its vocabulary lacks.
    """
    if spec == BYTE:
        return TextTokenizer(name=BYTE, vocab_size=BYTE_VOCAB, eod_id=BYTE_EOD)
    directory = Path(spec)
    path = directory / "tokenizer.json"
    if not directory.is_dir():
        raise ConfigError("tokenizer", spec, '"byte" or an existing directory holding tokenizer.json')
    if not path.is_file():
        raise ConfigError("tokenizer", spec, "a directory holding tokenizer.json",
                          "save one with tokenizer.save(DIR/tokenizer.json) or save_pretrained(DIR)")
    try:
        backend = _tokenizers().Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises bare Exception for a malformed file
        raise ConfigError("tokenizer", spec, "a tokenizer.json the tokenizers library reads",
                          f"{path}: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}") from None
    eos = _eos_from_config(directory)
    if eos is not None and backend.token_to_id(eos) is None:  # never another token in its place (id 0 ...)
        raise ConfigError("tokenizer", spec, "a tokenizer whose eos_token is in its vocabulary",
                          f"{directory / 'tokenizer_config.json'} names eos_token={eos[:80]!r}, which tokenizer.json "
                          "does not hold; name a token it holds, or add this one")
    names = [n for n in (eos, *EOD_NAMES) if n]
    eod = next((backend.token_to_id(n) for n in names if backend.token_to_id(n) is not None), None)
    if eod is None:
        raise ConfigError("tokenizer", spec, "a tokenizer with an end-of-document token",
                          f"its vocabulary holds none of {', '.join(EOD_NAMES)} and tokenizer_config.json names no "
                          "eos_token; add one (e.g. train it with special_tokens=['<|endoftext|>'])")
    return TextTokenizer(name=spec, vocab_size=backend.get_vocab_size(with_added_tokens=True), eod_id=int(eod),
                         sha256=sha256_file(path), backend=backend)
