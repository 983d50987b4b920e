"""``trainfit prepare``: tokenize data once into a memory-mappable token file that ``train --data DIR`` reads.

    trainfit prepare --data 'corpus/**/*.txt' --out tokens/
    trainfit prepare --data docs.jsonl --text-field body --tokenizer my_tokenizer/ --out tokens/ --json

Packing or padding is chosen when training (``--packing``), so one prepared directory serves both.
"""

from __future__ import annotations

import sys

from trainfit.errors import ConfigError, check_choice
from trainfit.outputs import check_output_dir, check_path_text, dumps_json
from trainfit.tasks.corpus import find_sources, read_pieces, reads_under
from trainfit.tasks.prepared import clean_stale, is_prepared, write_prepared
from trainfit.tasks.tokenizer import BYTE, load_tokenizer
from trainfit.vocabulary import TextErrors

JSON_KEYS = ("out", "n_documents", "n_tokens", "skipped_documents", "vocab_size", "eod_id", "dtype", "tokenizer")
"""Keys --json prints."""


def register(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize data once into DIR/tokens.bin for fast loading (train --data DIR)")
    p.add_argument("--data", required=True, help="text file, directory or glob of text files, .jsonl, .parquet, .csv")
    p.add_argument("--tokenizer", default=BYTE, help="byte (default) or a directory holding tokenizer.json")
    p.add_argument("--text-field", default="text", help="JSON Lines field / Parquet or CSV column (default text)")
    p.add_argument("--text-errors", default="strict", help="bytes that are not UTF-8: strict (refuse) or replace")
    p.add_argument("--out", required=True, help="the directory to write (new or empty unless --force)")
    p.add_argument("--force", action="store_true", help="write into an existing non-empty --out")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=run)


def run(args) -> int:
    check_choice("text_errors", args.text_errors, tuple(str(e) for e in TextErrors))
    if not args.text_field.strip():
        raise ConfigError("text_field", args.text_field, "a non-empty field or column name")
    data = check_path_text("data", args.data)
    out = check_output_dir("--out", args.out, force=args.force)  # checked before anything is read
    if is_prepared(data):
        raise ConfigError("data", data, "raw data: text files, .jsonl, .parquet or .csv",
                          "it is a prepared directory already; pass it to train --data as it is")
    if reads_under(data, out):
        raise ConfigError("--out", str(out), "a directory outside the data --data reads",
                          f"{data} would read what prepare writes there; choose --out elsewhere")
    tokenizer = load_tokenizer(check_path_text("tokenizer", args.tokenizer))
    sources = find_sources(data)
    removed = clean_stale(out)  # accepted: a killed prepare's OUT.tmp-<pid> is garbage now
    pieces = read_pieces(sources, text_field=args.text_field, text_errors=args.text_errors)
    side = write_prepared(out, pieces=pieces, tokenizer=tokenizer, sources=sources, text_field=args.text_field,
                          data=data, progress=sys.stderr.isatty())
    if removed:  # said after the job, so that a refusal stays one line
        print(f"trainfit: removed {len(removed)} directory(ies) left by a prepare that was killed: "
              f"{', '.join(removed)}", file=sys.stderr)
    summary = {"out": str(out), **{k: side[k] for k in JSON_KEYS[1:-1]}, "tokenizer": side["tokenizer"]["name"]}
    if args.json:
        print(dumps_json(summary))
    else:
        print(f"prepared {out}: {side['n_documents']:,} documents, {side['n_tokens']:,} tokens ({side['dtype']}, "
              f"tokenizer {summary['tokenizer']}, vocabulary {side['vocab_size']:,})"
              + (f"; {side['skipped_documents']:,} empty document(s) skipped" if side["skipped_documents"] else ""))
        print(f"train on it with: trainfit train --data {out}", file=sys.stderr)
    return 0
