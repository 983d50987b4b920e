"""``trainfit prepare``'s flags (the command: :mod:`trainfit.commands.prepare`)."""

from __future__ import annotations

from trainfit.commands.flags import add_output_group

BYTE = "byte"
"""The byte tokenizer's name: a mirror of ``trainfit.tasks.tokenizer.BYTE``, whose module imports numpy."""


def register(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize data once into DIR/tokens.bin for fast loading (train --data DIR)")
    data = p.add_argument_group("data")
    data.add_argument("--data", required=True,
                      help="text file, directory or glob of text files, .jsonl, .parquet, .csv")
    data.add_argument("--tokenizer", default=BYTE, help="byte (default) or a directory holding tokenizer.json")
    data.add_argument("--text-field", default="text", help="JSON Lines field / Parquet or CSV column (default text)")
    data.add_argument("--text-errors", default="strict", help="bytes that are not UTF-8: strict (refuse) or replace")
    out = add_output_group(p)
    out.add_argument("--out", required=True, help="the directory to write (new or empty unless --force)")
    out.add_argument("--force", action="store_true", help="write into an existing non-empty --out")
    out.add_argument("--json", action="store_true", help="print one JSON object on stdout")
