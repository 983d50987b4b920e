"""``trainfit prepare`` as a library call: tokenize data once into a memory-mappable token file.

    from trainfit.front.prepare import prepare
    r = prepare(data="corpus/*.txt", out="tokens")        # then train(data="tokens", ...)
    r.n_tokens, r.out

Packing or padding is chosen when training (``packing``), so one prepared directory serves both.
"""

from __future__ import annotations

import sys

import trainfit.logs as logs
from trainfit.errors import ConfigError, check_choice
from trainfit.outputs import check_output_dir, check_path_text
from trainfit.progress import bars_enabled
from trainfit.results import PrepareReport
from trainfit.tasks.corpus import check_text_field, find_sources, read_pieces, reads_under
from trainfit.tasks.prepared import clean_stale, is_prepared, write_prepared
from trainfit.tasks.tokenizer import BYTE, load_tokenizer
from trainfit.vocabulary import TextErrors


def prepare(*, data: str, out: str, tokenizer: str = BYTE, text_field: str = "text", text_errors: str = "strict",
            force: bool = False, progress: bool | None = None) -> PrepareReport:
    """Tokenize ``data`` (text files, a directory or glob of them, .jsonl, .parquet, .csv) into ``out``.

    Args:
        tokenizer: ``"byte"`` or a directory holding ``tokenizer.json``.
        text_field: the JSON Lines field / Parquet or CSV column holding the text.
        text_errors: bytes that are not UTF-8: ``"strict"`` (refuse) or ``"replace"`` (U+FFFD).
        force: write into an existing non-empty ``out``.
        progress: a progress bar on stderr (default: when stderr is a terminal and ``--quiet`` is not given).
    Returns:
        What was written: documents, tokens, vocabulary, token dtype, tokenizer.
    Raises:
        ConfigError: a bad option or path (one line, as ``trainfit prepare`` says it), before anything is read.
    """
    check_choice("text_errors", text_errors, tuple(str(e) for e in TextErrors))
    if not isinstance(text_field, str) or not text_field.strip():
        raise ConfigError("text_field", text_field, "a non-empty field or column name")
    data = check_path_text("data", data)
    where = check_output_dir("--out", out, force=force)  # checked before anything is read
    if is_prepared(data):
        raise ConfigError("data", data, "raw data: text files, .jsonl, .parquet or .csv",
                          "it is a prepared directory already; pass it to train --data as it is")
    if reads_under(data, where):
        raise ConfigError("--out", str(where), "a directory outside the data --data reads",
                          f"{data} would read what prepare writes there; choose --out elsewhere")
    tok = load_tokenizer(check_path_text("tokenizer", tokenizer))
    sources = find_sources(data)
    check_text_field(sources, text_field)  # on text files it would be ignored
    logs.accept()  # every option and path is checked: what was held prints, the bar and notes write through
    removed = clean_stale(where)  # accepted: a killed prepare's marked temporary directory is garbage now
    pieces = read_pieces(sources, text_field=text_field, text_errors=text_errors)
    side = write_prepared(where, pieces=pieces, tokenizer=tok, sources=sources, text_field=text_field, data=data,
                          progress=(sys.stderr.isatty() and bars_enabled()) if progress is None else progress)
    return PrepareReport(out=str(where), n_documents=side["n_documents"], n_tokens=side["n_tokens"],
                         skipped_documents=side["skipped_documents"], vocab_size=side["vocab_size"],
                         eod_id=side["eod_id"], dtype=side["dtype"], tokenizer=side["tokenizer"]["name"],
                         removed_stale=tuple(removed))
