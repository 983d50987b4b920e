"""The planner's clock against published training throughput: predicted vs measured step time.

    python benchmarks/planner_published.py            # after (this checkout) and before (/tmp/old or --old DIR)

Each row is a public, measured training configuration (hardware, model shape, sequence, micro-batch,
accumulation, sharding, checkpointing, precision, throughput) read from its source, cited on the row. The
measured step is ``micro_batch x accumulation x seq / (tokens/s per GPU)``. The predicted step is what the
planner prices for that exact candidate: ``plan.basis.analytic_basis`` of the model's shape and
``plan.cost.step_time`` with the device row's links and, after this change, the op-level clock
(``plan.clock``). "Before" is the same candidate priced by the planner of ``--old`` (the fixed 40%-of-peak
model), run in a subprocess with that tree on ``PYTHONPATH``.

One coefficient per GPU generation is fitted here, and only on the *held-in* rows (MosaicML's A100 80GB table
for Ampere, its H100 80GB table for Hopper): the eager share (``meters.devices.KERNEL_SHARES[arch].eager``), the
share of the kernel-priced rate an eager PyTorch step sustains, is the median of priced (at share 1) over measured
steps on that generation's held-in rows; this script refits it and prints it beside the constant in the code.
Every other row (A100 40GB, the IBM/Meta blog's 128 A100 and 96 H100, TinyLlama's) is held out and summarised
apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MOSAIC = ("MosaicML llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7), table '{table}', row "
          "{model} SeqLen 2048, 8 GPUs: MicroBatchSize {mb}, GradAccum {acc}, FULL_SHARD, activation checkpointing "
          "{ckpt}, {prec}, {tps} T/s/GPU")
IBM = ("PyTorch blog 'Maximizing training throughput using PyTorch FSDP' (IBM and Meta, 2024-03-13), Table 1: "
       "Llama 2 7B, batch size 2 (per GPU) at 4k tokens, no activation checkpointing, bf16 mixed precision, "
       "SDPA flash attention, {tps} tokens/s/GPU on {gpus}; sharding_strategy=hsdp per fms-fsdp scripts/7b.sh")
TINY = ("TinyLlama README (jzhang38/TinyLlama, commit 026587c): 1.1B Llama-2 architecture (22 layers, 32 heads, "
        "4 query groups, 2048 wide, SwiGLU 5632), sequence 2048, 16 A100-40G, FSDP, per-GPU batch 16k tokens, "
        "global batch 2M tokens, no activation checkpointing, 24k tokens/s per GPU")

MPT_SHAPES = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
              "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 64, 48)}
"""MPT d_model, heads, layers (llm-foundry yamls); d_ff = 4 d_model, vocabulary 50368, tied head. Each shape's
parameter count matches the table's NumParams column to 0.05% (learned positions of the row's sequence)."""


@dataclass(frozen=True)
class Row:
    label: str
    family: str
    dims: dict
    seq: int
    gpus: int
    device: str
    old_device: str
    """The device row the old planner has with the same peak and links (it had no 40GB/PCIe rows)."""
    mb: int
    acc: int
    ckpt: str
    precision: str
    strategy: str
    shard_over: int
    """Devices one sharding group spans (HSDP: the node's 8; the replicas, ``gpus / shard_over``, all-reduce each
    shard across nodes: ``plan.clock.hsdp_all_reduce``)."""
    tokens_per_s_per_gpu: float
    source: str
    held_in: bool = False
    """A row its generation's eager share (the one fitted coefficient) is fitted on."""
    node_network_bits_per_s: float | None = None
    """The network of one node as the source states it (shared by its 8 GPUs); None: the device row's per-GPU
    inter-node link."""

    @property
    def replicas(self) -> int:
        return self.gpus // self.shard_over

    @property
    def measured_s(self) -> float:
        return self.mb * self.acc * self.seq / self.tokens_per_s_per_gpu


def _mpt(table: str, device: str, model: str, mb: int, acc: int, ckpt: bool, prec: str, tps: int, *, seq: int = 2048,
         gpus: int = 8) -> Row:
    d, h, L = MPT_SHAPES[model]
    precision = "bf16-mixed" if prec == "amp_bf16" else "bf16-true"
    where = "" if (seq, gpus) == (2048, 8) else f" seq {seq} x{gpus}"
    source = MOSAIC.format(table=table, model=model, mb=mb, acc=acc, ckpt=ckpt, prec=prec, tps=tps)
    return Row(label=f"MPT-{model} {device}{where}", family="gpt",
               dims=dict(vocab_size=50368, n_layer=L, d_model=d, n_head=h, n_kv_head=h, d_ff=4 * d, max_seq_len=seq,
                         tied_embeddings=True),
               seq=seq, gpus=gpus, device=device, old_device="a100" if device.startswith("a100") else device, mb=mb,
               acc=acc, ckpt="full" if ckpt else "none", precision=precision, strategy="zero3", shard_over=gpus,
               tokens_per_s_per_gpu=tps, held_in=table in (A100, H100) and not where,
               source=source.replace("SeqLen 2048, 8 GPUs", f"SeqLen {seq}, {gpus} GPUs"))


H100, A100, A100_40 = "H100 80GB BF16", "A100 80GB with 1600 Gbps node-node interconnect (RoCE)", \
    "A100 40GB with 1600 Gbps node-node interconnect (RoCE)"
LLAMA2_7B = dict(vocab_size=32000, n_layer=32, d_model=4096, n_head=32, n_kv_head=32, d_ff=11008)
ROWS = (
    # every row of the MosaicML tables at SeqLen 2048 on 8 GPUs
    _mpt(H100, "h100", "30b", 3, 21, True, "amp_bf16", 2002),
    _mpt(H100, "h100", "13b", 2, 1, False, "amp_bf16", 4792),
    _mpt(H100, "h100", "7b", 6, 1, False, "amp_bf16", 10643),
    _mpt(H100, "h100", "1b", 14, 1, False, "amp_bf16", 45455),
    _mpt(H100, "h100", "760m", 24, 2, False, "amp_bf16", 63147),
    _mpt(A100, "a100", "30b", 3, 21, True, "amp_bf16", 916),
    _mpt(A100, "a100", "13b", 2, 3, False, "amp_bf16", 2262),
    _mpt(A100, "a100", "7b", 6, 2, False, "amp_bf16", 4641),
    _mpt(A100, "a100", "3b", 10, 2, False, "amp_bf16", 10811),
    _mpt(A100, "a100", "1b", 14, 4, False, "amp_bf16", 20513),
    _mpt(A100, "a100", "760m", 24, 2, False, "amp_bf16", 32434),
    _mpt(A100, "a100", "350m", 32, 2, False, "amp_bf16", 58782),
    _mpt(A100, "a100", "125m", 40, 2, False, "amp_bf16", 142830),
    _mpt(A100, "a100", "125m", 32, 2, False, "amp_bf16", 141737),
    _mpt(A100_40, "a100-40gb", "13b", 4, 16, True, "bf16 PURE", 1668),
    _mpt(A100_40, "a100-40gb", "7b", 12, 4, True, "bf16 PURE", 3679),
    Row(label="Llama2-7B a100 x128", family="llama", dims=LLAMA2_7B, seq=4096, gpus=128, device="a100",
        old_device="a100", mb=2, acc=1, ckpt="none", precision="bf16-mixed", strategy="zero3", shard_over=8,
        tokens_per_s_per_gpu=3700, source=IBM.format(tps=3700, gpus="128 A100 80GB (400 Gbps)"),
        node_network_bits_per_s=400e9),
    Row(label="Llama2-7B h100 x96", family="llama", dims=LLAMA2_7B, seq=4096, gpus=96, device="h100",
        old_device="h100", mb=2, acc=1, ckpt="none", precision="bf16-mixed", strategy="zero3", shard_over=8,
        tokens_per_s_per_gpu=7500, source=IBM.format(tps=7500, gpus="96 H100 80GB (800 Gbps)"),
        node_network_bits_per_s=800e9),
    Row(label="TinyLlama-1.1B a100-40gb x16", family="llama",
        dims=dict(vocab_size=32000, n_layer=22, d_model=2048, n_head=32, n_kv_head=4, d_ff=5632), seq=2048, gpus=16,
        device="a100-40gb", old_device="a100", mb=8, acc=8, ckpt="none", precision="bf16-mixed", strategy="zero3",
        shard_over=16, tokens_per_s_per_gpu=24000, source=TINY),
)


# MosaicML's other rows: every row of the same two tables at another sequence length (512 to 65,536) or GPU count
# (16 to 64: FULL_SHARD over all of them, across nodes), amp_bf16. None is used for any fit. Left out: 70b (no MPT
# shape here). Columns: model, SeqLen, GPUs, MicroBatchSize, GradAccum, activation checkpointing, T/s/GPU.
_MORE = {("h100", H100): """
30b 8192 8 1 21 T 1384 | 30b 4096 8 1 21 T 1802 | 30b 2048 32 14 3 T 2308 | 30b 2048 16 10 3 T 2263
30b 1024 8 6 21 T 2084 | 13b 32768 8 1 3 T 1976 | 13b 16384 8 3 3 T 2985 | 13b 4096 8 10 3 T 4717
13b 2048 64 2 1 F 4800 | 13b 2048 32 2 1 F 4811 | 13b 2048 16 2 1 F 4767 | 13b 1024 8 40 3 T 5502
7b 65536 8 1 2 T 1956 | 7b 32768 8 2 2 T 3318 | 7b 8192 8 8 2 T 6935 | 7b 4096 8 16 2 T 8611 | 7b 1024 8 64 2 T 10203
3b 65536 8 1 2 T 3262 | 3b 32768 8 3 6 T 5873 | 3b 16384 8 1 6 F 11152 | 3b 8192 8 3 6 F 16578
3b 4096 8 5 6 F 20964 | 3b 2048 64 6 3 F 22525 | 3b 2048 32 6 3 F 23021 | 3b 2048 16 10 3 F 24142
3b 1024 8 20 6 F 27046 | 3b 512 8 40 6 F 27965 | 1b 65536 8 1 2 T 5506 | 1b 32768 8 1 4 F 12025
1b 16384 8 2 4 F 19649 | 1b 8192 8 3 4 F 29157 | 1b 4096 8 7 4 F 38535 | 1b 2048 64 20 1 F 44402
1b 2048 32 20 1 F 45130 | 1b 2048 16 20 1 F 46037 | 1b 1024 8 18 4 F 48910 | 1b 512 8 56 4 F 52275
760m 32768 8 1 2 F 16291 | 760m 16384 8 3 2 F 27815 | 760m 8192 8 6 2 F 41825 | 760m 4096 8 12 2 F 55459
760m 2048 32 24 1 F 67971 | 760m 2048 16 24 1 F 68551 | 760m 1024 8 48 2 F 78581 | 760m 512 8 96 2 F 83749
""", ("a100", A100): """
30b 8192 8 1 21 T 574 | 30b 4096 8 1 21 T 814 | 30b 1024 8 6 21 T 946 | 30b 512 8 12 21 T 967
13b 32768 8 1 3 T 1016 | 13b 16384 8 3 3 T 1431 | 13b 8192 8 5 3 T 1795 | 13b 4096 8 10 3 T 2060
13b 1024 8 40 3 T 2330 | 7b 65536 8 1 2 T 1013 | 7b 32768 8 2 2 T 1672 | 7b 16384 8 4 2 T 2453
7b 8192 8 8 2 T 3206 | 7b 4096 8 16 2 T 3684 | 7b 1024 8 64 2 T 4357 | 3b 65536 8 1 2 T 1767
3b 32768 8 3 6 T 3029 | 3b 16384 8 1 6 F 5529 | 3b 8192 8 3 6 F 7695 | 3b 4096 8 5 6 F 9457
3b 1024 8 20 6 F 11580 | 3b 512 8 40 6 F 12127 | 1b 65536 8 1 2 T 3044 | 1b 32768 8 1 4 F 6275
1b 16384 8 2 4 F 9956 | 1b 8192 8 3 4 F 13814 | 1b 4096 8 7 4 F 17807 | 1b 1024 8 18 4 F 22112
1b 512 8 56 4 F 23148 | 760m 65536 8 1 2 T 4143 | 760m 32768 8 1 2 F 8802 | 760m 16384 8 3 2 F 14274
760m 8192 8 6 2 F 20933 | 760m 4096 8 12 2 F 27351 | 760m 1024 8 48 2 F 29765 | 760m 512 8 96 2 F 29446
350m 65536 8 1 2 F 7524 | 350m 32768 8 2 2 F 13652 | 350m 16384 8 4 2 F 23559 | 350m 8192 8 8 2 F 36569
350m 4096 8 16 2 F 49555 | 350m 1024 8 64 2 F 64813 | 350m 512 8 128 2 F 69330 | 125m 65536 8 1 2 F 20368
125m 32768 8 2 2 F 36407 | 125m 16384 8 4 2 F 60040 | 125m 8192 8 8 2 F 90392 | 125m 4096 8 16 2 F 118396
125m 1024 8 64 2 F 156468 | 125m 512 8 128 2 F 165681
"""}
MORE_ROWS = tuple(
    _mpt(table, device, model, int(mb), int(acc), ckpt == "T", "amp_bf16", int(tps), seq=int(seq), gpus=int(gpus))
    for (device, table), text in _MORE.items()
    for model, seq, gpus, mb, acc, ckpt, tps in (cell.split() for cell in text.replace("\n", " | ").split("|")
                                                 if cell.strip()))
"""Every other row of MosaicML's H100 and A100 80GB tables (other sequence lengths and GPU counts): held out."""


def predict(rows: list[dict], *, clock: bool, eager_share: float | None = None, hsdp: bool = True) -> list[dict]:
    """Step seconds (and, with the clock, its parts) the planner importable here prices for each row; with the
    clock and ``hsdp``, an HSDP row's cross-node all-reduce (``plan.clock.hsdp_all_reduce``) is added."""
    from trainfit.meters.devices import device_row
    from trainfit.plan.basis import analytic_basis
    from trainfit.plan.cost import Candidate, step_time
    from trainfit.plan.shapes import TransformerShape
    from trainfit.probes.fastbasis import links_provider

    out = []
    for r in rows:
        shape = TransformerShape(family=r["family"], **r["dims"])
        b = analytic_basis(shape, precision=r["precision"], checkpointing=r["ckpt"], seq_len=r["seq"])
        row = device_row(r["device"] if clock else r["old_device"])
        n = r["shard_over"]
        links = links_provider(row, nodes=max(1, n // 8), devices=n, intra=None, inter=None)
        if clock:
            from trainfit.meters.devices import clock_facts
            from trainfit.plan.clock import DeviceClock, clocked_links

            facts = clock_facts(row)
            if eager_share is not None:
                facts["eager_share"] = eager_share
            links = clocked_links(links, DeviceClock(**facts), shape, seq_len=r["seq"])
        c = Candidate(precision=r["precision"], micro_batch=r["mb"], accumulation=r["acc"], checkpointing=r["ckpt"],
                      strategy=r["strategy"], grad_sync="deferred", n=n)
        lk = links(r["precision"], r["ckpt"])
        t = step_time(b, c, lk)
        step, parts = t.step_s, (t.parts() if clock else {})
        replicas = r["gpus"] // n
        if clock and hsdp and replicas > 1:
            from trainfit.plan.clock import hsdp_all_reduce

            mb = lk.clock.micro_batch(r["mb"])
            dev = lk.clock.device
            node = r.get("node_network_bits_per_s")
            per_gpu = node / 8 / 8 if node else row.inter_bytes_per_s  # bits -> bytes, shared by the node's 8 GPUs
            _, exposed = hsdp_all_reduce(b.grad_comm_bytes, shard_over=n, replicas=replicas, units=b.n_blocks + 1,
                                         backward_s=(mb.total_s - mb.forward_s) / dev.eager_share,
                                         bandwidth_bytes_per_s=per_gpu, bus_share=dev.bus_share,
                                         latency_s=lk.latency_s)
            step += exposed
            parts = {**parts, "exposed_comm_s": parts.get("exposed_comm_s", 0.0) + exposed, "hsdp_exposed_s": exposed}
        out.append({"step_s": step, "parts": parts})
    return out


def before(rows: list[dict], old: Path) -> list[dict] | None:
    """The old planner's prices, from a subprocess with ``old/src`` first on the path (None: no such tree)."""
    if not (old / "src" / "trainfit").is_dir():
        return None
    code = ("import json,sys; sys.path.insert(0, %r); import planner_published as p; "
            "print(json.dumps(p.predict(json.load(sys.stdin), clock=False)))" % str(Path(__file__).resolve().parent))
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(rows), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(old / "src")}, check=True)
    return json.loads(done.stdout)


def _refit(kernels_only: list[dict]) -> dict[str, tuple[float, float]]:
    """Per GPU generation of the held-in rows: (the eager share in the code, the median priced-at-share-1 over
    measured step of those rows)."""
    from trainfit.meters.devices import KERNEL_SHARES, device_row

    ratios: dict[str, list[float]] = {}
    for k, r in zip(kernels_only, ROWS):
        if r.held_in:
            ratios.setdefault(device_row(r.device).arch, []).append(k["step_s"] / r.measured_s)
    return {arch: (KERNEL_SHARES[arch].eager, statistics.median(v)) for arch, v in ratios.items()}


def _err(pred: float, measured: float) -> float:
    return pred / measured - 1.0


def summary(errors: list[float]) -> str:
    absolute = [abs(e) for e in errors]
    return f"median |error| {statistics.median(absolute):.1%}, worst {max(absolute):.1%}"


def _more_rows(old_tree: Path) -> tuple[str, list[dict]]:
    """The held-out stress rows (:data:`MORE_ROWS`): a table, and summaries by table, sequence length and GPU count."""
    rows = [dict(r.__dict__) for r in MORE_ROWS]
    after = predict(rows, clock=True)
    old = before(rows, old_tree)
    errs = [a["step_s"] / r.measured_s - 1 for a, r in zip(after, MORE_ROWS)]
    lines = ["**More rows of MosaicML's two tables** (every row at another sequence length or GPU count; none used "
             "for any fit):", "", "| configuration | measured s/step | after s/step | after error | before error |",
             "|---|---|---|---|---|"]
    for r, a, e, i in zip(MORE_ROWS, after, errs, range(len(rows))):
        b = f"{_err(old[i]['step_s'], r.measured_s):+.1%}" if old else "-"
        lines.append(f"| {r.label}, mb {r.mb} x acc {r.acc}, ckpt {r.ckpt} | {r.measured_s:.4g} | "
                     f"{a['step_s']:.4g} | {e:+.1%} | {b} |")
    groups = {"all": lambda r: True, "H100 table": lambda r: r.device == "h100",
              "A100 80GB table": lambda r: r.device == "a100", "more than 8 GPUs (across nodes)": lambda r: r.gpus > 8,
              "sequence 512-8192 on 8 GPUs": lambda r: r.gpus == 8 and r.seq <= 8192,
              "sequence 16384-65536": lambda r: r.seq >= 16384}
    lines.append("")
    for name, keep in groups.items():
        picked = [e for e, r in zip(errs, MORE_ROWS) if keep(r)]
        signed = statistics.median(picked)
        lines.append(f"- {name} ({len(picked)} rows): {summary(picked)}, median signed error {signed:+.1%}")
    data = [{**r, "measured_s": m.measured_s, "after": a, "before": old[i] if old else None}
            for i, (r, m, a) in enumerate(zip(rows, MORE_ROWS, after))]
    return "\n".join(lines), data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="/tmp/old", help="a checkout of the planner before the clock (its src/ is used)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    rows = [dict(r.__dict__) for r in ROWS]
    after = predict(rows, clock=True)
    kernels_only = predict(rows, clock=True, eager_share=1.0)
    refit = _refit(kernels_only)
    old = before(rows, Path(args.old))
    lines = ["| # | configuration | measured s/step | after s/step | after error | before s/step | before error | "
             "after: compute / memory / recompute / exposed comm / fixed |", "|---|---|---|---|---|---|---|---|"]
    errs_after, errs_before = [], []
    for i, (r, a) in enumerate(zip(ROWS, after), 1):
        m = r.measured_s
        e = _err(a["step_s"], m)
        errs_after.append(e)
        b_s = old[i - 1]["step_s"] if old else None
        if b_s is not None:
            errs_before.append(_err(b_s, m))
        p = a["parts"]
        split = " / ".join(f"{p[k] / a['step_s']:.0%}" for k in ("compute_bound_s", "memory_bound_s", "recompute_s",
                                                                  "exposed_comm_s", "fixed_s"))
        star = "*" if r.held_in else ""
        lines.append(f"| {i}{star} | {r.label}, mb {r.mb} x acc {r.acc}, ckpt {r.ckpt}, {r.precision}, {r.strategy} "
                     f"over {r.shard_over} | {m:.4g} | {a['step_s']:.4g} | {e:+.1%} | "
                     + (f"{b_s:.4g} | {errs_before[-1]:+.1%}" if b_s is not None else "- | -") + f" | {split} |")
    text = "\n".join(lines)
    held_in = [r.held_in for r in ROWS]
    pick = (lambda errs, want: [e for e, h in zip(errs, held_in) if h == want])  # noqa: E731
    text += (f"\n\nAfter (op-level clock): {summary(errs_after)} over all {len(ROWS)} rows; held out "
             f"({held_in.count(False)} rows): {summary(pick(errs_after, False))}; held in ({held_in.count(True)}): "
             f"{summary(pick(errs_after, True))}.")
    if errs_before:
        text += (f"  \nBefore (fixed 40% of peak, {args.old}): {summary(errs_before)} over all; held out: "
                 f"{summary(pick(errs_before, False))}.")
    text += ("  \nThe fitted coefficient, one per generation (meters/devices.py KERNEL_SHARES[arch].eager; refitted "
             "now on the held-in rows): " + "; ".join(f"{arch} {code} (refit {fit:.3f})"
                                                      for arch, (code, fit) in refit.items())
             + ". Held-in rows are marked * above.")
    sources = "\n".join(f"{i}. {r.source}" for i, r in enumerate(ROWS, 1))
    text += "\n\nSources (each row):\n\n" + sources
    more_text, more = _more_rows(Path(args.old))
    text += "\n\n" + more_text
    print(text)
    if not args.no_write:
        from _common import write_results

        write_results("planner_published", {"rows": [{**r, "measured_s": ROWS[i].measured_s, "after": after[i],
                                                      "before": old[i] if old else None}
                                                     for i, r in enumerate(rows)],
                                            "after": summary(errs_after),
                                            "before": summary(errs_before) if errs_before else None,
                                            "more_rows": more}, text)


if __name__ == "__main__":
    main()
