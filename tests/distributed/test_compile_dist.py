"""``--compile`` under ddp, zero2 and zero3 on 2 gloo ranks: one step's gradients equal the eager run's.

Compiled with ``aot_eager`` (dynamo + AOTAutograd: the graphs and the forward/backward split that inductor
gets, without a C++ build), set through ``TRAINFIT_COMPILE_BACKEND`` before the ranks start. The eager run
is the independent reference here (it is checked against plain PyTorch by tests/distributed/test_strategies.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .harness import errors, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two ranks each pay dynamo's first compile (~15 s idle)

BASE = {"model_config": "n_layer=2,d_model=32,n_head=2", "seq_len": 16, "micro_batch": 2, "accumulation": 2,
        "dataset_size": 64, "optimizer": "sgd", "lr": 0.5, "grad_clip": 1.0}
CASES = {"ddp": {"strategy": "ddp"}, "zero2": {"strategy": "zero2"}, "zero3": {"strategy": "zero3"}}
"""fp32 only: bf16-mixed and compile_scope=model are checked on one process (tests/levers/test_compile.py);
each compiled case after the first reuses the block graph dynamo cached (same code, same guards)."""


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # a DTensor shard -> the whole tensor (collective)
    return (full() if full is not None else t).detach().double().clone()


def _worker(rank: int, root: Path) -> None:
    from trainfit.config import make_config
    from trainfit.levers.compile import graphs_compiled_total
    from trainfit.strategies import unwrap
    from trainfit.run import build_run

    torch.set_num_threads(1)
    out = {}
    for name, kw in CASES.items():
        grads = {}
        for compiled in (False, True):
            run = build_run(make_config({**BASE, **kw, "compile": compiled, "run_dir": str(root / name)}))
            ds = run.task.dataset()
            window = [run.task.collate([ds[4 * rank + 2 * j + i] for i in range(2)]) for j in range(2)]
            seen = {}
            original = run.precision.step

            def observed(optimizer, model, finite, original=original, seen=seen):  # the grads the optimizer uses
                seen["g"] = [_full(p.grad) for p in run.precision.optimizer_params(model)]
                return original(optimizer, model, finite)

            run.precision.step = observed
            run.step(window)
            grads[compiled] = torch.cat([g.reshape(-1) for g in seen["g"]])
            if compiled:
                targets = [unwrap(run.model).get_submodule(n) for n in run.compiled.plan.targets]
                compiled_all = bool(targets) and all(getattr(m, "_trainfit_compiled", False) for m in targets)
        ref, got = grads[False], grads[True]
        out[name] = {"rel": float((got - ref).norm() / ref.norm()), "compiled": compiled_all}
    out["graphs_in_process"] = graphs_compiled_total()  # dynamo did trace and compile (>= 1 graph)
    if rank == 0:
        (root / "out.json").write_text(json.dumps(out))


def test_compiled_equals_eager_under_ddp_zero2_zero3(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINFIT_COMPILE_BACKEND", "aot_eager")  # inherited by the spawned ranks
    codes = spawn(_worker, tmp_path, timeout_s=300)
    assert codes == [0, 0], errors(tmp_path)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out.pop("graphs_in_process") >= 1, out
    for name in CASES:  # fp32: the bound
        assert out[name]["rel"] <= 1e-5, (name, out[name])
        assert out[name]["compiled"], (name, out[name])  # each block's forward ran compiled, inside the wrapper
