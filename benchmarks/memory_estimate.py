"""Memory estimate: time and RSS for Llama-shaped 7B and 70B steps, and how it compares.

    .venv/bin/python benchmarks/memory_estimate.py            # 7B, 70B, torch's MemTracker on 7B, small models
    .venv/bin/python benchmarks/memory_estimate.py --quick    # 7B only

Each big estimate runs in a fresh process (wall time includes importing torch and
transformers; RSS is that process's peak). The comparison puts trainfit's estimate next to
the model-state formulas of DeepSpeed's ZeRO estimators and Accelerate's ``estimate-memory``
rule, implemented here from their documentation (DeepSpeed is not installed):

- DeepSpeed ZeRO-2, no offload, per GPU: 4 B/param (fp16 weights + grads) + 16 B/param / GPUs
  (``estimate_zero2_model_states_mem_needs``, docs "Memory Requirements").
- DeepSpeed ZeRO-3, no offload, per GPU: 4 B x largest layer's params + 18 B/param / GPUs
  (``estimate_zero3_model_states_mem_needs``).
- Accelerate: "Training using Adam" = 4 x the model's size in the chosen dtype
  (1x model, 1x gradients, 2x optimizer; docs "Model memory estimator").

All three count model states only; none counts activations or temporaries.
On the small models the real peak is *measured* (a real step, this machine) so every
estimate can be read as a fraction of it.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LLAMA = {
    "7B": ("hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,num_attention_heads=32,"
           "num_key_value_heads=32,vocab_size=32000,max_position_embeddings=4096"),
    "70B": ("hidden_size=8192,intermediate_size=28672,num_hidden_layers=80,num_attention_heads=64,"
            "num_key_value_heads=8,vocab_size=32000,max_position_embeddings=4096"),
}
SMALL = [  # (label, model, model_config, seq, batch)
    ("gpt-tiny (3.3M)", "gpt-tiny", "", 64, 8),
    ("gpt 4.9M (6 layers, d_model 256)", "gpt-tiny", "n_layer=6,d_model=256,n_head=4", 128, 8),
    ("hf Llama (4 layers, hidden 256)", "hf:LlamaForCausalLM", "vocab_size=1024,num_hidden_layers=4,hidden_size=256,"
     "num_attention_heads=4,num_key_value_heads=2,intermediate_size=688,max_position_embeddings=128", 128, 8),
    ("hf BERT masked LM (4 layers, hidden 256)", "hf:BertForMaskedLM", "vocab_size=1024,num_hidden_layers=4,"
     "hidden_size=256,num_attention_heads=4,intermediate_size=1024,max_position_embeddings=128", 128, 8),
    ("hf T5 (2+2 layers, d_model 256)", "hf:T5ForConditionalGeneration", "vocab_size=1024,d_model=256,d_ff=1024,"
     "num_layers=2,num_decoder_layers=2,num_heads=4,d_kv=64", 128, 8),
    ("hf ViT (4 layers, hidden 256, 32x32 images)", "hf:ViTForImageClassification", "hidden_size=256,"
     "intermediate_size=1024,num_hidden_layers=4,num_attention_heads=4,image_size=32,patch_size=4,num_labels=10", 64, 8),
    ("cnn (BatchNorm)", "cnn", "", 64, 8),
]
GIB = 2**30


def deepspeed_zero2(n: int, gpus: int = 1) -> int:
    return 4 * n + (16 * n) // gpus


def deepspeed_zero3(n: int, largest_layer: int, gpus: int = 1) -> int:
    return 4 * largest_layer + (18 * n) // gpus


def accelerate_adam(n: int, dtype_bytes: int) -> int:
    return 4 * n * dtype_bytes


def largest_layer_params(model) -> int:
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def child(size: str, shortcut: bool) -> None:
    """One estimate in this process; prints JSON (estimate time, peak RSS, the report)."""
    t0 = time.perf_counter()
    from trainfit.config import make_config
    from trainfit.probes.estimate import estimate_memory

    cfg = make_config(dict(model="hf:LlamaForCausalLM", model_config=LLAMA[size], seq_len=4096, micro_batch=1,
                           accumulation=1, precision="bf16-mixed", optimizer="adamw"))
    t1, c1 = time.perf_counter(), time.process_time()
    r = estimate_memory(cfg, shortcut=shortcut)
    t2, c2 = time.perf_counter(), time.process_time()
    import torch
    import transformers

    from trainfit.tasks.hf import parse_hf_config

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(parse_hf_config(transformers.LlamaConfig, LLAMA[size]))
    print(json.dumps({"size": size, "estimate_s": t2 - t1, "estimate_cpu_s": c2 - c1, "import_s": t1 - t0,
                      "process_cpu_s": time.process_time(),
                      "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "largest_layer_params": largest_layer_params(model), "report": r.to_dict()}))


def memtracker_child() -> None:
    """PyTorch's own fake-tensor MemTracker on the same 7B step (full model, two steps), for timing."""
    import torch
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from trainfit.tasks.hf import parse_hf_config

    config = parse_hf_config(transformers.LlamaConfig, LLAMA["7B"] + ",use_cache=false")
    t0, c0 = time.perf_counter(), time.process_time()
    with FakeTensorMode():
        model = transformers.LlamaForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        ids = torch.randint(0, config.vocab_size, (1, 4096))
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            for i in range(2):  # the second step, so Adam's state exists
                if i:
                    mt.reset_mod_stats()  # MemTracker refuses a second iteration otherwise
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(input_ids=ids).logits
                torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(), reduction="sum").backward()
                opt.step()
                opt.zero_grad()
        peak = sum(v for d in mt.get_tracker_snapshot("peak").values() for k, v in d.items() if k == "Total")
    print(json.dumps({"size": "7B", "estimate_s": time.perf_counter() - t0, "estimate_cpu_s": time.process_time() - c0,
                      "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "peak_bytes": peak}))


def run_child(size: str, shortcut: bool = True) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", size] + ([] if shortcut else ["--no-shortcut"]),
                         capture_output=True, text=True, check=True)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    d["process_wall_s"] = time.perf_counter() - t0
    return d


def small_rows() -> list[dict]:
    from trainfit.config import make_config
    from trainfit.probes.estimate import estimate_memory
    from trainfit.probes.memory import measure_memory

    rows = []
    for label, model, mc, seq, batch in SMALL:
        for prec in ("fp32", "bf16-mixed"):
            cfg = make_config(dict(model=model, model_config=mc, seq_len=seq, micro_batch=batch, accumulation=1,
                                   precision=prec))
            m, e = measure_memory(cfg), estimate_memory(cfg)
            from trainfit.run import build_run

            mdl = build_run(cfg).model
            rows.append({"label": label, "precision": prec, "n_params": m.n_params, "measured_peak": m.peak_bytes,
                         "activations_share_of_peak": m.peak_parts["activations"] / m.peak_bytes,
                         "trainfit_estimate": e.peak_bytes, "zero2": deepspeed_zero2(m.n_params),
                         "zero3": deepspeed_zero3(m.n_params, largest_layer_params(mdl)),
                         "accelerate": accelerate_adam(m.n_params, 4 if prec == "fp32" else 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--no-shortcut", action="store_true")
    ap.add_argument("--quick", action="store_true", help="7B only, no small models")
    a = ap.parse_args()
    if a.child == "memtracker":
        return memtracker_child()
    if a.child:
        return child(a.child, not a.no_shortcut)
    from _common import write_results

    big = [run_child(s) for s in (["7B"] if a.quick else ["7B", "70B"])]
    torch_mt = None if a.quick else run_child("memtracker")
    small = [] if a.quick else small_rows()
    md = ["## Llama-shaped estimates (seq 4096, micro-batch 1, bf16-mixed, AdamW, no checkpointing)", "",
          "| model | params | estimate wall (s) | estimate CPU (s) | process wall incl. imports (s) | "
          "process CPU (s) | peak RSS (MiB) | trainfit peak | params | grads | optimizer | activations | "
          "ZeRO-2 formula | ZeRO-3 formula | Accelerate (bf16) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in big:
        r, n = d["report"], d["report"]["n_params"]
        md.append(f"| {d['size']} | {n / 1e9:.2f}B | {d['estimate_s']:.1f} | {d['estimate_cpu_s']:.1f} | "
                  f"{d['process_wall_s']:.1f} | {d['process_cpu_s']:.1f} | {d['rss_mib']:.0f} | {r['peak_bytes'] / GIB:.1f} GiB ({r['peak_phase']}) | "
                  f"{r['params_bytes'] / GIB:.1f} | {r['grads_bytes'] / GIB:.1f} | {r['optimizer_bytes'] / GIB:.1f} | "
                  f"{r['activations_bytes'] / GIB:.1f} | {deepspeed_zero2(n) / GIB:.1f} | "
                  f"{deepspeed_zero3(n, d['largest_layer_params']) / GIB:.1f} | {accelerate_adam(n, 2) / GIB:.1f} |")
    md += ["", "GiB unless noted; the formulas are model states on one GPU.", ""]
    if torch_mt:
        md += [f"PyTorch's fake-tensor `MemTracker` (torch.distributed._tools) on the same 7B step, whole model, "
               f"two steps: {torch_mt['estimate_s']:.1f} s wall / {torch_mt['estimate_cpu_s']:.1f} s CPU, "
               f"{torch_mt['rss_mib']:.0f} MiB RSS, peak {torch_mt['peak_bytes'] / GIB:.1f} GiB "
               "(it needs `reset_mod_stats()` between steps).", ""]
    if small:
        md += ["## Small models on this CPU: every estimate as a fraction of the *measured* peak", "",
               "| model | precision | params | measured peak | activations share | trainfit estimate | "
               "ZeRO-2 formula | ZeRO-3 formula | Accelerate |", "|---|---|---|---|---|---|---|---|---|"]
        for s in small:
            p = s["measured_peak"]
            md.append(f"| {s['label']} | {s['precision']} | {s['n_params']:,} | {p / 2**20:.1f} MiB | "
                      f"{s['activations_share_of_peak']:.0%} | {s['trainfit_estimate'] / p:.1%} | "
                      f"{s['zero2'] / p:.0%} | {s['zero3'] / p:.0%} | {s['accelerate'] / p:.0%} |")
    write_results("memory_estimate", {"big": big, "torch_memtracker": torch_mt, "small": small}, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
