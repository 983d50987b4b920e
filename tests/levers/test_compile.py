"""``--compile`` (levers/compile.py): what is compiled, gradients equal eager, no recompilation, the CLI.

The compiled runs use ``aot_eager`` (dynamo + AOTAutograd: the same graphs and forward/backward split that
inductor gets, without a C++ build) through ``TRAINFIT_COMPILE_BACKEND``; one test runs inductor itself.
The reference is the eager run of the same config, and for inductor plain PyTorch.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from torch import nn

from tests.reliability.cli_harness import cli
from trainfit.config import RunConfig
from trainfit.errors import ConfigError
from trainfit.levers import compile as compile_lever
from trainfit.levers.compile import apply_compile, check_backend, check_mode, plan_compile
from trainfit.probes.compile import compiled_saved_bytes
from trainfit.run import build_run
from trainfit.vocabulary import CompileMode, CompileScope, parse_checkpoint_policy

TINY = dict(model_config="n_layer=2,d_model=32,n_head=2", seq_len=16, micro_batch=3, accumulation=2,
            dataset_size=160, optimizer="sgd", lr=0.1)
TINY_FLAGS = ["--model-config", "n_layer=2,d_model=32,n_head=2", "--seq", "16", "--micro-batch", "3",
              "--accumulation", "2"]


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv(compile_lever.BACKEND_ENV, "aot_eager")


# ------------------------------------------------------------------ pure core

def test_plan_blocks_model_and_a_model_without_blocks():
    p = plan_compile(CompileScope.BLOCKS, ["blocks.0", "blocks.0.attn", "blocks.1"])
    assert p.targets == ("blocks.0", "blocks.1") and p.scope == CompileScope.BLOCKS and not p.note  # outermost
    assert plan_compile(CompileScope.MODEL, ["blocks.0"]).targets == ("",)
    none = plan_compile(CompileScope.BLOCKS, [])
    assert none.targets == ("",) and none.scope == CompileScope.MODEL and "no repeated blocks" in none.note


def test_missing_compiler_and_cuda_graph_modes_are_refused():
    with pytest.raises(ConfigError, match=r"C\+\+ compiler.*looked for: .*g\+\+"):
        check_backend("inductor", "cpu", which=lambda name: None)
    check_backend("inductor", "cuda", which=lambda name: None)  # Triton: no system compiler needed
    check_backend("aot_eager", "cpu", which=lambda name: None)  # builds nothing
    with pytest.raises(ConfigError, match="compile_mode='reduce-overhead'"):
        check_mode(CompileMode.REDUCE_OVERHEAD, "cpu")
    check_mode(CompileMode.MAX_AUTOTUNE_NO_CUDAGRAPHS, "cpu")
    # --memory-cap's tracker is a TorchDispatchMode: dynamo compiles nothing under it (measured: 0 graphs), refused
    with pytest.raises(ConfigError, match="compile='on'.*memory-cap"):
        build_run(RunConfig(**TINY, compile=True, memory_cap=64 * 2**20))


def test_cli_without_a_compiler_is_one_line_exit_2(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_lever.BACKEND_ENV, raising=False)  # inductor
    monkeypatch.setattr(compile_lever.shutil, "which", lambda name: None)
    r = cli(["train", *TINY_FLAGS, "--steps", "1", "--compile", "on", "--run-dir", str(tmp_path / "run")])
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert r.rc == 2 and len(lines) == 1 and "C++ compiler" in lines[0], r.err
    assert not (tmp_path / "run").exists()  # nothing written


# ------------------------------------------------------------------ numerics against eager

def _one_step_grads(cfg: RunConfig, windows: list) -> tuple[torch.Tensor, object]:
    """The gradients the optimizer uses in the first of ``windows`` (then the rest are stepped)."""
    run = build_run(cfg)
    seen = []
    original = run.precision.step

    def observed(optimizer, model, finite):
        seen.append(torch.cat([p.grad.detach().double().reshape(-1) for p in run.precision.optimizer_params(model)]))
        return original(optimizer, model, finite)

    run.precision.step = observed
    graphs = []
    for w in windows:
        run.step(w)
        graphs.append(run.compiled.graphs() if run.compiled else 0)
    return seen[0], run, graphs


def _windows(cfg: RunConfig, steps: int) -> list:
    """``steps`` windows of 2 micro-batches of 3 (padded per micro-batch: the length varies); the last window
    is partial -- one micro-batch of 2 samples, as at the end of a global batch that does not divide."""
    run_task = build_run(dataclasses.replace(cfg, compile=False)).task
    ds = run_task.dataset()
    out = [[run_task.collate([ds[6 * s + 3 * j + i] for i in range(3)]) for j in range(2)] for s in range(steps - 1)]
    out.append([run_task.collate([ds[6 * steps], ds[6 * steps + 1]])])
    return out


def test_compiled_blocks_equal_eager_and_do_not_recompile_over_20_steps(aot_eager):
    cfg = RunConfig(**TINY)
    windows = _windows(cfg, 20)
    ref, _, _ = _one_step_grads(cfg, windows[:1])
    got, run, graphs = _one_step_grads(dataclasses.replace(cfg, compile=True), windows)
    assert float((got - ref).norm() / ref.norm()) <= 1e-5
    assert run.compiled.plan.targets == ("blocks.0", "blocks.1")
    assert run.compiled.graph_breaks() == 0
    # Warm-up is the first step; after it, 19 steps of other lengths and a partial last window compile nothing.
    assert graphs[-1] == graphs[0], graphs
    assert len({tuple(mb["input_ids"].shape) for w in windows for mb in w}) > 5  # the shapes did vary


def test_compiled_composes_with_checkpointing_and_bf16_mixed(aot_eager):
    # One compile for both levers (each compile costs seconds): checkpoint's HOP traced inside the block graph,
    # under bf16 autocast entered outside it. Whole-model scope is run by the inductor test below.
    extra = dict(checkpointing=parse_checkpoint_policy("full"), precision="bf16-mixed")
    cfg = RunConfig(**{**TINY, **extra})
    windows = _windows(cfg, 2)[:1]
    ref, _, _ = _one_step_grads(cfg, windows)
    got, run, _ = _one_step_grads(dataclasses.replace(cfg, compile=True), windows)
    # bf16-mixed: both runs compute in bf16, the compiled one in another order; its verify bound is 2e-2.
    assert float((got - ref).norm() / ref.norm()) <= 2e-2
    assert run.checkpointed == ["blocks.0", "blocks.1"] and run.compiled.graph_breaks() == 0


def test_verify_and_train_under_compile(aot_eager, tmp_path):
    r = cli(["verify", *TINY_FLAGS, "--compile", "on", "--json", "--run-dir", str(tmp_path / "v")])
    assert r.rc == 0, r.err
    assert json.loads(r.out)["passed"] is True and json.loads(r.out)["compiled"] is True
    r = cli(["train", *TINY_FLAGS, "--steps", "3", "--compile", "on", "--json", "--run-dir", str(tmp_path / "t")])
    assert r.rc == 0, r.err
    out = json.loads(r.out)
    assert out["compile"]["recompiles_after_first_step"] == 0 and out["compile"]["scope"] == "blocks"
    assert out["compile_s"] >= 0.0
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert all("compile_graphs" in row for row in rows) and rows[-1]["compile_graphs"] == 0
    r = cli(["profile", *TINY_FLAGS, "--compile", "on", "--json", "--steps", "1", "--warmup", "0",
             "--no-batch-probe", "--bandwidth", "1GB/s"])
    assert r.rc == 0, r.err
    prof = json.loads(r.out)
    assert prof["compile_s"] >= 0.0 and prof["recompiles"] == 0 and "not probed under --compile" in prof[
        "precision_probe_note"]


@pytest.mark.skipif(not any(shutil.which(n) for n in compile_lever.cpp_compilers()), reason="no C++ compiler")
def test_inductor_on_cpu_equals_plain_pytorch(monkeypatch):
    monkeypatch.delenv(compile_lever.BACKEND_ENV, raising=False)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    model.load_state_dict(ref.state_dict())
    info = apply_compile(model, scope=CompileScope.BLOCKS, mode=CompileMode.DEFAULT, block_names=[],
                         device_type="cpu")
    assert info.backend == "inductor" and info.plan.targets == ("",) and info.plan.note
    x = torch.randn(5, 8)
    for m in (ref, model):
        m(x).square().sum().backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    assert info.graphs() >= 1
    assert list(model.state_dict()) == list(ref.state_dict())  # no _orig_mod. prefix: checkpoints load either way


def test_compiled_saved_bytes_estimate_matches_measured(aot_eager):
    # Measured: unique storages packed by saved_tensors_hooks (AOTAutograd saves through save_for_backward);
    # estimated: the min-cut partitioner's saved tensors from fake tensors, views folded into their base.
    r = compiled_saved_bytes(RunConfig(**{**TINY, "micro_batch": 4}))
    assert r.graphs == 1 and r.calls == 2  # one block graph, reused by both blocks
    assert r.compiled_region_bytes > 0 and abs(r.gap_frac) <= 0.05, r
    # Hand check of what a block must keep at least: its LayerNorm inputs (B, T, C) fp32, twice per block.
    assert r.compiled_region_bytes >= 2 * 2 * 4 * 16 * 32 * 4


def test_memory_under_compile_says_the_parts_are_eager_and_measures_the_compiled_saved_bytes(aot_eager):
    """``memory --compile on``: the tracked step runs eagerly (dynamo compiles nothing under the tracker), so
    the output says so and adds what the compiled forward saves, equal to compiled_saved_bytes of the same job."""
    r = cli(["memory", *TINY_FLAGS, "--compile", "on", "--json"])
    assert r.rc == 0, r.err
    note = next(n for n in json.loads(r.out)["notes"] if n.startswith("compile:"))
    torch._dynamo.reset()  # the CLI ran in this process: its compiled frames would be reused, not captured
    want = compiled_saved_bytes(RunConfig(model_config=TINY["model_config"], seq_len=16, micro_batch=3,
                                          accumulation=2, compile=True))  # the job TINY_FLAGS give the CLI
    assert want.graphs == 1 and want.compiled_bytes > 0
    assert f"compiled {want.compiled_bytes:,} B" in note and f"eager {want.eager_bytes:,} B" in note
    r = cli(["memory", *TINY_FLAGS, "--compile", "on", "--estimate", "--json"])
    assert r.rc == 0, r.err
    assert any(n.startswith("compile: the parts above are the eager step's (fake tensors")
               for n in json.loads(r.out)["notes"])
