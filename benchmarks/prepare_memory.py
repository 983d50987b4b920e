"""Peak memory and throughput of ``trainfit prepare``: flat in corpus size and in document size.

Each case runs ``trainfit prepare`` as a subprocess of a small Python process that reads the peak RSS from
``resource.getrusage(RUSAGE_CHILDREN)`` (a child forked straight from a large process would count that
process's RSS in its own peak on Linux). Throughput is input MB / wall seconds of the whole command, start-up
included (the start-up alone, on a 1 KB document, is reported). Beside it, the ``tokenizers`` library's own
``encode_batch`` on the same documents, in this process: a byte-level model with no merges (the byte tokenizer's
work) and a small BPE trained here.

Text: the Python standard library's own source (nothing downloaded), cut into documents of the given size
(cycling through it), one text file per document.

    .venv/bin/python benchmarks/prepare_memory.py                         # ~10 min on 2 busy CPUs
    .venv/bin/python benchmarks/prepare_memory.py --old /tmp/old/src      # also the code before, on 1 x 30 MB
    .venv/bin/python benchmarks/prepare_memory.py --quick                 # the 1 MB cases only
    .venv/bin/python benchmarks/prepare_memory.py --blobs --old /tmp/old/src   # issue 35 row 10 (below)

``--blobs`` (results in ``results/prepare_memory_blob.md``): one document of 1, 20 and 200 MB with no whitespace
at all (base64 of random bytes, written in chunks), under the byte tokenizer and the 2,000-id byte-level BPE;
``--old`` adds the code before on the 1 and 4 MB blobs under BPE (it encoded such a document whole: ~300 bytes per
input byte). Each row is one ``trainfit prepare`` process: its peak RSS is the peak of one worker.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from _common import write_results

MB = 10**6
BYTE_CASES = [(1, 1 * MB), (10, 1 * MB), (100, 1 * MB), (3, 100 * MB)]
BPE_CASES = [(1, 1 * MB), (10, 1 * MB), (1, 20 * MB)]
"""BPE runs at ~0.2 MB/s on this busy box: its largest case is one 20 MB document, not 3 x 100 MB."""
OLD_CASES = [(10, 1 * MB), (1, 30 * MB)]
BLOB_MB = (1, 20, 200)
OLD_BLOB_MB = (1, 4)
"""The code before held a blob whole under BPE (4.9 GB for 20 MB, reported): measured on small ones only."""
BPE_NOTE = ("; the rise from 1 to 20 MB of input is far below the input (likely the tokenizers library's BPE word "
            "cache, bounded at 10,000 words, filling: not measured apart). BPE tokenizes at ~0.2 MB/s on this busy "
            "box, so its largest case is one 20 MB document, not 3 x 100 MB.")
ENCODE_BATCH_MAX = 10 * MB
"""``encode_batch`` is timed on corpora up to this size (it runs at ~0.2 MB/s here, the byte-level model too)."""
MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
           "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); t = time.perf_counter() - t; "
           "sys.stderr.write(r.stderr[-2000:]); "
           "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, t)")


def source_text() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    return "".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py")))


def corpus(root: Path, text: str, n_docs: int, size: int) -> Path:
    """``n_docs`` text files of ``size`` characters each (bytes, but for the stdlib's few non-ASCII ones), cut
    from ``text`` one after the other, cycling."""
    d = root / f"{n_docs}x{size // MB}MB"
    d.mkdir()
    pos = 0
    for i in range(n_docs):
        with open(d / f"doc{i:03d}.txt", "w", encoding="utf-8") as f:
            left = size
            while left:
                chunk = text[pos : pos + left]
                f.write(chunk)
                left, pos = left - len(chunk), (pos + len(chunk)) % len(text)
    return d


def prepare(data: Path, out: Path, tokenizer: str, pythonpath: str | None = None) -> dict:
    """Peak RSS (MB), wall seconds and MB/s of one ``trainfit prepare``."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "trainfit", "prepare", "--data", str(data), "--out", str(out),
           "--tokenizer", tokenizer, "--json"]
    r = subprocess.run([sys.executable, "-c", MEASURE, *cmd], capture_output=True, text=True, env=env)
    rc, kib, wall = r.stdout.split()
    if rc != "0":
        raise SystemExit(f"prepare failed ({rc}): {r.stderr}")
    size = sum(p.stat().st_size for p in data.iterdir()) if data.is_dir() else data.stat().st_size
    side = json.loads((out / "prepared.json").read_text())
    shutil.rmtree(out)
    return {"input_mb": size / MB, "peak_rss_mb": int(kib) / 1024, "wall_s": float(wall),
            "mb_per_s": size / MB / float(wall), "n_tokens": side["n_tokens"]}


def byte_level_model(eod: str = "<|endoftext|>"):
    """The byte tokenizer's work in ``tokenizers``: a byte-level BPE with no merges (256 ids + EOD)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens([eod])
    return tok


def trained_bpe(text: str, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[: 4 * MB]], trainer=trainer)
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return tok


def encode_batch_rate(tok, data: Path) -> float:
    """MB/s of ``tok.encode_batch`` on the documents of ``data`` (read into memory first, not timed)."""
    texts = [p.read_text() for p in sorted(data.iterdir())]
    t = time.perf_counter()
    tok.encode_batch(texts, add_special_tokens=False)
    return sum(len(x.encode()) for x in texts) / MB / (time.perf_counter() - t)


def blob(root: Path, size: int) -> Path:
    """One document of ``size`` bytes with no whitespace: base64 of random bytes (seeded), written in chunks."""
    import base64
    import random

    rng, path = random.Random(size), root / f"blob{size // MB}MB.txt"
    with open(path, "w", encoding="ascii") as f:
        left = size
        while left:
            text = base64.b64encode(rng.randbytes(3 * MB // 4)).decode()[:left]
            f.write(text)
            left -= len(text)
    return path


def blobs(root: Path, bpe_dir: Path, old: str | None) -> list[dict]:
    """Peak RSS and wall time of prepare on a whitespace-free document of each size, both tokenizers (and the
    code before on the small ones)."""
    rows = []
    for size_mb in BLOB_MB:
        data = blob(root, size_mb * MB)
        for tokenizer in ("byte", "bpe"):
            rows.append({"tokenizer": tokenizer, "case": f"1 x {size_mb} MB, no whitespace", "code": "new",
                         **prepare(data, root / "out", "byte" if tokenizer == "byte" else str(bpe_dir))})
            print(rows[-1], flush=True)
            if old and tokenizer == "bpe" and size_mb in OLD_BLOB_MB:
                rows.append({"tokenizer": tokenizer, "case": rows[-1]["case"], "code": "old",
                             **prepare(data, root / "out", str(bpe_dir), pythonpath=old)})
                print(rows[-1], flush=True)
        data.unlink()
    for size_mb in [m for m in OLD_BLOB_MB if m not in BLOB_MB] if old else []:
        data = blob(root, size_mb * MB)
        for code, path in (("new", None), ("old", old)):
            rows.append({"tokenizer": "bpe", "case": f"1 x {size_mb} MB, no whitespace", "code": code,
                         **prepare(data, root / "out", str(bpe_dir), pythonpath=path)})
            print(rows[-1], flush=True)
        data.unlink()
    return rows


def main_blobs(old: str | None) -> None:
    root = Path(tempfile.mkdtemp(prefix="prepare_memory-"))
    try:
        bpe_dir = root / "bpe"
        trained_bpe(source_text(), bpe_dir)
        tiny = root / "tiny.txt"
        tiny.write_text("x" * 1000)
        startup = prepare(tiny, root / "out", "byte")
        rows = blobs(root, bpe_dir, old)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0]
    write_results("prepare_memory_blob", {"load_average": load, "startup": startup, "rows": rows},
                  render_blobs(rows, startup, load))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="PYTHONPATH of the code before (its src/), measured on OLD_CASES")
    ap.add_argument("--quick", action="store_true", help="the 1 MB cases only")
    ap.add_argument("--render", action="store_true", help="only rewrite results/prepare_memory.md (with --blobs: "
                                                          "prepare_memory_blob.md) from its .json")
    ap.add_argument("--blobs", action="store_true", help="documents of 1, 20 and 200 MB with no whitespace")
    args = ap.parse_args()
    if args.render:
        return rerender("prepare_memory_blob" if args.blobs else "prepare_memory")
    if args.blobs:
        return main_blobs(args.old)
    big = lambda cases: [c for c in cases if not args.quick or c[1] <= MB]  # noqa: E731
    root = Path(tempfile.mkdtemp(prefix="prepare_memory-"))
    try:
        text = source_text()
        bpe_dir = root / "bpe"
        bpe = trained_bpe(text, bpe_dir)
        byte = byte_level_model()
        tiny = root / "tiny.txt"
        tiny.write_text(text[:1000])
        startup = prepare(tiny, root / "out", "byte")
        rows = []
        for tokenizer, cases in (("byte", BYTE_CASES), ("bpe", BPE_CASES)):
            for n, size in big(cases):
                data = corpus(root, text, n, size)
                row = {"tokenizer": tokenizer, "case": f"{n} x {size // MB} MB", "code": "new",
                       **prepare(data, root / "out", "byte" if tokenizer == "byte" else str(bpe_dir))}
                if n * size <= ENCODE_BATCH_MAX:
                    row["encode_batch_mb_per_s"] = encode_batch_rate(byte if tokenizer == "byte" else bpe, data)
                rows.append(row)
                print(row, flush=True)
                shutil.rmtree(data)
        for n, size in big(OLD_CASES) if args.old else []:
            data = corpus(root, text, n, size)
            row = {"tokenizer": "byte", "case": f"{n} x {size // MB} MB", "code": "old",
                   **prepare(data, root / "out", "byte", pythonpath=args.old)}
            row_new = {"tokenizer": "byte", "case": row["case"], "code": "new", **prepare(data, root / "out", "byte")}
            rows += [row, row_new]
            print(row, row_new, flush=True)
            shutil.rmtree(data)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0]
    write_results("prepare_memory", {"load_average": load, "startup": startup, "rows": rows},
                  render(rows, startup, load))


def render(rows: list[dict], startup: dict, load: float) -> str:
    lines = [f"Load average at the end: {load:.1f} on {os.cpu_count()} CPUs (shared with other jobs: times are noisy, "
             f"peaks are not). Start-up of `trainfit prepare` on a 1 KB document: {startup['wall_s']:.1f} s, "
             f"peak {startup['peak_rss_mb']:.0f} MB. MB/s is input MB / wall s of the whole command, start-up "
             "included; `encode_batch` is the tokenizers library alone on the same documents already in memory "
             "(byte: a byte-level model with no merges; bpe: the 2,000-id BPE prepare used).", "",
             "| tokenizer | documents | code | input MB | peak RSS MB | above start-up MB | wall s | "
             "prepare MB/s | tokenizers encode_batch MB/s |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        rate = f"{r['encode_batch_mb_per_s']:.2f}" if "encode_batch_mb_per_s" in r else ""
        lines.append(f"| {r['tokenizer']} | {r['case']} | {r['code']} | {r['input_mb']:.0f} | {r['peak_rss_mb']:.0f} | "
                     f"{r['peak_rss_mb'] - startup['peak_rss_mb']:.0f} | {r['wall_s']:.1f} | "
                     f"{r['mb_per_s']:.2f} | {rate} |")
    for tok in ("byte", "bpe"):
        new = [r for r in rows if r["tokenizer"] == tok and r["code"] == "new"]
        if new:
            lo, hi = min(new, key=lambda r: r["peak_rss_mb"]), max(new, key=lambda r: r["peak_rss_mb"])
            lines += ["", f"{tok}: peak RSS {lo['peak_rss_mb']:.0f}-{hi['peak_rss_mb']:.0f} MB over inputs of "
                      f"{min(r['input_mb'] for r in new):.0f}-{max(r['input_mb'] for r in new):.0f} MB (largest "
                      f"document {max(int(r['case'].split(' x ')[1].split()[0]) for r in new)} MB): flat in corpus "
                      "and document size" + (BPE_NOTE if tok == "bpe" else ".")]
    old = {r["case"]: r for r in rows if r["code"] == "old"}
    for case, r in old.items():
        n = next(x for x in rows if x["code"] == "new" and x["case"] == case and x["tokenizer"] == "byte")
        per_byte = lambda x: (x["peak_rss_mb"] - startup["peak_rss_mb"]) * 2**20 / (x["input_mb"] * MB)  # noqa: E731
        lines += ["", f"Before (the code before this change, same command): {case} peak {r['peak_rss_mb']:.0f} MB "
                  f"({per_byte(r):.1f} bytes above start-up per input byte), {r['wall_s']:.1f} s; now "
                  f"{n['peak_rss_mb']:.0f} MB ({per_byte(n):.2f} bytes per input byte), {n['wall_s']:.1f} s."]
    return "\n".join(lines)


def render_blobs(rows: list[dict], startup: dict, load: float) -> str:
    lines = [f"Load average at the end: {load:.1f} on {os.cpu_count()} CPUs (shared with other jobs: times are noisy, "
             f"peaks are not). Start-up of `trainfit prepare` on a 1 KB document: {startup['wall_s']:.1f} s, peak "
             f"{startup['peak_rss_mb']:.0f} MB. One document per row, with no whitespace at all (base64 of random "
             "bytes); bpe is a 2,000-id byte-level BPE trained here. Each row is one prepare process (one worker): "
             "its peak RSS is the worker's.", "",
             "| tokenizer | document | code | input MB | peak RSS MB | above start-up MB | bytes per input byte | "
             "wall s | MB/s |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        above = r["peak_rss_mb"] - startup["peak_rss_mb"]
        lines.append(f"| {r['tokenizer']} | {r['case']} | {r['code']} | {r['input_mb']:.0f} | {r['peak_rss_mb']:.0f} | "
                     f"{above:.0f} | {above * 2**20 / (r['input_mb'] * MB):.2f} | {r['wall_s']:.1f} | "
                     f"{r['mb_per_s']:.2f} |")
    for tok in ("byte", "bpe"):
        new = [r for r in rows if r["tokenizer"] == tok and r["code"] == "new"]
        if new:
            lines += ["", f"{tok}, this code: peak RSS {min(r['peak_rss_mb'] for r in new):.0f}-"
                      f"{max(r['peak_rss_mb'] for r in new):.0f} MB over documents of "
                      f"{min(r['input_mb'] for r in new):.0f}-{max(r['input_mb'] for r in new):.0f} MB."]
    for r in (r for r in rows if r["code"] == "old"):
        n = next(x for x in rows if x["code"] == "new" and x["case"] == r["case"] and x["tokenizer"] == "bpe")
        lines += ["", f"Before (the code before issue 35, same command): {r['case']} under bpe peaked at "
                  f"{r['peak_rss_mb']:.0f} MB ({(r['peak_rss_mb'] - startup['peak_rss_mb']) / r['input_mb']:.0f} MB "
                  f"per input MB: the document was encoded whole); now {n['peak_rss_mb']:.0f} MB."]
    return "\n".join(lines)


def rerender(name: str) -> None:
    """Rewrite the .md from the .json (after a change to the table only)."""
    from _common import RESULTS

    data = json.loads((RESULTS / f"{name}.json").read_text())
    header = (RESULTS / f"{name}.md").read_text().split("\n\n")[:2]
    table = (render_blobs if name.endswith("_blob") else render)(data["rows"], data["startup"], data["load_average"])
    (RESULTS / f"{name}.md").write_text("\n\n".join(header) + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
