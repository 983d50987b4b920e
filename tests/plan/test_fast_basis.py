"""The fast basis (two windowed fake traces per pair, cached) against the full path (four memory estimates per
pair) and against the analytic Llama shape; the fp16 = bf16 trace; the cache."""

import dataclasses
import json

import pytest

from trainfit.config import make_config
from trainfit.plan.basis import analytic_basis
from trainfit.plan.cost import Candidate, memory
from trainfit.plan.shapes import shape_of
from trainfit.probes.calibrate import report_basis
from trainfit.probes.estimate import window_reports
from trainfit.probes.fastbasis import cache_dir, fast_basis, prefetch

GPT2 = "n_layer=5,n_embd=64,n_head=4,vocab_size=300,n_positions=64"
GPT2_PLAN, PLAN_SEQ = "n_layer=2,n_embd=64,n_head=4,vocab_size=300,n_positions=256", "256"
"""The planner's tests at the end: which pairs a plan traces does not depend on the depth, and at 2 blocks a pair
is one full-depth trace of 2 blocks (the shortcut's two traces hold 3 + 4 blocks), a third of the tracing in suite
time; at sequence 256 the blocks' activations still outweigh the rest, so full checkpointing frees memory."""
LLAMA = ("hidden_size=64,intermediate_size=160,num_hidden_layers=6,num_attention_heads=4,num_key_value_heads=2,"
         "vocab_size=300,max_position_embeddings=64")
WINDOWS = [(1, 1), (3, 1), (6, 1), (2, 2), (5, 3)]  # (micro-batch, accumulation): inside, and beyond the fit's 2, 4


def peaks(basis):
    return [memory(basis, Candidate(precision=basis.precision, micro_batch=m, accumulation=a,
                                    checkpointing=basis.checkpointing, strategy="single", grad_sync="deferred",
                                    n=1)).peak_bytes for m, a in WINDOWS]


@pytest.mark.parametrize("model, model_config, precision, ckpt", [
    ("hf:GPT2LMHeadModel", GPT2, "bf16-mixed", "full"),
])
def test_fast_basis_predicts_the_full_traces_peaks_within_2_percent(model, model_config, precision, ckpt):
    base = make_config({"model": model, "model_config": model_config, "seq_len": 64})
    none = fast_basis(base, precision, "none")  # (cached: the checkpointed pair reads its model FLOPs from it)
    fast = fast_basis(base, precision, ckpt)
    full = report_basis(base, precision, ckpt, source="estimate")
    assert "extrapolated linearly per segment" in fast.source  # the shortcut ran (not a full-depth trace)
    for f, e in zip(peaks(fast), peaks(full)):
        assert f == pytest.approx(e, rel=0.02)
    assert fast.params_bytes == full.params_bytes and fast.optimizer_bytes == full.optimizer_bytes
    # FLOPs counted on the same fake steps; the full path counts the meta model's math attention (4 matmuls
    # backward) where the CPU's fused kernel recomputes QK^T (5): within 3% (2.3% at head width 32).
    assert fast.model_flops_per_sample == pytest.approx(full.model_flops_per_sample, rel=0.03)
    assert fast.hardware_flops_per_sample == pytest.approx(full.hardware_flops_per_sample, rel=0.03)
    assert (fast.hardware_flops_per_sample > fast.model_flops_per_sample) == (ckpt != "none")
    # What full checkpointing recomputes, counted in the trace without it, is what the checkpointed trace counts
    # (GPT-2's blocks end in dropout, which saves its mask: each block's whole forward is recomputed).
    assert none.full_recompute_flops_per_sample == fast.hardware_flops_per_sample - fast.model_flops_per_sample > 0


def test_full_recompute_is_counted_up_to_each_blocks_last_saved_tensor():
    """torch's non-reentrant checkpoint stops recomputing a block once its last saved tensor is back: a built-in
    GPT block ends in the MLP's down projection and a residual add, which save nothing, so full checkpointing
    recomputes each block's forward but that matmul. By hand, per sample and block at sequence s, width d:
    qkv 6sd^2 + attention 4s^2d + out projection 2sd^2 + MLP up 8sd^2 (the skipped down projection: 8sd^2)."""
    s, d, n = 32, 32, 5
    base = make_config({"model": "gpt-tiny", "model_config": f"n_layer={n},d_model={d}", "seq_len": s})
    b = fast_basis(base, "fp32", "none")  # (cached: the next test's checkpointed pair reads its model FLOPs from it)
    assert "extrapolated linearly per segment" in b.source
    assert b.full_recompute_flops_per_sample == n * (6 * s * d * d + 4 * s * s * d + 2 * s * d * d + 8 * s * d * d)


def test_fp16_traces_hold_the_same_bytes_as_bf16_but_the_loss_scale():
    got = {}
    for p in ("bf16-mixed", "fp16-mixed"):
        reports, *_ = window_reports(make_config({"model": "gpt-tiny", "model_config": "n_layer=2,d_model=32",
                                                    "seq_len": 32, "precision": p}))
        got[p] = reports
    for a, b in zip(got["bf16-mixed"], got["fp16-mixed"]):
        for phase in ("forward", "backward"):
            diff = {k: b.phases[phase][k] - a.phases[phase][k] for k in a.phases[phase]}
            assert diff["peak"] in (0, 4) and all(v == 0 for k, v in diff.items() if k not in ("peak", "temporaries"))


def test_llama_analytic_shape_is_checked_against_the_general_basis():
    """The analytic Llama shape (any size, microseconds) and the fast trace of the same small model agree."""
    base = make_config({"model": "hf:LlamaForCausalLM", "model_config": LLAMA, "seq_len": 64})
    shape = shape_of(base.model, base.model_config, seq_len=64)
    for precision, ckpt in (("bf16-mixed", "none"), ("fp32", "full")):
        traced = fast_basis(base, precision, ckpt)
        formula = analytic_basis(shape, precision=precision, checkpointing=ckpt, seq_len=64)
        # the trace also counts the rotary inv_freq buffer (64 bytes here) and Adam's step counters, which the
        # shape leaves out
        assert formula.params_bytes == pytest.approx(traced.params_bytes, rel=1e-3)
        assert formula.optimizer_bytes == pytest.approx(traced.optimizer_bytes, rel=1e-3)
        for f, e in zip(peaks(formula), peaks(traced)):
            # Measured gap on this tiny Llama (d=64, vocab 300): bf16-mixed/none -18%..+5%, fp32/full +5%..+24% over
            # the windows -- the analytic shape's fixed terms (head, loss, norms) against what the trace holds. A
            # gap recorded for the next change to the shape, not hidden: the check is that it stays within 25%.
            assert f == pytest.approx(e, rel=0.25)
        assert formula.model_flops_per_sample == pytest.approx(traced.model_flops_per_sample, rel=0.05)
        # what full checkpointing recomputes: each block's forward but the down projection (torch stops there)
        assert (formula.hardware_flops_per_sample - formula.model_flops_per_sample
                == pytest.approx(traced.hardware_flops_per_sample - traced.model_flops_per_sample, rel=0.02))


def test_analytic_full_checkpointing_recomputes_what_the_trace_counts():
    """The built-in GPT's analytic shape prices full checkpointing's recompute as the trace counts it: every
    block's forward but its MLP down projection (the hand count of the test above, per block)."""
    s, d, n = 32, 32, 5
    base = make_config({"model": "gpt-tiny", "model_config": f"n_layer={n},d_model={d}", "seq_len": s})
    formula = analytic_basis(shape_of(base.model, base.model_config, seq_len=s), precision="fp32",
                             checkpointing="full", seq_len=s)
    traced = fast_basis(base, "fp32", "full")
    by_hand = n * (6 * s * d * d + 4 * s * s * d + 2 * s * d * d + 8 * s * d * d)
    recompute = formula.hardware_flops_per_sample - formula.model_flops_per_sample
    assert traced.hardware_flops_per_sample - traced.model_flops_per_sample == by_hand
    # the shape prices a block at 2 FLOPs per parameter, so it also counts the biases of qkv, proj and fc (8d)
    # and the two LayerNorms' (4d), which FlopCounterMode leaves out
    assert recompute == by_hand + n * s * 2 * (8 * d + 4 * d)


def test_a_second_plan_reads_the_cache_and_a_changed_job_does_not():
    base = make_config({"model": "gpt-tiny", "model_config": "n_layer=2,d_model=32", "seq_len": 32})
    pairs = [("fp32", "none"), ("fp16-mixed", "none")]
    first = prefetch(base, pairs)
    files = sorted((cache_dir() / "basis").glob("*.json"))
    assert files and all(json.loads(f.read_text())["precision"] != "fp16-mixed" for f in files)  # fp16: bf16's
    again = prefetch(base, pairs)
    for pair in pairs:
        assert "cached" in again[pair].source
        assert dataclasses.replace(again[pair], source="") == dataclasses.replace(first[pair], source="")
    assert first[("fp16-mixed", "none")].temp_fixed_bytes == fast_basis(base, "bf16-mixed", "none").temp_fixed_bytes + 4
    longer = prefetch(make_config({"seq_len": 48}, base=base), pairs[:1])
    assert "cached" not in longer[pairs[0]].source


def test_analytic_selective_and_budget_activations_follow_the_tracker():
    """plan --checkpointings selective,budget:F on an analytic shape: the activation bytes of plan.recompute's
    rules against the tracker's measurement of the same run (micro-batch 4): within 5%, ordered as measured."""
    from trainfit.probes.memory import measure_memory

    mc = "n_layer=4,d_model=32,n_head=2"
    shape = shape_of("gpt-tiny", mc, seq_len=32)
    got = {}
    for ck in ("none", "selective", "budget:0.5", "full"):
        cfg = make_config({"model": "gpt-tiny", "model_config": mc, "seq_len": 32, "checkpointing": ck,
                           "micro_batch": 4, "accumulation": 1})
        measured = measure_memory(cfg).activations_bytes
        planned = 4 * analytic_basis(shape, precision="fp32", checkpointing=ck, seq_len=32).act_per_sample_bytes
        assert planned == pytest.approx(measured, rel=0.05), ck
        got[ck] = planned
    assert got["none"] > got["selective"] > got["budget:0.5"] > got["full"]


@pytest.mark.hf
def test_an_encoder_decoder_takes_the_block_shortcut_and_equals_its_full_depth_trace():
    """T5 (two stacks of T5Block, set together by num_layers and num_decoder_layers): traced at 3 and 4 blocks per
    stack and extrapolated, against the estimator tracing all 5 + 5 blocks (no shortcut), window by window."""
    from trainfit.probes.estimate import estimate_memory

    t5 = "d_model=32,d_ff=64,num_layers=5,num_heads=2,d_kv=16,vocab_size=300"
    base = make_config({"model": "hf:T5ForConditionalGeneration", "model_config": t5, "seq_len": 16})
    fast = fast_basis(base, "bf16-mixed", "none", use_cache=False)
    assert "traced 3 and 4 of 5 blocks" in fast.source
    for mb, acc in ((4, 2),):  # a later micro-batch of a window: every gradient live (suite time: one window)
        cfg = make_config({"precision": "bf16-mixed", "checkpointing": "none", "micro_batch": mb,
                           "accumulation": acc}, base=base)
        full = estimate_memory(cfg, shortcut=False)
        planned = memory(fast, Candidate(precision="bf16-mixed", micro_batch=mb, accumulation=acc,
                                         checkpointing="none", strategy="single", grad_sync="deferred", n=1))
        assert planned.peak_bytes == pytest.approx(full.peak_bytes, rel=0.02), (mb, acc)


def test_fp32_is_traced_only_when_one_of_its_rows_could_rank_first(capsys):
    """On an H100 a traced default plan searches the half precisions first; fp32's traces are made only when its
    fastest possible step (FLOPs at fp32's rate) is not slower than the best plan found without it. When they
    are skipped, pricing fp32 anyway changes no ranking of the others and no fp32 row comes first."""
    from trainfit.cli import main

    def plan(*extra):
        assert main(["plan", "--model", "hf:GPT2LMHeadModel", "--model-config", GPT2_PLAN, "--seq", PLAN_SEQ,
                     "--device", "h100", "--offloads", "none", "--top", "400", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    everything = ["--precisions", "fp32,bf16-mixed,fp16-mixed,bf16-true,fp16-true"]
    for job in (["--global-batch", "64", "--device-memory", "40MiB"], ["--global-batch", "8", "--device-memory", "1GiB"]):
        default, priced = plan(*job), plan(*job, *everything)
        skipped = [n for n in default["notes"] if n.startswith("precisions: fp32 not traced")]
        assert skipped and {r["precision"] for r in default["plans"]} == {"bf16-mixed", "fp16-mixed", "bf16-true",
                                                                       "fp16-true"}
        assert priced["plans"][0]["precision"] != "fp32"
        others = [r for r in priced["plans"] if r["precision"] != "fp32"]
        assert [(r["precision"], r["micro_batch"], r["checkpointing"], r["strategy"], r["grad_sync"]) for r in others] == \
            [(r["precision"], r["micro_batch"], r["checkpointing"], r["strategy"], r["grad_sync"]) for r in default["plans"]]
        floor = float(skipped[0].split("faster than ")[1].split(" s here")[0])
        fp32 = [r["step_s"] for r in priced["plans"] if r["precision"] == "fp32"]
        assert fp32 and min(fp32) >= floor * (1 - 1e-3), (min(fp32), floor)  # (the note prints 4 digits)
    # A budget nothing in half precision fits: fp32 is traced after all, and said so.
    assert main(["plan", "--model", "hf:GPT2LMHeadModel", "--model-config", GPT2_PLAN, "--seq", PLAN_SEQ, "--device",
                 "h100", "--offloads", "none", "--global-batch", "8", "--device-memory", "1MiB"]) == 2
    assert "precisions: fp32 traced too, after the others: nothing fits without it" in capsys.readouterr().err


def test_full_checkpointing_is_traced_only_when_one_of_its_rows_could_rank_first(capsys):
    """A traced default plan on an H100 searches without full checkpointing first. Its pairs are traced only when
    a fully checkpointed row could step faster than the best plan found (each candidate priced at the model's
    FLOPs plus what full checkpointing recomputes, and at the communication of the traces without it), or when
    nothing fits without it. Skipped, pricing it anyway changes no ranking of the others and puts no full row
    first, and every full row steps no faster than the floor the note gave."""
    from trainfit.cli import main

    def plan(*extra, rc=0):
        assert main(["plan", "--model", "hf:GPT2LMHeadModel", "--model-config", GPT2_PLAN, "--seq", PLAN_SEQ,
                     "--device", "h100", "--offloads", "none", "--top", "400", "--json", *extra]) == rc
        return json.loads(capsys.readouterr().out)

    for job in (["--global-batch", "64", "--device-memory", "40MiB"],
                ["--global-batch", "64", "--devices", "8", "--device-memory", "40MiB"]):
        default, priced = plan(*job), plan(*job, "--checkpointings", "none,full")
        skipped = [n for n in default["notes"] if n.startswith("checkpointings: full not traced")]
        assert skipped and {r["checkpointing"] for r in default["plans"]} == {"none"}
        assert priced["plans"][0]["checkpointing"] != "full"
        key = ("precision", "micro_batch", "checkpointing", "strategy", "grad_sync")
        assert [tuple(r[k] for k in key) for r in priced["plans"] if r["checkpointing"] != "full"] == \
            [tuple(r[k] for k in key) for r in default["plans"]]
        floor = float(skipped[0].split("faster than ")[1].split(" s here")[0])
        full = [r["step_s"] for r in priced["plans"] if r["checkpointing"] == "full"]
        assert full and min(full) >= floor * (1 - 1e-3), (min(full), floor)  # (the note prints 4 digits)
    # A budget nothing without checkpointing fits: full is traced after all, and said so.
    default = plan("--global-batch", "64", "--device-memory", "5MiB")
    assert "checkpointings: full traced too, after the others: nothing fits without it" in default["notes"]
    assert default["plans"][0]["checkpointing"] == "full" and default["plans"][0]["fits"]
