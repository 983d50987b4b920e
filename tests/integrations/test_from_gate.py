"""``--from FILE`` through the one gate (issue 35, rows 7 and 15): the file is read bounded, a key given twice is
refused, an integer is read by the one parser, a list of unknown keys is cut; a file that runs a distributed
strategy is sized on the processes its launch starts (its own count or ``--devices``), never on one device
without a word; and no flag combined with any kind of ``--from`` file ends in a traceback.

The references are hand-written: the files are small literals whose meaning is read off each tool's
documentation, and the expected device counts are the ones written in them or given as flags.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.cli_harness import check_one_line, check_promise, cli, error_lines, snapshot
from trainfit.errors import LINE_CHARS

TINY = ["--model-config", "n_layer=1,d_model=32,n_head=2", "--seq", "16", "--basis", "analytic"]
PLAN = ["plan", "--device-memory", "1GiB", "--top", "1", *TINY]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# -- row 15: bounded, cut, parsed once ----------------------------------------------------------------------------
def test_ninety_thousand_unknown_keys_are_refused_in_one_short_line(tmp_path):
    """Before: accepted, and the 'ignored' line listed all 90,000 keys (889 KB on stderr)."""
    keys = {f"k{i}": i for i in range(90_000)} | {"per_device_train_batch_size": 2}
    path = _write(tmp_path / "args.json", json.dumps(keys))
    before = snapshot(tmp_path)
    t0 = time.perf_counter()
    r = cli([*PLAN, "--from", path, "--global-batch", "8"], cwd=tmp_path)
    assert time.perf_counter() - t0 < 10
    check_promise(r, tmp_path, before)
    check_one_line(r)
    assert r.rc == 2 and len(r.err) <= LINE_CHARS + 20 and "args.json" in r.err, r.err[:300]


def test_thousands_of_unknown_keys_within_the_bound_are_listed_cut(tmp_path):
    keys = {f"unknown_{i}": i for i in range(5_000)} | {"per_device_train_batch_size": 2}
    path = _write(tmp_path / "args.json", json.dumps(keys))
    r = cli([*PLAN, "--from", path, "--global-batch", "8"], cwd=tmp_path)
    assert r.rc == 0, r.err[-500:]
    ignored = [ln for ln in error_lines(r.err) if ln.startswith(f"trainfit: ignored from {path}")]
    assert len(ignored) == 1 and len(ignored[0]) < 2000 and "(4,960 more)" in ignored[0], ignored[0][:300]


@pytest.mark.parametrize("name, text, says", [
    ("twice.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\nnum_processes: 4\n", "given twice"),
    ("twice.json", '{"per_device_train_batch_size": 2, "per_device_train_batch_size": 8}', "given twice"),
    ("deep.json", "{\"per_device_train_batch_size\": 2, \"x\": " + "[" * 5000 + "]" * 5000 + "}", "nested"),
    ("alias.yaml", "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                   "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
                   "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nnum_processes: 2\n", "keys and items"),
    ("sup.json", '{"per_device_train_batch_size": "\\u00b2"}', "ASCII digits"),
    ("digits.json", '{"gradient_accumulation_steps": "' + "7" * 5000 + '", "per_device_train_batch_size": 1}',
     "ASCII digits"),
    ("float.json", '{"per_device_train_batch_size": 2.5}', "per_device_train_batch_size=2.5"),
])
@pytest.mark.parametrize("command", ["plan", "memory"])
def test_a_file_past_a_bound_is_refused_in_one_line(tmp_path, command, name, text, says):
    """Before: a key given twice was silently resolved (the last won); '²' passed str.isdigit and crashed int()."""
    path = _write(tmp_path / name, text)
    before = snapshot(tmp_path)
    extra = ["--estimate", *TINY[:-2]] if command == "memory" else [*PLAN[1:], "--global-batch", "8"]
    r = cli([command, "--from", path, *extra], cwd=tmp_path)
    check_promise(r, tmp_path, before)
    check_one_line(r)
    assert r.rc == 2 and name in r.err and says in r.err and len(r.err) <= LINE_CHARS + 20, r.err[:400]


# -- row 7: a sharding file plans on its launch's devices ---------------------------------------------------------
SHARDED_WITHOUT_COUNT = {
    "fsdp.json": '{"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "fsdp": "full_shard auto_wrap"}',
    "fsdp2.json": '{"per_device_train_batch_size": 4, "fsdp": true, "fsdp_config": {"reshard_after_forward": false}}',
    "ds.json": '{"per_device_train_batch_size": 4, "deepspeed": {"zero_optimization": {"stage": 2}}}',
    "acc.yaml": "distributed_type: FSDP\nmixed_precision: bf16\n",
    "pl.json": '{"devices": "auto", "strategy": "fsdp", "accumulate_grad_batches": 2, "precision": "bf16-mixed"}',
}


@pytest.mark.parametrize("name", SHARDED_WITHOUT_COUNT)
def test_a_sharding_file_without_a_device_count_asks_for_devices(tmp_path, name):
    """Before: planned (and sized by memory) on one device, with no word."""
    path = _write(tmp_path / name, SHARDED_WITHOUT_COUNT[name])
    for command in (["plan", "--global-batch", "16", *PLAN[1:]], ["memory", "--estimate", *TINY[:-2]]):
        before = snapshot(tmp_path)
        r = cli([command[0], "--from", path, *command[1:]], cwd=tmp_path)
        check_promise(r, tmp_path, before)
        check_one_line(r)
        assert r.rc == 2 and "--devices N" in r.err and name in r.err, r.err


@pytest.mark.parametrize("name", SHARDED_WITHOUT_COUNT)
def test_a_sharding_file_plans_on_the_devices_given(tmp_path, name):
    path = _write(tmp_path / name, SHARDED_WITHOUT_COUNT[name])
    r = cli([*PLAN, "--from", path, "--devices", "4", "--global-batch", "32", "--json"], cwd=tmp_path)
    assert r.rc == 0, r.err
    out = json.loads(r.out)
    assert out["devices"] == 4 and out["global_batch"] == 32


def test_a_file_that_counts_its_processes_plans_on_them(tmp_path):
    path = _write(tmp_path / "acc.yaml", "distributed_type: FSDP\nnum_processes: 4\nfsdp_config:\n"
                                         "  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n")
    r = cli([*PLAN, "--from", path, "--global-batch", "16", "--json"], cwd=tmp_path)
    assert r.rc == 0, r.err
    assert json.loads(r.out)["devices"] == 4  # accelerate launch starts num_processes


def test_global_batch_beside_a_training_arguments_file_is_said_not_a_crash(tmp_path):
    """Before: KeyError 'global_batch', a 17-line traceback, for every TrainingArguments file."""
    path = _write(tmp_path / "args.json", '{"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}')
    r = cli([*PLAN, "--from", path, "--global-batch", "16", "--devices", "2", "--json"], cwd=tmp_path)
    assert r.rc == 0, r.err
    out = json.loads(r.out)
    assert out["global_batch"] == 16 and out["from"]["overridden"] == {"global_batch": "16"}
    said = [ln for ln in error_lines(r.err) if "flags override the file" in ln]
    assert said == ["trainfit: flags override the file: global_batch=16 (file: per-device batch 4 x accumulation 2 "
                    "x the devices of its launch)"]


# -- any flag with any --from kind: an answer, never a traceback -----------------------------------------------------
KINDS = {
    "ta.json": '{"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "bf16": true, "optim": "sgd"}',
    **SHARDED_WITHOUT_COUNT,
    "ddp.yaml": "distributed_type: MULTI_GPU\nmixed_precision: 'no'\nnum_processes: 2\n",
    "dsacc.yaml": "distributed_type: DEEPSPEED\nnum_processes: 4\nnum_machines: 2\ndeepspeed_config:\n"
                  "  zero_stage: 3\n  gradient_accumulation_steps: 2\n",
    "cli.yaml": "trainer:\n  devices: 2\n  precision: 16-mixed\n  strategy: ddp\ndata:\n  batch_size: 4\n",
    "flat.json": '{"devices": 1, "precision": "32-true", "accumulate_grad_batches": 4}',
}
FLAGS = {
    "global-batch": st.sampled_from(["8", "16", "7", "0", "x"]),
    "devices": st.sampled_from(["1", "2", "4", "3"]),
    "nodes": st.sampled_from(["1", "2"]),
    "precisions": st.sampled_from(["bf16-mixed", "fp32,bf16-true", "16-mixed"]),
    "strategies": st.sampled_from(["single", "ddp", "zero2,zero3", "zero1"]),
    "optimizer": st.sampled_from(["sgd", "adam"]),
    "device": st.sampled_from(["cpu", "h100"]),
    "write-for": st.sampled_from(["hf-trainer", "accelerate", "lightning"]),
}


@pytest.mark.slow  # ~0.8 s a plan, 40 of them
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(KINDS)), flags=st.dictionaries(st.sampled_from(sorted(FLAGS)), st.just(None)),
       data=st.data())
def test_any_flags_with_any_from_kind_answer_without_a_traceback(tmp_path_factory, kind, flags, data):
    root = tmp_path_factory.mktemp("from")
    path = _write(root / kind, KINDS[kind])
    args = [*PLAN, "--from", path, "--json"]
    for flag in flags:
        value = data.draw(FLAGS[flag], label=flag)
        if flag == "write-for":
            args += ["--write-for", value, str(root / ("out.yaml" if value == "accelerate" else "out.json"))]
        else:
            args += [f"--{flag}", value]
    before = snapshot(root)
    r = cli(args, cwd=root)
    check_promise(r, root, before, json_mode=True)  # exit 0 or 2, one error line, no traceback, nothing changed
    if r.rc == 2:
        assert len(error_lines(r.err)[-1]) <= LINE_CHARS
    needs_count = kind in SHARDED_WITHOUT_COUNT and "devices" not in flags and "nodes" not in flags
    if needs_count:  # sized on the launch's processes, or asked for them: never one device in silence
        assert r.rc == 2, r.err[-500:]
    if r.rc == 0 and "devices" in flags:
        got = json.loads(r.out)["devices"]
        assert got == int(args[args.index("--devices") + 1]) * int(dict(zip(args, args[1:])).get("--nodes", 1))
