"""``trainfit prepare``: tokenize data once into a memory-mappable token file that ``train --data DIR`` reads.

    trainfit prepare --data 'corpus/**/*.txt' --out tokens/
    trainfit prepare --data docs.jsonl --text-field body --tokenizer my_tokenizer/ --out tokens/ --json

Packing or padding is chosen when training (``--packing``), so one prepared directory serves both. The work is
:func:`trainfit.front.prepare.prepare`; this module turns flags into its arguments and prints what it wrote.
"""

from __future__ import annotations

import sys

from trainfit.front.prepare import prepare
from trainfit.gate import listed
from trainfit.outputs import dumps_json
from trainfit.progress import info

JSON_KEYS = ("out", "n_documents", "n_tokens", "skipped_documents", "vocab_size", "eod_id", "dtype", "tokenizer")
"""Keys --json prints."""


def run(args) -> int:
    r = prepare(data=args.data, out=args.out, tokenizer=args.tokenizer, text_field=args.text_field,
                text_errors=args.text_errors, force=args.force)
    if r.removed_stale:  # said after the job, so that a refusal stays one line
        print(f"trainfit: removed {len(r.removed_stale)} directory(ies) left by a prepare that was killed: "
              f"{listed(r.removed_stale)}", file=sys.stderr)
    summary = {k: getattr(r, k) for k in JSON_KEYS}
    if args.json:
        print(dumps_json(summary))
    else:
        print(f"prepared {r.out}: {r.n_documents:,} documents, {r.n_tokens:,} tokens ({r.dtype}, "
              f"tokenizer {r.tokenizer}, vocabulary {r.vocab_size:,})"
              + (f"; {r.skipped_documents:,} empty document(s) skipped" if r.skipped_documents else ""))
        info("prepare", f"train on it with: trainfit train --data {r.out}")  # a hint: --quiet drops it
    return 0
