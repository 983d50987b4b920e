"""Loader throughput from a prepared token file vs tokenizing on the fly, and what it does to a training step.

Corpus: the Python standard library's own source files (nothing downloaded), one document per file, written as
JSON Lines. A BPE ``tokenizer.json`` is trained on the same text with the ``tokenizers`` library.

1. Loader tokens/s (label-bearing tokens of micro-batches of 8 rows, ``--packing off``, seq_len 512) reading
   rows from the ``trainfit prepare`` memmap vs the raw dataset that tokenizes each document in
   ``__getitem__`` -- byte tokenizer and BPE -- at 0 and 2 DataLoader workers (steady state: the first batch,
   which starts the workers, is not timed).
2. Data wait as a share of the step for the default job (gpt-tiny defaults) trained from the prepared file:
   the median ``data_wait_frac`` of ``trainfit train --data DIR`` metrics.jsonl (must stay under 5%).
3. Profile advice before/after: the same job's ``trainfit profile`` on the raw text with ``--packing off`` and
   a BPE tokenizer (on the fly) vs on the prepared directory.

    .venv/bin/python benchmarks/data_loader.py            # ~5 min on 2 CPUs
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from _common import write_results
from trainfit.data import make_loader
from trainfit.tasks.files import DataSpec, load_text_data

SEQ = 512
MICRO = 8
BATCHES = 40
MAX_S = 10.0
DOC_CHARS = 16_000
"""Documents are cut to this many characters (stdlib modules run to 200 KB; fine-tuning documents are shorter)."""
STEPS = 20
VOCAB = 4096


def corpus(root: Path, n_docs: int = 400) -> Path:
    """The first ``n_docs`` stdlib modules of at least 2 KB (sorted by path), one JSON line each."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.glob("*.py") if p.stat().st_size >= 2048)[:n_docs]
    out = root / "stdlib.jsonl"
    with out.open("w") as f:
        for p in files:
            f.write(json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")[:DOC_CHARS]}) + "\n")
    return out


def bpe_tokenizer(docs: Path, out: Path, vocab: int = VOCAB) -> Path:
    """A byte-level BPE tokenizer.json trained on ``docs`` (EOD ``<|endoftext|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [json.loads(line)["text"] for line in docs.read_text().splitlines()]
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out


def trainfit(*args: str) -> subprocess.CompletedProcess:
    # One torch thread per process: on a shared 2-core machine two threads per op make step times erratic.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "trainfit", *args], capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"trainfit {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return r


def loader_rate(spec: DataSpec, workers: int) -> dict:
    text = load_text_data(spec)
    loader = make_loader(text.train, text.collate, start_step=0, micro_batch=MICRO, accumulation=1, workers=workers)
    it = iter(loader)
    next(it)  # starts the workers; not timed
    tokens, n, t0 = 0, 0, time.perf_counter()
    while n < BATCHES and (n < 3 or time.perf_counter() - t0 < MAX_S):  # slow sources: a time-bounded sample
        b = next(it)
        tokens += int(b["labels"].ne(-100).sum())
        n += 1
    dt = time.perf_counter() - t0
    del it, loader
    return {"source": text.source, "workers": workers, "batches": n, "tokens": tokens, "seconds": dt,
            "tokens_per_s": tokens / dt}


def main() -> None:
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="trainfit-data-bench-"))
    docs = corpus(root)
    bpe = bpe_tokenizer(docs, root / "bpe")
    prepared = {"byte": root / "prep-byte", "bpe": root / "prep-bpe"}
    t0 = time.perf_counter()
    trainfit("prepare", "--data", str(docs), "--out", str(prepared["byte"]))
    prep_byte_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainfit("prepare", "--data", str(docs), "--tokenizer", str(bpe), "--out", str(prepared["bpe"]))
    prep_bpe_s = time.perf_counter() - t0

    rows = []
    for tok_name, tok in (("byte", "byte"), ("bpe", str(bpe))):
        for kind, path in (("prepared", prepared[tok_name]), ("on the fly", docs)):
            spec = DataSpec(data=str(path), tokenizer=tok if kind == "on the fly" else "byte", packing=False,
                            seq_len=SEQ)
            for w in (0, 2):
                r = loader_rate(spec, w)
                rows.append({"tokenizer": tok_name, "rows_from": kind, **r})
                print(rows[-1], file=sys.stderr)

    # 2. data wait of the default job from the prepared file
    run = root / "run-prepared"
    trainfit("train", "--data", str(prepared["byte"]), "--steps", str(STEPS), "--checkpoint-every", "0",
             "--run-dir", str(run), "--json")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fracs = [m["data_wait_frac"] for m in metrics if "data_wait_frac" in m][2:]  # after warm-up
    wait_median = statistics.median(fracs)

    # 3. profile advice, on the fly (BPE, packing off) vs prepared
    prof = {}
    for name, extra in (("raw text, BPE, --packing off (on the fly)", ["--data", str(docs), "--tokenizer", str(bpe),
                                                                     "--packing", "off"]),
                        ("prepared directory (BPE)", ["--data", str(prepared["bpe"]), "--packing", "off"])):
        r = trainfit("profile", *extra, "--steps", "5", "--warmup", "1", "--no-batch-probe", "--no-precision-probe", "--json",
                     "--run-dir", str(root / f"prof-{len(prof)}"))
        rep = json.loads(r.stdout)
        prof[name] = {"bottleneck": rep["bottleneck"], "data_wait_frac": rep["data_wait_frac"],
                      "step_s": rep["step_s"], "first_advice": rep["advice"][0]["text"] if rep["advice"] else ""}
        print(name, prof[name], file=sys.stderr)

    def rate(tok: str, kind: str, w: int) -> float:
        return next(r["tokens_per_s"] for r in rows if (r["tokenizer"], r["rows_from"], r["workers"]) == (tok, kind, w))

    lines = [f"Corpus: {len(docs.read_text().splitlines())} stdlib modules ({docs.stat().st_size / 1e6:.1f} MB) as "
             f"JSON Lines; BPE: byte-level, vocab {VOCAB}, trained on them. Rows: --packing off, seq_len {SEQ}, "
             f"documents cut to {DOC_CHARS:,} characters; micro-batches of {MICRO}, up to {BATCHES} timed after the first "
             f"(at most {MAX_S:.0f} s). "
             f"`trainfit prepare`: {prep_byte_s:.1f} s (byte), {prep_bpe_s:.1f} s (BPE), CLI start-up included.",
             "", "| tokenizer | rows from | workers | tokens/s | prepared / on the fly |", "|---|---|---:|---:|---:|"]
    for r in rows:
        ratio = rate(r["tokenizer"], "prepared", r["workers"]) / rate(r["tokenizer"], "on the fly", r["workers"])
        lines.append(f"| {r['tokenizer']} | {r['rows_from']} ({r['source']}) | {r['workers']} | "
                     f"{r['tokens_per_s']:,.0f} | {ratio:,.1f}x |")
    lines += ["", f"Default job (gpt-tiny defaults, seq_len 64, micro-batch 8 x 4) trained {STEPS} steps from the prepared "
                  f"byte file: median data_wait_frac {wait_median:.2%} of the step (steps 3-{STEPS}; must be < 5%); "
                  f"median step {statistics.median([m['step_s'] for m in metrics if 'step_s' in m][2:]) * 1e3:,.0f} ms.",
              "", "| profile of the default job on | bottleneck | data wait | step | first advice |",
              "|---|---|---:|---:|---|"]
    for name, p in prof.items():
        lines.append(f"| {name} | {p['bottleneck']} | {p['data_wait_frac']:.0%} | {p['step_s'] * 1e3:,.1f} ms | "
                     f"{p['first_advice'][:160]} |")
    load = os.getloadavg()
    lines.append(f"\nLoad average at the end (1, 5, 15 min): {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f} on "
                 f"{os.cpu_count()} CPUs (other work shared the machine); train/profile ran with OMP_NUM_THREADS=1.")
    write_results("data_loader", {"load_average": load, "loader": rows, "prepare_s": {"byte": prep_byte_s, "bpe": prep_bpe_s},
                                  "train_prepared_data_wait_frac": {"median": wait_median, "steps": fracs},
                                  "profile": prof}, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
