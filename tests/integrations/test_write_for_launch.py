"""A written plan runs as planned under the tool's own launcher, or is refused when written (issue 28, rows 1-3).

Two gloo processes on this CPU: the ``--write-for hf-trainer`` JSON under ``torchrun --nproc_per_node 2`` and the
``--write-for lightning`` Trainer arguments under Lightning's own launcher; each rank reports the tool's own
objects (distributed type, processes, the model's wrapper). What a tool would run as something else on CPU
(FSDP: parameters stay whole; accelerate: one process without MPI) is refused before anything is written, and
the accelerate case is checked against ``accelerate launch`` itself, so the refusal is lifted when accelerate
changes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.harness import free_port
from tests.reliability.cli_harness import check_promise, cli, error_lines, snapshot

SCRIPTS = Path(__file__).parent / "scripts"
BIN = Path(sys.executable).parent
CPU2 = ["plan", "--global-batch", "8", "--device-memory", "1GiB", "--device", "cpu", "--devices", "2",
        "--bandwidth-intra", "10GB/s", "--basis", "analytic", "--top", "1", "--json"]


def _written(tmp_path, tool, name, *more):
    path = tmp_path / name
    r = cli([*CPU2, *more, "--write-for", tool, str(path)])
    assert r.rc == 0, r.err
    return json.loads(r.out)["plans"][0], path


def _launch(cmd, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), "MASTER_ADDR": "127.0.0.1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.distributed
def test_hf_trainer_ddp_file_starts_two_gloo_processes_under_torchrun(tmp_path):
    row, path = _written(tmp_path, "hf-trainer", "args.json")
    assert row["strategy"] == "ddp"
    out = tmp_path / "out"
    out.mkdir()
    ranks = _launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2",
                     str(SCRIPTS / "hf_ddp_worker.py"), str(path), str(out)], out)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:  # Accelerate's own state inside the Trainer: 2 CPU processes, DDP-wrapped, two steps
        assert (r["distributed_type"], r["num_processes"], r["wrapper"], r["steps"]) == \
            ("MULTI_CPU", 2, "DistributedDataParallel", 2)
    mem = json.loads((out / "memory.json").read_text())  # trainfit's callback, labelled from what ran
    assert (mem["strategy"], mem["world_size"], mem["optimizer"]) == ("ddp", 2, "adamw")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.distributed
def test_lightning_ddp_file_starts_two_processes_with_lightnings_launcher(tmp_path):
    row, path = _written(tmp_path, "lightning", "pl.json")
    assert row["strategy"] == "ddp"
    out = tmp_path / "out"
    out.mkdir()
    ranks = _launch([sys.executable, str(SCRIPTS / "lightning_ddp_worker.py"), str(path), str(out)], out)
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert (r["world_size"], r["strategy"], r["wrapper"], r["backend"], r["steps"]) == \
            (2, "DDPStrategy", "DistributedDataParallel", "gloo", 1)


@pytest.mark.parametrize("tool, name, strategy, why", [
    ("accelerate", "acc.yaml", "zero3", "only through MPI"),
    ("accelerate", "acc.yaml", "ddp", "only through MPI"),
    ("hf-trainer", "args.json", "zero3", "FSDP only on accelerators"),
    ("hf-trainer", "args.json", "zero1", "no ZeRO-1"),
    ("lightning", "pl.json", "zero2", "only on CUDA devices"),
])
def test_a_strategy_the_tool_runs_otherwise_on_cpu_is_refused_before_any_work(tmp_path, tool, name, strategy, why):
    before = snapshot(tmp_path)
    r = cli([*CPU2, "--strategies", strategy, "--write-for", tool, str(tmp_path / name)], cwd=tmp_path)
    lines = error_lines(r.err)
    assert r.rc == 2 and len(lines) == 1 and r.err.strip() == lines[0], r.err
    assert f"strategies='{strategy}'" in lines[0] and "device cpu" in lines[0] and why in lines[0]
    check_promise(r, tmp_path, before)


def test_without_strategies_only_what_the_tool_runs_on_cpu_is_searched(tmp_path):
    args = [a for a in CPU2 if a not in ("--top", "1")]  # one --top: a flag given twice is refused
    r = cli([*args, "--top", "20", "--write-for", "lightning", str(tmp_path / "pl.json")])
    assert r.rc == 0, r.err
    assert {p["strategy"] for p in json.loads(r.out)["plans"]} <= {"single", "ddp"}


def test_the_file_carries_only_what_the_plan_chose(tmp_path):
    """Row 3: lr, steps, schedule, seed and clipping stay the user's (TrainingArguments(**file) keeps them)."""
    from transformers import TrainingArguments

    row, path = _written(tmp_path, "hf-trainer", "args.json")
    kwargs = json.loads(path.read_text())
    user = dict(learning_rate=1e-4, max_steps=7, lr_scheduler_type="cosine", seed=11, max_grad_norm=0.5,
                weight_decay=0.1, warmup_steps=3, optim="adafactor")
    assert not set(user) & set(kwargs)
    # one process here (the file is for torchrun): no process group to join
    args = TrainingArguments(output_dir=str(tmp_path / "o"), **user, **{**kwargs, "ddp_backend": None}, report_to=[])
    for key, value in user.items():
        assert getattr(args, key) == value, key
    assert args.per_device_train_batch_size == row["micro_batch"]
    assert args.gradient_accumulation_steps == row["accumulation"]
    row, path = _written(tmp_path, "lightning", "pl.json")
    trainer = json.loads(path.read_text())["trainer"]
    assert not {"max_steps", "gradient_clip_val", "gradient_clip_algorithm"} & set(trainer)
    assert trainer["accumulate_grad_batches"] == row["accumulation"]


@pytest.mark.distributed
def test_accelerate_launch_starts_one_cpu_process_from_a_two_process_multi_cpu_config(tmp_path):
    """Why accelerate on several CPU processes is refused: the config trainfit wrote before (MULTI_CPU, 2
    processes, no MPI), launched by accelerate itself, trains in one process. If accelerate ever starts two,
    this fails and the refusal in export_plan.unrunnable should go."""
    import yaml
    from accelerate.commands.config.config_args import ClusterConfig

    values = dict(compute_environment="LOCAL_MACHINE", distributed_type="MULTI_CPU", mixed_precision="no",
                  num_machines=1, num_processes=2, machine_rank=0, use_cpu=True, debug=False)
    ClusterConfig(**values)
    cfg = tmp_path / "acc.yaml"
    cfg.write_text(yaml.safe_dump(values))
    script = tmp_path / "w.py"
    script.write_text("import json, sys\nfrom accelerate import Accelerator\na = Accelerator()\n"
                      "open(f'{sys.argv[1]}/rank{a.process_index}.json', 'w').write(json.dumps("
                      "{'n': a.num_processes, 'type': a.distributed_type.value}))\n")
    ranks = _launch([str(BIN / "accelerate"), "launch", "--config_file", str(cfg), str(script), str(tmp_path)],
                    tmp_path)
    assert [(r["n"], r["type"]) for r in ranks] == [(1, "NO")]
