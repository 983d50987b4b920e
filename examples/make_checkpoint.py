"""Make a local `transformers` checkpoint and tokenizer to fine-tune, with nothing downloaded.

    python examples/make_checkpoint.py OUT_DIR [--corpus GLOB]

Writes OUT_DIR/ with a tiny Llama (config.json + model.safetensors, via ``save_pretrained``) and a
byte-level BPE tokenizer trained on the corpus (tokenizer.json + tokenizer_config.json), so
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and ``AutoTokenizer.from_pretrained(OUT_DIR)`` load it.
The weights are random (a stand-in for a checkpoint you would download); the default corpus is the
Python standard library's own source, which ships with every Python.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

STDLIB = os.path.dirname(json.__file__).rsplit(os.sep, 1)[0]  # .../lib/python3.X
DEFAULT_CORPUS = os.path.join(STDLIB, "json", "*.py")
EOS = "<|endoftext|>"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write (must not exist)")
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help=f"glob of text files for the tokenizer ({DEFAULT_CORPUS})")
    p.add_argument("--vocab-size", type=int, default=512)
    args = p.parse_args()
    out = Path(args.out)
    if out.exists():
        print(f"make_checkpoint: {out} exists; choose a new directory", file=sys.stderr)
        return 2
    files = sorted(glob.glob(args.corpus, recursive=True))
    if not files:
        print(f"make_checkpoint: --corpus {args.corpus!r} matches no file", file=sys.stderr)
        return 2

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=args.vocab_size, special_tokens=[EOS],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=344,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, eos_token_id=tok.token_to_id(EOS),
                         bos_token_id=tok.token_to_id(EOS), tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: LlamaForCausalLM, {n:,} parameters; tokenizer: BPE, {tok.get_vocab_size()} tokens "
          f"trained on {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
