"""Load a model trainfit exported (RUN_DIR/model) with `transformers` alone, and generate a few tokens.

    python examples/generate.py RUN_DIR/model [--prompt TEXT] [--tokens N]
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--tokens", type=int, default=24)
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    ids = tok(args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    print(tok.decode(out[0], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
