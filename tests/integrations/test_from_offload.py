"""``--from`` reads each tool's offload onto trainfit's ``offload`` lever, or refuses it in one line (issue 38,
point 2, the read side).

Before, every offload setting was refused with an out-of-date reason ("trainfit keeps parameters on the device; no
offload to model"). Now FSDP's CPU offload (the Trainer's ``fsdp="... offload"`` / ``fsdp_config.cpu_offload``,
accelerate's ``fsdp_offload_params``, Lightning's ``FSDPStrategy(cpu_offload=True)`` and ``fsdp_cpu_offload``)
and DeepSpeed's ZeRO-Offload (``zero_optimization.offload_optimizer/offload_param.device``, accelerate's
``offload_*_device``, Lightning's ``DeepSpeedStrategy`` and ``deepspeed_stage_*_offload``) are read as the offload
trainfit runs under the same ZeRO stage. The references are each tool's own reading of the file (TrainingArguments'
plugin arguments, accelerate's config loader, Lightning's ``instantiate_class``, its strategy registry and
DeepSpeedStrategy's own config builder) and the mapping written out by hand from the tools' documentation:

- FSDP CPU offload moves the sharded parameters, their gradients and the optimizer step to the host: under
  FULL_SHARD (reshard after forward) that is trainfit's zero3 + ``optimizer,params``, under SHARD_GRAD_OP zero2 +
  ``optimizer`` (docs/offload.md's table);
- DeepSpeed stage 2 + offload_optimizer cpu is zero2 + ``optimizer``; stage 3 + both cpu is zero3 +
  ``optimizer,params``; every other combination with an offload (nvme, stage 0/1, one half of stage 3) is refused.
"""

from __future__ import annotations

import json
import warnings

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.reliability.cli_harness import check_one_line, check_promise, cli, error_lines, snapshot

from trainfit.config import make_config
from trainfit.errors import ConfigError
from trainfit.integrations.export_plan import TOOLS, export_plan
from trainfit.integrations.read_config import read_from

# By hand (docs/offload.md, the tools' docs): FSDP CPU offload under each ZeRO stage, as trainfit runs it.
FSDP_OFFLOAD = {"zero3": "optimizer,params", "zero2": "optimizer"}
# DeepSpeed (stage, optimizer device, parameter device) -> (strategy, offload); any other offload is refused.
DEEPSPEED_MODELED = {(2, "cpu", "none"): ("zero2", "optimizer"), (3, "cpu", "cpu"): ("zero3", "optimizer,params")}
STAGES = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}
TINY = ["--model", "gpt-tiny", "--model-config", "n_layer=2,d_model=64,n_head=2"]
FILES = {"hf-trainer": "args.json", "accelerate": "acc.yaml", "lightning": "pl.json"}


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _read(tmp_path, name: str, data) -> dict:
    text = yaml.safe_dump(data) if name.endswith(".yaml") else json.dumps(data)
    return dict(read_from(_write(tmp_path / name, text)).values)


# -- the round trip: what plan --write-for writes for an offloaded row reads back as that row ------------------------

OFFLOAD_ROW = st.fixed_dictionaries({
    "strategy": st.sampled_from(["zero2", "zero3"]),
    "precision": st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed"]),
    "devices": st.integers(2, 8),
    "micro_batch": st.integers(1, 16),
    "accumulation": st.integers(1, 8),
    "checkpointing": st.sampled_from(["none", "full"]),
})


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row=OFFLOAD_ROW, tool=st.sampled_from(TOOLS), nodes=st.sampled_from([1, 2]))
def test_a_written_offload_row_reads_back_with_its_strategy_precision_and_offload(tmp_path, row, tool, nodes):
    """Every FSDP row with CPU offload that export_plan writes (the planner's zero2 + optimizer, zero3 +
    optimizer,params; any precision a file holds) comes back from ``--from`` as the same strategy, precision and
    offload (before: refused, "trainfit keeps parameters on the device")."""
    offload = FSDP_OFFLOAD[row["strategy"]]
    cfg = make_config({**row, "offload": offload})
    out = export_plan(tool, cfg, nodes=nodes)
    values = _read_back(tmp_path, tool, out.text)
    assert (values["strategy"], values["precision"], values["offload"]) == (row["strategy"], row["precision"],
                                                                            offload), (tool, out.text)
    assert values.get("devices", row["devices"] * nodes) == row["devices"] * nodes


def _read_back(tmp_path, tool: str, text: str) -> dict:
    return dict(read_from(_write(tmp_path / FILES[tool], text)).values)


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_written_offload_row_is_read_as_the_tool_itself_reads_it(tmp_path, tool, strategy):
    """The same file, read by the tool: its FSDP plug-in's (or strategy's) CPU offload and resharding are what
    ``--from`` turned into trainfit's offload and strategy."""
    cfg = make_config({"strategy": strategy, "offload": FSDP_OFFLOAD[strategy], "devices": 2, "micro_batch": 2,
                       "precision": "bf16-mixed"})
    text = export_plan(tool, cfg).text
    values = _read_back(tmp_path, tool, text)
    if tool == "hf-trainer":
        reshards, offloads = _hf_reads(json.loads(text), tmp_path)
    elif tool == "accelerate":
        from accelerate.commands.config.config_args import load_config_from_file

        fsdp = load_config_from_file(str(tmp_path / FILES[tool])).fsdp_config
        reshards, offloads = fsdp["fsdp_reshard_after_forward"], fsdp["fsdp_offload_params"]
    else:
        from lightning.pytorch.cli import instantiate_class

        pl = instantiate_class((), json.loads(text)["trainer"]["strategy"])
        reshards, offloads = pl.sharding_strategy.name == "FULL_SHARD", bool(pl.cpu_offload.offload_params)
    assert offloads is True
    assert (values["strategy"], values["offload"]) == ("zero3" if reshards else "zero2",
                                                       FSDP_OFFLOAD["zero3" if reshards else "zero2"])


def _hf_reads(kwargs: dict, tmp_path) -> tuple[bool, bool]:
    """(reshard after forward, CPU offload) as TrainingArguments hands them to accelerate's FSDP plug-in."""
    from transformers import TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = TrainingArguments(output_dir=str(tmp_path / "out"), **{**kwargs, "ddp_backend": None, "use_cpu": True},
                                 report_to=[])
    plugin = args.fsdp_plugin_args
    return bool(plugin["reshard_after_forward"]), bool(plugin.get("cpu_offload", False))


# -- hand-written files of each tool, against the tool's own reading -------------------------------------------------

HF_FSDP = [  # TrainingArguments kwargs: every spelling of FSDP's CPU offload the Trainer reads (and one it does not)
    {"fsdp": "full_shard offload auto_wrap"},
    {"fsdp": ["shard_grad_op", "offload"]},
    {"fsdp": "offload"},  # no sharding word: the Trainer's default, reshard after forward
    {"fsdp": True, "fsdp_config": {"cpu_offload": True, "reshard_after_forward": False}},
    {"fsdp": True, "fsdp_config": {"fsdp_cpu_offload": True}},  # the Trainer strips the fsdp_ prefix
    {"fsdp": "shard_grad_op offload", "fsdp_config": {"cpu_offload": False}},  # the config's key wins (setdefault)
    {"fsdp": "shard_grad_op", "fsdp_config": {"reshard_after_forward": True, "cpu_offload": True}},
    {"fsdp": True, "fsdp_config": {"offload_params": True}},  # not a key the Trainer reads: no offload
]


@pytest.mark.parametrize("kwargs", HF_FSDP, ids=[json.dumps(k) for k in HF_FSDP])
def test_training_arguments_fsdp_offload_as_the_trainer_reads_it(tmp_path, kwargs):
    reshards, offloads = _hf_reads({**kwargs, "per_device_train_batch_size": 2}, tmp_path)
    strategy = "zero3" if reshards else "zero2"
    values = _read(tmp_path, "args.json", {**kwargs, "per_device_train_batch_size": 2})
    assert values["strategy"] == strategy
    assert values.get("offload", "") == (FSDP_OFFLOAD[strategy] if offloads else "")


ACCELERATE_FSDP = [(2, {"fsdp_reshard_after_forward": True}), (2, {"fsdp_reshard_after_forward": False}),
                   (1, {"fsdp_sharding_strategy": "SHARD_GRAD_OP"}), (1, {"fsdp_sharding_strategy": "FULL_SHARD"})]


@pytest.mark.parametrize("version, sharding", ACCELERATE_FSDP)
@pytest.mark.parametrize("offload", [True, False])
def test_accelerate_fsdp_offload_params_as_its_loader_reads_it(tmp_path, version, sharding, offload):
    from accelerate.commands.config.config_args import load_config_from_file

    data = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": "bf16",
            "num_machines": 1, "num_processes": 4, "machine_rank": 0, "use_cpu": False,
            "fsdp_config": {"fsdp_version": version, "fsdp_offload_params": offload, **sharding}}
    values = _read(tmp_path, "acc.yaml", data)
    loaded = load_config_from_file(str(tmp_path / "acc.yaml")).fsdp_config
    full = loaded.get("fsdp_reshard_after_forward", loaded.get("fsdp_sharding_strategy") == "FULL_SHARD")
    strategy = "zero3" if full else "zero2"
    assert values["strategy"] == strategy
    assert values.get("offload", "") == (FSDP_OFFLOAD[strategy] if loaded["fsdp_offload_params"] else "")


LIGHTNING_REGISTERED = ["fsdp_cpu_offload", "deepspeed_stage_2_offload", "deepspeed_stage_3_offload", "deepspeed",
                        "deepspeed_stage_2", "deepspeed_stage_3", "fsdp"]


@pytest.mark.parametrize("name", LIGHTNING_REGISTERED)
def test_lightning_registered_strategies_as_its_registry_defines_them(tmp_path, name):
    """Lightning's StrategyRegistry says what each name builds (its init parameters); trainfit reads the same
    stage and offload from the name."""
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[name]
    init = entry["init_params"]
    values = _read(tmp_path, "pl.json", {"devices": 2, "strategy": name, "precision": "bf16-mixed"})
    if "fsdp" in name:
        assert values["strategy"] == "zero3"  # FSDPStrategy's default FULL_SHARD
        assert values.get("offload", "") == ("optimizer,params" if init.get("cpu_offload") else "")
    else:
        stage = init.get("stage", 2)  # DeepSpeedStrategy's default stage
        key = (stage, "cpu" if init.get("offload_optimizer") else "none",
               "cpu" if init.get("offload_parameters") else "none")
        assert (values["strategy"], values.get("offload", "")) == DEEPSPEED_MODELED.get(key, (STAGES[stage], ""))


def _lightning_deepspeed_config(init_args: dict) -> dict:
    """The DeepSpeed config DeepSpeedStrategy builds from its arguments (its own ``_create_default_config``;
    its __init__ needs DeepSpeed installed, the builder does not)."""
    import inspect

    from lightning.pytorch.strategies import DeepSpeedStrategy

    params = inspect.signature(DeepSpeedStrategy.__init__).parameters
    defaults = {k: p.default for k, p in params.items() if k != "self" and p.default is not inspect.Parameter.empty}
    builder = inspect.signature(DeepSpeedStrategy._create_default_config).parameters
    kwargs = {k: v for k, v in {**defaults, **init_args}.items() if k in builder}
    return DeepSpeedStrategy._create_default_config(object.__new__(DeepSpeedStrategy), **kwargs)


DEVICES = ("none", "cpu", "nvme")
DS_COMBOS = [(stage, opt, par) for stage in range(4) for opt in DEVICES for par in DEVICES]


def _expect(stage: int, opt: str, par: str):
    """By hand: (strategy, offload), or None where trainfit refuses."""
    if (opt, par) == ("none", "none"):
        return STAGES[stage], ""
    return DEEPSPEED_MODELED.get((stage, opt, par))


@pytest.mark.parametrize("stage, opt, par", DS_COMBOS)
def test_deepspeed_offload_every_stage_and_device_in_each_tools_file(tmp_path, stage, opt, par):
    """The whole class of DeepSpeed offload settings (stage 0-3 x none/cpu/nvme for the optimizer and the
    parameters), as the Trainer's ``deepspeed`` config, accelerate's ``deepspeed_config`` and Lightning's
    DeepSpeedStrategy hold them: the two trainfit runs are read, every other offload refused naming the key."""
    zero = {"stage": stage, "offload_optimizer": {"device": opt, "pin_memory": True}, "offload_param": {"device": par}}
    lightning = {"stage": stage, "offload_optimizer": opt != "none", "offload_parameters": par != "none",
                 "offload_optimizer_device": opt if opt != "none" else "cpu",
                 "offload_params_device": par if par != "none" else "cpu"}
    built = _lightning_deepspeed_config(lightning)["zero_optimization"]  # Lightning's own config for those args
    assert (built.get("offload_optimizer", {}).get("device", "none"),
            built.get("offload_param", {}).get("device", "none")) == (opt, par)
    files = {"args.json": {"per_device_train_batch_size": 2, "deepspeed": {"zero_optimization": zero}},
             "acc.yaml": {"distributed_type": "DEEPSPEED", "num_processes": 2, "mixed_precision": "bf16",
                          "deepspeed_config": {"zero_stage": stage, "offload_optimizer_device": opt,
                                               "offload_param_device": par}},
             "pl.json": {"devices": 2, "precision": "bf16-mixed",
                         "strategy": {"class_path": "lightning.pytorch.strategies.DeepSpeedStrategy",
                                      "init_args": lightning}}}
    want = _expect(stage, opt, par)
    for name, data in files.items():
        if want is None:
            with pytest.raises(ConfigError) as caught:
                _read(tmp_path, name, data)
            message = str(caught.value)
            assert "\n" not in message and name in message
            assert "nvme" in message if "nvme" in (opt, par) else "'cpu'" in message, message
            assert "no offload to model" not in message  # the old, wrong reason
        else:
            values = _read(tmp_path, name, data)
            assert (values["strategy"], values.get("offload", "")) == want, (name, values)


def test_a_deepspeed_json_named_by_accelerate_or_lightning_is_read(tmp_path):
    """accelerate's ``deepspeed_config_file`` and Lightning's ``DeepSpeedStrategy(config=...)`` hand DeepSpeed its
    own JSON: its stage and offload are read from it (before: the YAML's absent zero_stage read as stage 0)."""
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    _write(tmp_path / "ds.json", json.dumps(ds))
    acc = _read(tmp_path, "acc.yaml", {"distributed_type": "DEEPSPEED", "num_processes": 2,
                                       "deepspeed_config": {"deepspeed_config_file": "ds.json"}})
    pl = _read(tmp_path, "pl.json", {"devices": 2, "strategy": {
        "class_path": "lightning.pytorch.strategies.DeepSpeedStrategy", "init_args": {"config": "ds.json"}}})
    assert (acc["strategy"], acc["offload"]) == (pl["strategy"], pl["offload"]) == ("zero3", "optimizer,params")


REFUSED = [  # file, data, what the one line names
    ("args.json", {"fsdp": "no_shard offload"}, "fsdp='no_shard offload'"),
    ("args.json", {"fsdp": True, "fsdp_config": {"cpu_offload": "false"}}, "fsdp_config.cpu_offload='false'"),
    ("args.json", {"deepspeed": {"zero_optimization": {"stage": 2, "cpu_offload": True}}},
     "deepspeed.zero_optimization.cpu_offload=True"),
    ("args.json", {"deepspeed": {"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}, "offload_param": {"device": "cpu"}}}},
     "offload_optimizer.ratio=0.3"),
    ("acc.yaml", {"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "NO_SHARD",
                                                               "fsdp_offload_params": True}},
     "fsdp_config.fsdp_offload_params=True"),
    ("pl.json", {"devices": 2, "strategy": "deepspeed_stage_3_offload_nvme"},
     "strategy='deepspeed_stage_3_offload_nvme'"),
    ("pl.json", {"devices": 2, "strategy": {"class_path": "lightning.pytorch.strategies.FSDPStrategy",
                                            "init_args": {"sharding_strategy": "NO_SHARD", "cpu_offload": True}}},
     "strategy.init_args.cpu_offload=True"),
]


@pytest.mark.parametrize("name, data, says", REFUSED, ids=[r[2] for r in REFUSED])
def test_what_trainfit_cannot_model_is_refused_naming_the_key(tmp_path, name, data, says):
    if name == "args.json":
        data = {"per_device_train_batch_size": 2, **data}  # what marks a TrainingArguments file
    with pytest.raises(ConfigError) as caught:
        _read(tmp_path, name, data)
    assert "no offload to model" not in str(caught.value)  # the old, wrong reason
    assert says in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


@pytest.mark.parametrize("command", ["memory", "plan"])
def test_an_nvme_offload_is_one_line_exit_2_nothing_written(tmp_path, command):
    _write(tmp_path / "acc.yaml", "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  zero_stage: 3\n"
                                  "  offload_optimizer_device: nvme\n  offload_param_device: nvme\n")
    before = snapshot(tmp_path)
    extra = ["--estimate"] if command == "memory" else ["--global-batch", "8", "--device-memory", "1GiB"]
    r = cli([command, "--from", str(tmp_path / "acc.yaml"), *extra, *TINY], cwd=tmp_path)
    check_promise(r, tmp_path, before)
    check_one_line(r)
    line = error_lines(r.err)[0]
    assert r.rc == 2 and "deepspeed_config.offload_optimizer_device='nvme'" in line and "cpu" in line, line


# -- memory --from and plan --from run with it --------------------------------------------------------------------


def test_memory_from_an_offloading_file_equals_the_same_flags(tmp_path):
    """``memory --from`` with a zero2 + CPU offload file measures what ``--strategy zero2 --offload optimizer``
    measures (the same RunConfig), and its stderr says the offload it read."""
    path = _write(tmp_path / "acc.yaml", "distributed_type: FSDP\nnum_processes: 2\nmixed_precision: 'no'\n"
                                         "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n"
                                         "  fsdp_offload_params: true\n")
    common = ["memory", "--estimate", "--json", "--batch", "2", *TINY]
    got = cli([*common, "--from", path], cwd=tmp_path)
    want = cli([*common, "--devices", "2", "--strategy", "zero2", "--offload", "optimizer"], cwd=tmp_path)
    assert got.rc == 0 and want.rc == 0, got.err + want.err
    assert "-> devices=2, precision=fp32, strategy=zero2, offload=optimizer" in got.err
    g, w = json.loads(got.out), json.loads(want.out)
    g.pop("from", None)
    for key in ("wall_s", "host_bytes"):
        assert (key in g) == (key in w)
    assert w.get("host_bytes"), "the flags' run keeps the optimizer in host memory"
    assert {k: v for k, v in g.items() if k != "wall_s"} == {k: v for k, v in w.items() if k != "wall_s"}


def test_plan_from_an_offloading_file_finds_its_row(tmp_path):
    """``plan --from`` of the file ``--write-for`` wrote for a zero3 + CPU offload row: the rank note finds the
    file's configuration, offload included, among the plans searched."""
    path = tmp_path / "pl.json"
    flags = ["plan", "--model", "llama-7b", "--basis", "analytic", "--device-memory", "40GiB", "--top", "3",
             "--precisions", "bf16-mixed", "--checkpointings", "full", "--strategies", "zero3"]
    r = cli([*flags, "--global-batch", "8", "--devices", "2", "--write-for", "lightning", str(path), "--json"])
    assert r.rc == 0, r.err
    row = json.loads(r.out)["plans"][0]
    assert row["offload"] == "optimizer,params"
    back = cli([*flags, "--from", str(path), "--json"])
    assert back.rc == 0, back.err
    notes = json.loads(back.out)["notes"]
    assert any("offload=optimizer,params) is plan #1 " in n for n in notes), notes
