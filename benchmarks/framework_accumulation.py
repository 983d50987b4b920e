"""Gradient accumulation on uneven token counts: each tool's default vs trainfit's, on the same window.

For each job the window is the run's first global batch sorted by loss tokens and cut into K micro-batches
(:func:`trainfit.integrations.frameworks.uneven_window`). Each tool's optimizer step runs on it as its users
write it (``verify --framework``), and trainfit's own step (``Run.step``, the gradient captured right after
unscaling, as ``trainfit verify`` does); every gradient is compared with the fp32 big-batch reference
``sum(loss) / sum(tokens)``. Dropout is off in every model (nn.Dropout p=0), so only the accumulation differs.

Usage::

    cd benchmarks && python framework_accumulation.py
    # writes benchmarks/results/framework_accumulation.{json,md}
"""

from __future__ import annotations

import time

import torch

from _common import write_results
from trainfit.config import RunConfig
from trainfit.integrations.frameworks import uneven_window, verify_framework
from trainfit.probes.verify import flat, reference_grads, rel_error
from trainfit.run import build_run

JOBS = {
    "gpt-tiny (default job)": RunConfig(),
    "hf:LlamaForCausalLM 2 layers": RunConfig(
        model="hf:LlamaForCausalLM", micro_batch=8, accumulation=4,
        model_config="num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,"
                     "num_key_value_heads=4,vocab_size=256"),
    "hf:GPT2LMHeadModel 2 layers": RunConfig(
        model="hf:GPT2LMHeadModel", micro_batch=8, accumulation=4,
        model_config="n_layer=2,n_embd=64,n_head=4,vocab_size=256,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"),
    "hf:BertForTokenClassification 2 layers": RunConfig(
        model="hf:BertForTokenClassification", micro_batch=8, accumulation=4,
        model_config="num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,vocab_size=256"),
    "hf:BertForSequenceClassification 2 layers": RunConfig(
        model="hf:BertForSequenceClassification", micro_batch=8, accumulation=4,
        model_config="num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,vocab_size=256"),
}
CAUSAL = ("gpt-tiny (default job)", "hf:LlamaForCausalLM 2 layers", "hf:GPT2LMHeadModel 2 layers")
"""Jobs trainfit's own step and Accelerate/Lightning run too (their window is a trainfit task's)."""


def trainfit_error(cfg: RunConfig) -> float:
    """trainfit's own accumulation (Run.step) on the same uneven window, against the big-batch gradient."""
    w = uneven_window(cfg)
    run = build_run(cfg)
    prec = run.precision
    params = prec.optimizer_params(run.model)
    captured: list[torch.Tensor] = []
    original = prec.unscale_and_check

    def observed(model, all_reduce_max=None):
        ok = original(model, all_reduce_max)
        captured.append(flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params]))
        return ok

    prec.unscale_and_check = observed
    run.step(w.micro_batches)
    ref = w.build_model()
    return rel_error(captured[-1], flat(reference_grads(ref, w.task, w.micro_batches)))


def main() -> None:
    rows, data = [], []
    for job, cfg in JOBS.items():
        tools = [("accelerate", "default"), ("accelerate", "token-weighted"), ("lightning", "default"),
                 ("lightning", "token-weighted")] if job in CAUSAL else []
        if cfg.model.startswith("hf:"):
            tools.insert(0, ("hf-trainer", "default"))
        if job in CAUSAL:
            t = time.perf_counter()
            tf_err = trainfit_error(cfg)
            data.append({"job": job, "tool": "trainfit", "loss": "sum / window tokens", "grad_rel_error": tf_err,
                         "accumulation_error": None, "normalisation": None, "passed": tf_err <= 1e-4,
                         "seconds": time.perf_counter() - t})
        for fw, loss in tools:
            t = time.perf_counter()
            r = verify_framework(cfg, framework=fw, loss=loss)
            data.append({"job": job, "tool": fw, "loss": loss, "loss_tokens": list(r.loss_tokens),
                         "grad_rel_error": r.grad_rel_error, "accumulation_error": r.accumulation_error.rel_error,
                         "normalisation": r.normalisation.rel_error, "passed": r.passed, "path": r.path,
                         "causes": [c for c in (r.accumulation_error.cause, r.normalisation.cause) if c],
                         "seconds": time.perf_counter() - t})
            print(job, fw, loss, f"{r.grad_rel_error:.3e}", r.passed, flush=True)
    window = {d["job"]: d["loss_tokens"] for d in data if d["tool"] in ("accelerate", "lightning")}
    tokens = ["/".join(map(str, d.get("loss_tokens") or window[d["job"]])) for d in data]  # trainfit: the task's
    rows.append("| job | targets per micro-batch | tool | loss | vs token mean | accumulation error (K x M vs 1 x KM) "
                "| normalisation difference (1 x KM vs token mean) | verdict |")
    rows.append("|---|---|---|---|---|---|---|---|")

    def num(x):
        return "—" if x is None else f"{x:.2e}"

    for d, t in zip(data, tokens):
        rows.append(f"| {d['job']} | {t} | {d['tool']} | {d['loss']} | {d['grad_rel_error']:.2e} | "
                    f"{num(d['accumulation_error'])} | {num(d['normalisation'])} | {'PASS' if d['passed'] else 'FAIL'} |")
    notes = [
        "",
        "fp32, micro-batch 8 x accumulation 4, one CPU process; tolerance: relative error <= 1e-4 (fp32 verify). "
        "`default` = the micro-batch mean loss the tool's default loop backpropagates (Accelerate's `accumulate()` "
        "and Lightning's `accumulate_grad_batches` divide it by K: a mean of means); `token-weighted` = loss sum / "
        "the window's token count x K (the fix). hf-trainer = a real `transformers.Trainer`, "
        "the model's own loss with the Trainer's `num_items_in_batch`. 0.00e+00: bitwise equal to the reference, "
        "which backpropagates the same micro-batches' sums in the same order. Run from `benchmarks/`.",
        "",
        "What the Trainer did: " + "; ".join(sorted({d["path"] for d in data if d["tool"] == "hf-trainer"})),
    ]
    write_results("framework_accumulation", {"rows": data}, "\n".join(rows + notes))


if __name__ == "__main__":
    main()
