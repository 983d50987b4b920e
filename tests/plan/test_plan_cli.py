"""trainfit plan: JSON keys, --write runs under trainfit train, memory prediction vs measurement."""

from __future__ import annotations

import dataclasses
import json

import pytest

from trainfit.cli import main
from trainfit.config import load_toml, make_config
from trainfit.results import PlanReport

KEYS = {"precision", "micro_batch", "accumulation", "checkpointing", "strategy", "peak_bytes_per_device", "step_s",
        "scaling_efficiency", "fits", "reasons"}
TINY = "n_layer=2,d_model=32,n_head=2"


def test_json_keys_and_write_runs(capsys, tmp_path):
    plan = tmp_path / "PLAN.toml"
    args = ["plan", "--model", "gpt-tiny", "--model-config", TINY, "--global-batch", "8", "--seq", "32",
            "--device-memory", "64MiB", "--devices", "1", "--device", "cpu", "--top", "5", "--json",
            "--write", str(plan)]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["plans"]) == 5 and all(KEYS <= set(e) for e in out["plans"])
    report = PlanReport.from_dict(out)  # the printed object is the typed report, every key read back
    assert report.to_dict() == out and report.extra == {} and all(r.extra == {} for r in report.plans)
    assert (report.global_batch, report.devices, report.model) == (8, 1, "gpt-tiny")
    best = out["plans"][0]
    assert best["fits"] and best["micro_batch"] * best["accumulation"] == 8
    cfg = make_config(load_toml(plan))
    assert (cfg.precision, cfg.micro_batch, cfg.accumulation, cfg.strategy) == \
        (best["precision"], best["micro_batch"], best["accumulation"], best["strategy"])
    from trainfit.train import train

    summary = train(dataclasses.replace(cfg, steps=1, run_dir=str(tmp_path / "run")), progress=False)
    assert summary.steps == 1 and summary.effective_batch == 8


def test_bad_inputs_one_line(capsys, tmp_path):
    assert main(["plan", "--global-batch", "30", "--devices", "4", "--device-memory", "1GiB", "--device", "cpu",
                 "--bandwidth-intra", "1GB/s"]) == 2
    err = capsys.readouterr().err
    assert "nearest valid global batches: 28 or 32" in err and err.count("\n") == 1
    assert main(["plan", "--global-batch", "8", "--device-memory", "80GiB", "--device", "tpu9"]) == 2
    assert "device='tpu9'" in capsys.readouterr().err
    assert main(["plan", "--global-batch", "8", "--device-memory", "80GiB", "--precisions", "fp8"]) == 2
    assert "precisions='fp8'" in capsys.readouterr().err
    out = tmp_path / "x.toml"
    assert main(["plan", "--model", "llama-70b", "--global-batch", "8", "--seq", "4096", "--device-memory", "80GiB",
                 "--devices", "8", "--device", "h100", "--offloads", "none", "--write", str(out)]) == 2
    assert "nothing fits" in capsys.readouterr().err and not out.exists()
    assert main(["plan", "--global-batch", "8", "--device-memory", "80GiB", "--offloads", "optimizer,disk"]) == 2
    assert "offloads='optimizer,disk'" in capsys.readouterr().err
    assert main(["plan", "--global-batch", "8", "--device-memory", "1GiB", "--device", "cpu",
                 "--offloads", "optimizer"]) == 2  # a cpu row has no host link unless --calibrate measures one
    err = capsys.readouterr().err
    assert "offloads='optimizer'" in err and "--calibrate" in err and err.count("\n") == 1


def test_predicted_peak_matches_measured_within_5_percent():
    """Basis measured at micro-batches 2 and 4; predicted at 3 and at 6 x accumulation 2 vs fresh measurements."""
    from trainfit.plan.cost import Candidate, memory
    from trainfit.probes.calibrate import report_basis
    from trainfit.probes.memory import measure_memory

    base = make_config({"model_config": TINY, "seq_len": 32})
    for precision, ckpt in [("fp32", "none"), ("bf16-mixed", "full")]:
        b = report_basis(base, precision, ckpt, source="measure")
        for mb, acc in ([(3, 1), (6, 2)] if precision == "fp32" else [(6, 2)]):
            c = Candidate(precision=precision, micro_batch=mb, accumulation=acc, checkpointing=ckpt,
                          strategy="single", grad_sync="deferred", n=1)
            cfg = make_config({"precision": precision, "checkpointing": ckpt, "micro_batch": mb,
                               "accumulation": acc}, base=base)
            measured = measure_memory(cfg).peak_bytes
            assert memory(b, c).peak_bytes == pytest.approx(measured, rel=0.05), (precision, ckpt, mb, acc)


def test_no_planned_fit_runs_out_of_memory_under_the_cap():
    """Every configuration the planner says fits runs two steps under a memory cap equal to the budget."""
    import torch

    from trainfit.engine import optimizer_step
    from trainfit.meters.tracker import memory_cap
    from trainfit.plan.cost import Links
    from trainfit.plan.rules import Context
    from trainfit.plan.search import SearchSpace, search
    from trainfit.probes.calibrate import basis_provider
    from trainfit.probes.memory import example_batch
    from trainfit.run import build_run

    base = make_config({"model_config": TINY, "seq_len": 32})
    space = SearchSpace(global_batch=8, devices=1, memory_bytes=2_000_000, precisions=("fp32",),
                        checkpointings=("none",), strategies=("single",), micro_batches=(1, 2, 4, 8))
    basis, _ = basis_provider(base, source="estimate")
    res = search(space, ctx=Context(devices=1, dtypes=("fp32",)), basis=basis,
                 links=lambda p, ck: Links(flops_per_s=1e10, bandwidth_bytes_per_s=1.0))
    fits = [e for e in res.entries if e.fits]
    assert fits and len(fits) < len(res.entries)  # the budget separates them
    for e in fits:
        cfg = make_config({"checkpointing": e.checkpointing, "micro_batch": e.micro_batch,
                           "accumulation": e.accumulation}, base=base)
        run = build_run(cfg)
        mbs = [example_batch(run.task, cfg.micro_batch)] * cfg.accumulation
        for _ in range(2):  # the second step holds the optimizer state
            try:
                with memory_cap(int(space.budget_bytes), model=run.model, optimizer=run.optimizer,
                                optimizer_params=run.precision.optimizer_params(run.model)):
                    optimizer_step(model=run.model, optimizer=run.optimizer, precision=run.precision,
                                   micro_batches=mbs, loss_fn=run.task.loss, count_fn=run.task.count,
                                   strategy=run.strategy, grad_clip=cfg.grad_clip)
            except torch.OutOfMemoryError as err:
                pytest.fail(f"planned to fit but ran out of memory: {e} ({err})")


@pytest.mark.distributed
def test_dist_calibration_measures_on_two_gloo_processes():
    """plan --calibrate with several CPU devices: steps measured on 2 spawned ranks, then fitted."""
    from trainfit.config import make_config
    from trainfit.meters.devices import device_row
    from trainfit.plan.cost import fit_dist_overhead
    from trainfit.probes.calibrate import links_provider, measure_dist_steps

    base = make_config({"model": "gpt-tiny", "model_config": "n_layer=1,d_model=32,n_head=2", "seq_len": 16})
    measured = measure_dist_steps(base, world=2, pairs=(("ddp", "deferred"), ("zero3", "deferred")),
                                  points=((2, 1), (2, 2)), reps=3)
    assert set(measured) == {(s, "deferred", 2, a) for s in ("ddp", "zero3") for a in (1, 2)}
    assert all(0 < t < 5 for t in measured.values())
    from trainfit.probes.calibrate import basis_provider

    basis, _ = basis_provider(base, source="analytic")
    links = links_provider(device_row("cpu"), nodes=1, devices=2, intra=1e9, inter=None)("fp32")
    rows = fit_dist_overhead(basis("fp32", "none"), links, n=2, measured=measured)
    assert [r[:2] for r in rows] == [("ddp", "deferred"), ("zero3", "deferred")]


@pytest.mark.distributed
def test_plan_calibrate_on_several_cpu_devices_prices_the_measured_overhead(capsys):
    args = ["plan", "--model", "gpt-tiny", "--model-config", "n_layer=1,d_model=32,n_head=2", "--global-batch", "8",
            "--seq", "16", "--device-memory", "1GiB", "--devices", "2", "--device", "cpu", "--strategies", "ddp",
            "--precisions", "fp32", "--checkpointings", "none", "--calibrate", "--json"]
    import torch

    threads = torch.get_num_threads()
    assert main(args) == 0
    assert torch.get_num_threads() == threads  # calibrated at one thread per rank, then restored
    out = json.loads(capsys.readouterr().out)
    note = next(n for n in out["notes"] if n.startswith("distributed overhead measured on 2 gloo processes"))
    assert "ddp/deferred" in note and "zero" not in note  # only the strategies asked for are measured
    assert out["plans"] and all(e["strategy"] == "ddp" and e["step_s"] > 0 for e in out["plans"])


def test_compile_speedup_adds_compile_and_the_written_plan_compiles(capsys, tmp_path):
    plan = tmp_path / "PLAN.toml"
    args = ["plan", "--model", "gpt-tiny", "--model-config", TINY, "--global-batch", "8", "--seq", "32",
            "--device-memory", "64MiB", "--device", "cpu", "--precisions", "fp32", "--checkpointings", "none",
            "--compile-speedup", "1.25", "--json", "--write", str(plan)]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plans"][0]["compile"] is True and any(n.startswith("compile: compute priced at 1.25x")
                                                      for n in out["notes"])
    assert PlanReport.from_dict(out).to_dict() == out
    assert make_config(load_toml(plan)).compile is True
    for bad in ("0", "-1", "nan", "fast"):
        assert main(args[:-5] + [f"--compile-speedup={bad}"]) == 2
        assert "compile-speedup=" in capsys.readouterr().err
    h100 = ["plan", "--model", "gpt-tiny", "--global-batch", "8", "--device-memory", "80GiB", "--device", "h100",
            "--compile-speedup", "measure"]
    assert main(h100) == 2
    assert "pass the ratio measured there" in capsys.readouterr().err


def test_measured_compile_speedup_is_the_eager_over_compiled_step_per_pair():
    from trainfit.plan.cost import Links
    from trainfit.probes.calibrate import compile_speedup_links

    seen = []

    def measure(cfg, reps):
        seen.append((cfg.precision, cfg.checkpointing.spec, cfg.micro_batch, cfg.accumulation))
        return 0.3, 0.2, 5.0  # eager, compiled, compile seconds

    plain = lambda p, ck="none": Links(flops_per_s=1e9, bandwidth_bytes_per_s=1.0)  # noqa: E731
    links = compile_speedup_links(make_config({"model": "gpt-tiny", "model_config": TINY}), plain, measure=measure)
    assert links("fp32", "none").compile_speedup == pytest.approx(1.5)
    links("fp32", "none")
    links("bf16-mixed", "full")
    assert seen == [("fp32", "none", 4, 1), ("bf16-mixed", "full", 4, 1)]  # once per pair, at the basis' batch


def test_a_traced_basis_searches_none_and_full_unless_asked_and_says_so(capsys):
    args = ["plan", "--model", "gpt-tiny", "--model-config", TINY, "--global-batch", "8", "--seq", "32",
            "--device-memory", "64MiB", "--device", "cpu", "--precisions", "fp32", "--strategies", "single",
            "--basis", "fast", "--top", "100", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert {e["checkpointing"] for e in out["plans"]} == {"none", "full"}
    assert any(n.startswith("checkpointing searched: none, full") for n in out["notes"])
    assert main([*args, "--checkpointings", "none,every:2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {e["checkpointing"] for e in out["plans"]} == {"none", "every:2"}
    assert not any(n.startswith("checkpointing searched") for n in out["notes"])


_IMPORTS = ("import json, sys; from trainfit.cli import main; rc = main(sys.argv[1:]); "
            "print(json.dumps({'rc': rc, 'imported': sorted({'torch', 'transformers'} & set(sys.modules))}), "
            "file=sys.stderr)")


@pytest.mark.hf
def test_a_plan_that_traces_nothing_imports_neither_torch_nor_transformers(capsys):
    """A GPU-target plan whose bases are all cached (and an analytic one, cold) builds nothing, so it imports
    neither torch nor the model's library: those imports were most of its 2-3 s on a small machine. The cached
    plan prints the plans the cold one did."""
    import os
    import subprocess
    import sys

    gpu = ["--device", "h100", "--devices", "8", "--global-batch", "64", "--seq", "64", "--device-memory", "80GiB",
           "--json"]
    traced = ["plan", "--model", "hf:GPT2LMHeadModel", "--model-config",
              "n_layer=3,n_embd=64,n_head=4,vocab_size=300,n_positions=64", "--basis", "fast", *gpu]
    assert main(traced) == 0  # cold: traced in this process (which has torch), and cached
    cold = json.loads(capsys.readouterr().out)
    for args in (traced, ["plan", "--model", "llama-70b", *gpu]):
        done = subprocess.run([sys.executable, "-c", _IMPORTS, *args], capture_output=True, text=True,
                              env=os.environ.copy(), timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stderr.strip().splitlines()[-1]) == {"rc": 0, "imported": []}, args
        if args is traced:
            assert json.loads(done.stdout)["plans"] == cold["plans"]


# -- --devices per node, --nodes the nodes (#28 item 6) ----------------------------------------------------------------
def _plan_json(capsys, *args: str) -> dict:
    assert main(["plan", "--model", "gpt-tiny", "--global-batch", "32", "--device-memory", "80GiB", "--device", "h100",
                 "--basis", "analytic", "--strategies", "ddp,zero3", "--precisions", "bf16-mixed", "--checkpointings",
                 "none", "--offloads", "none", "--top", "50", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_devices_count_one_node_and_nodes_multiply_them(capsys):
    """--devices 4 --nodes 2 plans 8 devices: the same per-device memory as 8 devices on one node, ddp whole and
    zero3's optimizer state and gradients in 8 shards of the model's own parameter count."""
    import torch

    from trainfit.tasks.make import make_task

    two_nodes, one_node = _plan_json(capsys, "--devices", "4", "--nodes", "2"), _plan_json(capsys, "--devices", "8")
    assert two_nodes["devices"] == one_node["devices"] == 8
    assert any(n.startswith("devices: 8 = 4 per node x 2 nodes") for n in two_nodes["notes"])
    key = lambda p: (p["strategy"], p["micro_batch"], p["accumulation"], p["grad_sync"])  # noqa: E731
    a, b = ({key(p): p for p in out["plans"]} for out in (two_nodes, one_node))
    assert a.keys() == b.keys() and {k[0] for k in a} == {"ddp", "zero3"}
    for k in a:  # the memory of a row does not depend on how the 8 devices sit in nodes
        assert a[k]["peak_bytes_per_device"] == b[k]["peak_bytes_per_device"] and a[k]["parts"] == b[k]["parts"], k
    model = make_task("gpt-tiny", seq_len=64).build_model()
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # shared ones once
    state = 2 * torch.finfo(torch.float32).bits // 8 * n_params  # AdamW's two fp32 moments
    for k, row in a.items():
        assert row["parts"]["optimizer"] == (state if k[0] == "ddp" else state // 8), k
    # the old meaning (--devices the total) would have planned 4 devices here
    assert _plan_json(capsys, "--devices", "4")["devices"] == 4


def test_nodes_0_is_one_line(capsys):
    assert main(["plan", "--global-batch", "8", "--device-memory", "80GiB", "--devices", "4", "--nodes", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("trainfit: error: nodes='0' is not valid")


def test_help_groups_every_flag(capsys):
    """plan --help: the config's sections and output as headings, every flag of plan under one of them."""
    from trainfit.cli import build_parser
    from trainfit.config import SECTIONS

    with pytest.raises(SystemExit) as done:
        main(["plan", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    headings = [ln[:-1] for ln in text.splitlines() if ln.endswith(":") and not ln.startswith(" ")]
    wanted = ["model", "data", "levers", "distribution", "run", "output"]
    assert set(wanted) <= set(headings) and set(headings) <= {*SECTIONS, "output"} | {h for h in headings
                                                                                    if h.startswith("verbosity")}
    sub = build_parser("plan")._subparsers._group_actions[0].choices["plan"]
    grouped = {a.dest: g.title for g in sub._action_groups for a in g._group_actions}
    flags = [a for a in sub._actions if a.option_strings]
    assert flags and all(grouped[a.dest] in headings for a in flags), {a.dest: grouped[a.dest] for a in flags}
    assert "options" not in headings and "optional arguments" not in headings  # nothing left ungrouped
    where = {a.dest: grouped[a.dest] for a in flags}
    assert (where["devices"], where["nodes"], where["device_memory"], where["device"]) == ("distribution",) * 4
    assert (where["json"], where["write_for"], where["top"], where["explain"]) == ("output",) * 4
    assert (where["model"], where["seq_len"], where["precisions"]) == ("model", "data", "levers")


def test_write_for_launches_devices_per_node_on_each_node(capsys, tmp_path):
    """--devices 4 --nodes 2 written for accelerate: 8 processes in all on 2 machines (accelerate counts
    num_processes over all machines); for Lightning: devices 4 per node, num_nodes 2."""
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    job = ["plan", "--global-batch", "32", "--device-memory", "80GiB", "--devices", "4", "--nodes", "2", "--basis",
           "analytic", "--strategies", "ddp"]
    assert main([*job, "--write-for", "accelerate", str(tmp_path / "acc.yaml")]) == 0
    acc = yaml.safe_load((tmp_path / "acc.yaml").read_text())
    assert (acc["num_processes"], acc["num_machines"]) == (8, 2)
    assert main([*job, "--write-for", "lightning", str(tmp_path / "pl.json")]) == 0
    trainer = json.loads((tmp_path / "pl.json").read_text())["trainer"]
    assert (trainer["devices"], trainer["num_nodes"]) == (4, 2)
    capsys.readouterr()


def test_from_file_devices_are_per_node_under_flags(capsys, tmp_path):
    """--from an accelerate config of 16 processes on 2 machines (8 per node): alone it plans 16 devices;
    --devices 4 means 4 on each of its 2 nodes (8); --nodes 4 keeps its 8 per node (32)."""
    cfg = tmp_path / "acc.yaml"
    cfg.write_text("distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_processes: 16\nnum_machines: 2\n")
    job = ["plan", "--from", str(cfg), "--global-batch", "64", "--device-memory", "80GiB", "--basis", "analytic",
           "--model-config", TINY, "--json"]
    cases = (([], 16), (["--devices", "4"], 8), (["--nodes", "4"], 32), (["--devices", "2", "--nodes", "1"], 2))
    for flags, total in cases:
        assert main([*job, *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["devices"] == total, flags
        assert (out["from"]["overridden"].get("devices"), out["from"]["sets"]["devices"]) == \
            (None if total == 16 else total, 16), flags  # the file's count and the flags' compared alike: all ranks
