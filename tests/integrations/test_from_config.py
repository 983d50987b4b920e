"""``memory --from`` / ``plan --from``: another tool's configuration read into trainfit's terms.

The files are the tools' own where possible (a ``TrainingArguments.to_json_string()`` kept in DATA, accelerate's
``ClusterConfig.to_yaml_file``); the expected trainfit values are written out by hand from each tool's
documentation, and the memory table is compared with ``trainfit memory`` given the equivalent flags.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.cli_harness import check_promise, cli, error_lines, snapshot
from trainfit.integrations.read_config import read_from

TINY = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16"]
DATA = Path(__file__).parent / "data"
PARTS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "temporaries_bytes", "peak_bytes")


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_training_arguments_json_written_by_transformers():
    """DATA/training_args_5.24.json: ``TrainingArguments(output_dir="out", per_device_train_batch_size=4,
    gradient_accumulation_steps=2, bf16=True, use_cpu=True, activation_checkpointing=True,
    fsdp="full_shard auto_wrap", report_to=[]).to_json_string()`` as transformers 5.24 writes it (fsdp=true and
    fsdp_config.reshard_after_forward; built once, not here: importing transformers costs seconds)."""
    path = str(DATA / "training_args_5.24.json")
    found = read_from(path)
    assert found.tool == "transformers"
    # By hand: Trainer's bf16 is autocast over fp32 weights; full_shard reshards parameters after forward.
    assert dict(found.values) == {"micro_batch": 4, "accumulation": 2, "precision": "bf16-mixed",
                                  "checkpointing": "full", "optimizer": "adamw", "strategy": "zero3"}
    assert "learning_rate" in found.ignored and "output_dir" in found.ignored
    assert "per_device_train_batch_size" not in found.ignored and "bf16" in found.read
    assert set(found.ignored).isdisjoint(found.read)


@pytest.mark.parametrize("text, expected", [
    ('{"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8, "fp16": true, '
     '"fsdp": ["shard_grad_op", "auto_wrap"], "optim": "sgd"}',
     {"micro_batch": 2, "accumulation": 8, "precision": "fp16-mixed", "strategy": "zero2", "optimizer": "sgd"}),
    ('{"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "bf16": false, "fp16": false, '
     '"deepspeed": {"zero_optimization": {"stage": 1}}}',
     {"micro_batch": 1, "accumulation": 1, "precision": "fp32", "strategy": "zero1"}),
])
def test_training_arguments_by_hand(tmp_path, text, expected):
    assert dict(read_from(_write(tmp_path / "a.json", text)).values) == expected


def test_accelerate_yaml_written_by_accelerate(tmp_path):
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    path = tmp_path / "default_config.yaml"
    config_args.ClusterConfig(
        compute_environment="LOCAL_MACHINE", distributed_type="DEEPSPEED", mixed_precision="fp16", use_cpu=False,
        debug=False, num_processes=8, num_machines=2, machine_rank=0,
        deepspeed_config={"zero_stage": 2, "gradient_accumulation_steps": 4, "offload_optimizer_device": "none",
                          "offload_param_device": "none"}).to_yaml_file(path)
    found = read_from(str(path))
    assert found.tool == "accelerate"
    assert dict(found.values) == {"devices": 8, "nodes": 2, "precision": "fp16-mixed", "strategy": "zero2",
                                  "accumulation": 4}
    assert "compute_environment" in found.ignored and "machine_rank" in found.ignored


@pytest.mark.parametrize("text, expected", [
    ("distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 4\nfsdp_config:\n"
     "  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_activation_checkpointing: true\n",
     {"devices": 4, "precision": "bf16-mixed", "strategy": "zero2", "checkpointing": "full"}),
    ("distributed_type: FSDP\nmixed_precision: 'no'\nnum_processes: 2\nfsdp_config:\n"
     "  fsdp_version: 2\n  fsdp_reshard_after_forward: true\n",
     {"devices": 2, "precision": "fp32", "strategy": "zero3"}),
    ("distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_processes: 2\n",
     {"devices": 2, "precision": "bf16-mixed", "strategy": "ddp"}),
])
def test_accelerate_by_hand(tmp_path, text, expected):
    assert dict(read_from(_write(tmp_path / "c.yaml", text)).values) == expected


@pytest.mark.parametrize("text, expected", [
    ('{"accelerator": "gpu", "devices": 4, "num_nodes": 2, "precision": "bf16-mixed", "strategy": "fsdp", '
     '"accumulate_grad_batches": 8, "max_epochs": 3}',
     {"nodes": 2, "devices": 8, "accumulation": 8, "precision": "bf16-mixed", "strategy": "zero3"}),
    ("trainer:\n  devices: [0, 1]\n  precision: 16-true\n  strategy: deepspeed_stage_2\n"
     "  accumulate_grad_batches: 2\ndata:\n  init_args:\n    batch_size: 16\n",
     {"devices": 2, "accumulation": 2, "precision": "fp16-true", "strategy": "zero2", "micro_batch": 16}),
    ("trainer:\n  devices: 2\n  precision: 32-true\n  strategy:\n"
     "    class_path: lightning.pytorch.strategies.FSDPStrategy\n    init_args:\n"
     "      sharding_strategy: SHARD_GRAD_OP\n",
     {"devices": 2, "precision": "fp32", "strategy": "zero2"}),
])
def test_lightning_by_hand(tmp_path, text, expected):
    found = read_from(_write(tmp_path / "trainer.yaml", text))
    assert found.tool == "lightning"
    assert dict(found.values) == expected
    assert bool(found.notes) == ("16-true" in text)  # the master copy Lightning's *-true does not keep is said


def test_deepspeed_json_named_by_training_arguments_and_devices_auto_ignored(tmp_path):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}}')
    found = read_from(_write(tmp_path / "args.json", '{"per_device_train_batch_size": 2, "deepspeed": "ds.json"}'))
    assert dict(found.values) == {"micro_batch": 2, "strategy": "zero3"}
    found = read_from(_write(tmp_path / "t.json", '{"devices": "auto", "strategy": "auto", "precision": 16}'))
    assert dict(found.values) == {"strategy": "single", "precision": "fp16-mixed"}  # Lightning 1.x "16": AMP
    assert "devices" in found.ignored and "devices" not in found.read


def test_memory_from_file_equals_the_same_flags(tmp_path):
    """The table through --from is the one the equivalent flags give (the same RunConfig: identical bytes);
    an explicit flag beats the file and stderr says so."""
    path = _write(tmp_path / "args.json", json.dumps({
        "output_dir": "out", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": True,
        "gradient_checkpointing": True, "fsdp": "shard_grad_op auto_wrap", "learning_rate": 1e-4}))
    by_file = cli(["memory", "--from", path, "--estimate", "--devices", "2", "--micro-batch", "4", "--json", *TINY])
    by_flags = cli(["memory", "--estimate", "--devices", "2", "--micro-batch", "4", "--accumulation", "2",
                    "--precision", "bf16-mixed", "--checkpointing", "full", "--strategy", "zero2", "--json", *TINY])
    assert by_file.rc == 0 and by_flags.rc == 0, (by_file.err, by_flags.err)
    a, b = json.loads(by_file.out), json.loads(by_flags.out)
    for key in PARTS:
        assert abs(a[key] - b[key]) <= 0.01 * b[key], (key, a[key], b[key])
    assert (a["precision"], a["checkpointing"], a["batch"], a["accumulation"]) == ("bf16-mixed", "full", 4, 2)
    assert a["from"]["sets"]["strategy"] == "zero2" and a["from"]["overridden"] == {"micro_batch": "4"}
    assert "learning_rate" in a["from"]["ignored"]
    lines = error_lines(by_file.err)
    assert any(ln.startswith(f"trainfit: read from {path}") for ln in lines)
    assert any(ln.startswith(f"trainfit: ignored from {path}") and "learning_rate" in ln for ln in lines)
    assert any("flags override the file: micro_batch=4 (file: 8)" in ln for ln in lines)


def test_plan_from_file_takes_the_job_and_ranks_it(tmp_path):
    path = _write(tmp_path / "accelerate.yaml", "distributed_type: MULTI_GPU\nmixed_precision: bf16\n"
                                                "num_processes: 4\n")
    r = cli(["plan", "--from", path, "--global-batch", "32", "--device-memory", "1GiB", "--json", *TINY])
    assert r.rc == 0, r.err
    out = json.loads(r.out)
    assert out["devices"] == 4 and out["global_batch"] == 32 and out["from"]["format"] == "accelerate"
    assert any(n.startswith(f"the configuration of {path} (precision=bf16-mixed, strategy=ddp) is plan #")
               for n in out["notes"])
    # The global batch by hand: per-device batch 2 x accumulation 4 x 4 devices.
    ta = _write(tmp_path / "ta.json", '{"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}')
    r = cli(["plan", "--from", ta, "--devices", "4", "--device-memory", "1GiB", "--json", *TINY])
    assert r.rc == 0, r.err
    assert json.loads(r.out)["global_batch"] == 32


BAD = [
    ("missing.json", None, "an existing JSON file"),
    ("broken.json", "{per_device_train_batch_size: [", "a valid JSON document (parse error"),
    ("broken.yaml", "a: [1\nb: }", "a valid YAML document (parse error"),
    ("twice.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\nnum_processes: 4\n",
     "'num_processes' is given twice"),
    ("twice.json", '{"per_device_train_batch_size": 2, "per_device_train_batch_size": 8}', "given twice"),
    ("sup.json", '{"per_device_train_batch_size": "\u00b2"}', "per_device_train_batch_size='\u00b2'"),
    ("long.json", '{"per_device_train_batch_size": "' + "9" * 5000 + '"}', "ASCII digits"),
    ("list.json", "[1, 2]", "does not hold a mapping"),
    ("other.json", '{"foo": 1, "bar": 2}', "match none of these formats"),
    ("fp8.yaml", "distributed_type: MULTI_GPU\nmixed_precision: fp8\n", "mixed_precision='fp8'"),
    ("offload.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n"
                     "  offload_optimizer_device: cpu\n", "deepspeed_config.offload_optimizer_device='cpu'"),
    ("hybrid.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n",
     "fsdp_sharding_strategy='HYBRID_SHARD'"),
    ("prec.json", '{"precision": "64-true", "accumulate_grad_batches": 1}', "precision='64-true'"),
    ("both.json", '{"per_device_train_batch_size": 2, "bf16": true, "fp16": true}', "bf16=True"),
    ("mb.json", '{"per_device_train_batch_size": 0}', "per_device_train_batch_size=0"),
    ("optim.json", '{"per_device_train_batch_size": 2, "optim": "adamw_bnb_8bit"}', "optim='adamw_bnb_8bit'"),
]


@pytest.mark.parametrize("command", ["memory", "plan"])
@pytest.mark.parametrize("name, text, says", BAD, ids=[b[0] for b in BAD])
def test_bad_from_file_is_one_line_exit_2(tmp_path, command, name, text, says):
    if text is not None:
        (tmp_path / name).write_text(text)
    before = snapshot(tmp_path)
    extra = ["--estimate"] if command == "memory" else ["--global-batch", "8", "--device-memory", "1GiB"]
    r = cli([command, "--from", str(tmp_path / name), *extra, *TINY], cwd=tmp_path)
    check_promise(r, tmp_path, before)
    assert r.rc == 2
    line = [ln for ln in error_lines(r.err) if ln.startswith("trainfit: error:")][0]
    assert name in line and says in line, line


def test_plan_without_global_batch_or_a_batch_in_the_file(tmp_path):
    path = _write(tmp_path / "c.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\n")
    before = snapshot(tmp_path)
    r = cli(["plan", "--from", path, "--device-memory", "1GiB", *TINY], cwd=tmp_path)
    check_promise(r, tmp_path, before)
    assert r.rc == 2 and "--global-batch" in r.err


@pytest.mark.parametrize("tool,ext", [("hf-trainer", "json"), ("lightning", "json")])
def test_a_file_plan_wrote_for_a_tool_reads_back_as_the_plans_split(tmp_path, tool, ext):
    """--write-for then --from: the micro-batch and accumulation the plan chose come back (accelerate's YAML has
    no key for them, so it is not in this round trip)."""
    out = tmp_path / f"cfg.{ext}"
    r = cli(["plan", "--model", "gpt-tiny", "--model-config", "n_layer=1,d_model=32,n_head=2", "--global-batch", "16",
             "--seq", "32", "--device-memory", "64MiB", "--device", "cpu", "--write-for", tool, str(out), "--json"])
    assert r.rc == 0, r.err
    best = next(p for p in json.loads(r.out)["plans"] if p["fits"])  # the row --write-for writes
    assert (best["micro_batch"], best["accumulation"]) != (8, 4)  # not the defaults a lost key would give
    values = read_from(str(out)).values
    assert (values["micro_batch"], values["accumulation"]) == (best["micro_batch"], best["accumulation"])
