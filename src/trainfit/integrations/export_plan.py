"""``trainfit plan --write-for TOOL FILE``: the plan's chosen row as another tool's own configuration.

Most users train with the Hugging Face ``Trainer``, an Accelerate loop or Lightning. The planner's row --
precision, micro-batch, accumulation, activation checkpointing, strategy, gradient sync, devices -- is
written in that tool's vocabulary. A written plan runs exactly as planned, or is not written: the precision,
the sharding stage and the offload are in the file in the tool's own terms, or the row is refused
(:func:`unexpressed`, :func:`unrunnable`; with ``--write-for`` the search keeps to what the file holds). Every
other lever the tool cannot express exactly (loss weighting, a checkpointing period, FSDP's reduce dtype, the
device count of a torchrun launch) is listed as a :class:`Gap`: what trainfit would do, and what the tool will
do instead. Nothing is dropped quietly.

* ``hf-trainer``: ``transformers.TrainingArguments`` keyword arguments as JSON (``TrainingArguments(
  output_dir=..., **json.load(f))``); FSDP2 through ``fsdp=True, fsdp_config={"version": 2, ...}``
  (transformers 5.x reads ``version``, default 2), ``every:K`` through
  ``activation_checkpointing_kwargs={"every_n_layers": K}`` (checkpoints layers 0, K, 2K, ... as trainfit does).
* ``accelerate``: an ``accelerate launch --config_file`` YAML as ``accelerate config`` writes it
  (``ClusterConfig``). The file has no key for the micro-batch or the accumulation (its loader refuses
  unknown keys): they are script settings, written as comments and listed as gaps.
* ``lightning``: ``{"trainer": Trainer kwargs, "fabric": Fabric kwargs, "batch_size": micro-batch}`` as JSON;
  under zero2/zero3 each ``strategy`` is the FSDPStrategy object as LightningCLI spells it (``class_path``,
  ``init_args`` with its ``sharding_strategy`` and ``cpu_offload``: ``lightning.pytorch.cli.instantiate_class``
  builds it); Lightning starts the processes itself.

It maps a :class:`~trainfit.config.RunConfig` (the plan's row, as ``plan --write`` writes it) to text: only the
levers the plan chose (precision, micro-batch, accumulation, checkpointing, distribution, offload, compile); the
user's lr, steps, schedule, seed and clipping are left out. A strategy the tool would run as something else on
the planned device (:func:`unrunnable`: FSDP on CPU processes, ZeRO-1, accelerate's CPU processes without MPI) is
refused, never written. Whether a tool is installed is asked of ``importlib`` without importing it; the
accelerate YAML is built with accelerate's own ``ClusterConfig`` and PyYAML.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass

from trainfit.config import DistributionSection, LeversSection, RunConfig, ScheduleSection
from trainfit.errors import ConfigError
from trainfit.outputs import check_output_file
from trainfit.vocabulary import (
    PRECISIONS,
    STRATEGIES,
    Dtype,
    EveryBlock,
    EveryKthBlock,
    GradSync,
    NoCheckpointing,
    OffloadPart,
    Optimizer,
    PrecisionName,
    StrategyName,
    mixed_counterpart,
    parse_offload,
    precision_facts,
    strategy_facts,
)

TOOLS = ("hf-trainer", "accelerate", "lightning")
"""The tools ``--write-for`` writes a configuration for."""
MODULES = {"hf-trainer": "transformers", "accelerate": "accelerate", "lightning": "lightning"}
"""The package each tool is imported as."""
EXTRAS = {"hf-trainer": "hf", "accelerate": "accelerate", "lightning": "lightning"}
"""The pip extra that installs each tool: ``pip install 'trainfit[EXTRA]'``."""
SUFFIXES = {"hf-trainer": ".json", "accelerate": ".yaml", "lightning": ".json"}
"""What each written file holds (the file name may end as the user likes; this is the format)."""


@dataclass(frozen=True, kw_only=True)
class Gap:
    """One lever the tool cannot express exactly."""

    lever: str
    """The plan's lever: precision, accumulation, checkpointing, strategy, grad_sync, micro_batch, ..."""
    trainfit: str
    """What the plan (trainfit) does."""
    instead: str
    """What the tool will do with the written configuration, and what to add by hand where it can."""

    def line(self) -> str:
        return f"{self.lever}: trainfit {self.trainfit}; instead {self.instead}"


@dataclass(frozen=True, kw_only=True)
class ToolConfig:
    """A tool's configuration for one plan row: the file's text and the levers it cannot hold exactly."""

    tool: str
    text: str
    """The file's contents (JSON or YAML)."""
    values: dict
    """What ``text`` holds, as Python values (the JSON object; for accelerate the YAML's keys)."""
    gaps: tuple[Gap, ...]
    script: dict
    """Settings the tool takes in the training script, not in this file (accelerate: Accelerator kwargs)."""


def check_tool(tool: str) -> str:
    """Refuse an unknown tool (listing them) or one that is not installed (naming the extra); return it."""
    if tool not in TOOLS:
        raise ConfigError("write-for", tool, TOOLS)
    try:
        found = importlib.util.find_spec(MODULES[tool]) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError("write-for", tool, f"an installed tool ({MODULES[tool]} is not installed)",
                          f"pip install 'trainfit[{EXTRAS[tool]}]'")
    return tool


_NO_ZERO1 = "it has no ZeRO-1 outside DeepSpeed: it would run DDP with the optimizer state replicated"
_NO_CPU_FSDP = {
    "hf-trainer": "the Trainer shards through Accelerate, which applies FSDP only on accelerators: CPU processes run "
                  "MULTI_CPU DDP with whole parameters",
    "accelerate": "Accelerate applies FSDP only on accelerators: CPU processes run MULTI_CPU DDP with whole parameters",
    "lightning": "Lightning's FSDPStrategy runs only on CUDA devices",
}


def unrunnable(tool: str, strategy: str, *, cpu: bool, devices: int) -> str | None:
    """Why ``tool`` cannot run ``strategy`` on ``devices`` processes (all nodes) of the device, or None.

    A plan written for a tool must run as planned: a strategy the tool would silently run as something else
    (another sharding, another number of processes) is refused, never written."""
    if devices <= 1 or not strategy_facts(strategy).distributed:
        return None
    if cpu and tool == "accelerate":
        return ("accelerate launch starts several CPU processes only through MPI (mpirun_hostfile), which trainfit "
                "does not write: without it one process trains")
    if strategy_facts(strategy).shards_optimizer_by_parameter:
        return _NO_ZERO1
    if cpu and strategy_facts(strategy).fsdp:
        return _NO_CPU_FSDP[tool]
    return None


def runnable_strategies(tool: str, chosen: tuple[str, ...] | None, *, cpu: bool,
                        devices: int) -> tuple[str, ...] | None:
    """The strategies a plan for ``tool`` searches: ``chosen`` (``--strategies``; refused if the tool cannot run
    one of them as planned on this device), or every strategy it can run (None: all of them, no narrowing)."""
    for name in chosen or ():
        why = unrunnable(tool, name, cpu=cpu, devices=devices)
        if why is not None:
            where = "processes of device cpu" if cpu else "accelerators"
            raise ConfigError("strategies", name, f"a strategy {tool} runs as planned on {devices} {where}", why)
    if chosen:
        return chosen
    runs = tuple(s.value for s in STRATEGIES if unrunnable(tool, s, cpu=cpu, devices=devices) is None)
    return None if len(runs) == len(STRATEGIES) else runs


_NO_MASTER_COPY = {
    "hf-trainer": "the Trainer's bf16/fp16=True is autocast over fp32 weights",
    "accelerate": "accelerate's mixed_precision is autocast over fp32 weights",
    "lightning": "Lightning's precision=\"{lightning}\" updates the half weights themselves, with no fp32 master copy",
}


def unexpressed(tool: str, *, precision: str, offload: str, strategy: str) -> str | None:
    """Why ``tool``'s file cannot hold the row's precision or offload as planned, or None.

    A written plan runs exactly as planned, or is not written: trainfit writes no DeepSpeed section, so a
    master-copy precision (bf16-true, fp16-true), an optimizer offload outside FSDP and an activation offload have
    no setting in any of the three files. FSDP's own CPU offload (zero2/zero3) has one in each."""
    p = precision_facts(precision)
    if p.master_copy:
        return (f"{precision} keeps {p.weights} weights and an fp32 master copy the optimizer updates, which "
                f"{tool} has only through DeepSpeed (not written by trainfit): "
                + _NO_MASTER_COPY[tool].format(lightning=p.lightning) + f"; plan with --precisions "
                f"{mixed_counterpart(precision)} (fp32 weights, {p.compute} autocast)")
    parts = parse_offload(offload)
    if OffloadPart.ACTIVATIONS in parts:
        return (f"activation offload (tensors saved for backward kept in host memory) has no setting in {tool}'s "
                "file: torch.autograd.graph.save_on_cpu would wrap the forward in the script; plan with --offloads "
                "none or optimizer")
    if OffloadPart.OPTIMIZER in parts and not strategy_facts(strategy).fsdp:
        return (f"an optimizer offload under {strategy} is DeepSpeed ZeRO-Offload's (not written by trainfit): "
                f"{tool} would keep the optimizer state on the device, past the plan's device peak; FSDP's CPU "
                "offload exists only under zero2/zero3: plan with --strategies zero2,zero3 or --offloads none")
    return None


def expressible_precisions(tool: str, chosen: tuple[str, ...] | None) -> tuple[str, ...]:
    """The precisions a plan for ``tool`` searches: ``chosen`` (``--precisions``; refused if the tool's file cannot
    hold one of them), or every precision it can hold."""
    for name in chosen or ():
        why = unexpressed(tool, precision=name, offload="", strategy=StrategyName.SINGLE)
        if why is not None:
            raise ConfigError("precisions", name, f"a precision {tool}'s file holds as planned", why)
    return chosen or tuple(str(p) for p in PRECISIONS if unexpressed(tool, precision=p, offload="",
                                                                    strategy=StrategyName.SINGLE) is None)


def expressible_offloads(tool: str, settings: tuple[str, ...], strategies: tuple[str, ...] | None, *, devices: int,
                         chosen: bool) -> tuple[str, ...]:
    """The offload settings a plan for ``tool`` searches among ``settings`` (``chosen``: ``--offloads``, refused if
    the tool's file can hold one under none of the searched ``strategies``; else narrowed to those it can hold).
    An optimizer offload is held under FSDP (zero2/zero3 on several devices) only."""
    names = strategies if strategies is not None else tuple(STRATEGIES)
    searched = [s for s in names if devices > 1 or not strategy_facts(s).distributed] or [StrategyName.SINGLE]
    kept = []
    for setting in settings:
        whys = [unexpressed(tool, precision=PrecisionName.FP32, offload=setting, strategy=s) for s in searched]
        if all(whys):
            if chosen:
                raise ConfigError("offloads", setting or "none", f"an offload {tool}'s file holds as planned under "
                                  f"{', '.join(map(str, searched))} on {devices} device(s)", whys[0])
            continue
        kept.append(setting)
    return tuple(kept) or ("",)


def export_plan(tool: str, cfg: RunConfig, *, nodes: int = 1, cpu: bool = False) -> ToolConfig:
    """``cfg`` (the plan's row: ``cfg.devices`` per node) as ``tool``'s configuration.

    Args:
        tool: one of :data:`TOOLS`.
        cfg: the RunConfig ``plan --write`` would write for the chosen row.
        nodes: nodes the devices are spread over (``cfg.devices`` is per node).
        cpu: the plan is for CPU processes (gloo), not accelerators.
    Raises:
        ConfigError: an unknown tool, a strategy the tool would run as something else (:func:`unrunnable`), or a
            precision or offload its file cannot hold (:func:`unexpressed`): one line, nothing written.
    """
    if tool not in TOOLS:
        raise ConfigError("write-for", tool, TOOLS)
    runnable_strategies(tool, (cfg.strategy,), cpu=cpu, devices=_total_devices(cfg.section("distribution"), nodes))
    why = unexpressed(tool, precision=cfg.precision, offload=cfg.offload, strategy=cfg.strategy)
    if why is not None:
        raise ConfigError("write-for", tool, f"a plan row {tool} runs as planned (precision, offload and sharding "
                          "in its own terms)", f"the row's precision={cfg.precision}, offload={cfg.offload or 'none'}, "
                          f"strategy={cfg.strategy}: {why}")
    if cfg.micro_batch == "auto":
        raise ConfigError("micro_batch", "auto", "an integer", "a plan row has a fixed micro-batch")
    writer = {"hf-trainer": _hf_trainer, "accelerate": _accelerate, "lightning": _lightning}[tool]
    return writer(cfg, nodes=nodes, cpu=cpu)


# -- shared facts --------------------------------------------------------------------------------------------
def _zero1_gap(strategy: str, instead: str) -> Gap:
    """A strategy whose row shards the optimizer state by parameter (ZeRO-1): no tool has it outside DeepSpeed."""
    return Gap(lever="strategy", trainfit=f"runs {strategy}: DDP with the optimizer state sharded "
                                          "(ZeroRedundancyOptimizer), optimizer memory / devices",
               instead=instead + "; the plan's memory figure assumed the sharded state -- replan with "
                                 "--strategies ddp,zero2,zero3 if it no longer fits")


def _token_gap(instead: str) -> Gap:
    return Gap(lever="accumulation", trainfit="weights each micro-batch's loss sum by the whole window's token "
                                              "count (all micro-batches, all ranks): the big batch's gradient",
               instead=instead)


def _windowed(levers: LeversSection, dist: DistributionSection, nodes: int) -> bool:
    """More than one micro-batch per optimizer step (over all ranks): where loss weighting can differ."""
    return levers.accumulation * _total_devices(dist, nodes) > 1


def _block_period(ckpt) -> int | None:
    """The one fact the tools' checkpointing settings take: every how many blocks a whole block is checkpointed
    (0: none, 1: every block, K: every:K); None for a policy of modules or ops (class:Name, selective, budget:F),
    which no tool's setting holds. The only place the policy's class is asked."""
    if isinstance(ckpt, NoCheckpointing):
        return 0
    if isinstance(ckpt, EveryBlock):
        return 1
    return ckpt.k if isinstance(ckpt, EveryKthBlock) else None


def _ckpt_name(levers: LeversSection) -> str:
    return levers.checkpointing.spec


def _total_devices(dist: DistributionSection, nodes: int) -> int:
    return dist.devices * nodes if strategy_facts(dist.strategy).distributed else 1


# -- Hugging Face Trainer ------------------------------------------------------------------------------------
HF_OPTIM = {Optimizer.ADAMW: "adamw_torch", Optimizer.ADAM: "adamw_torch", Optimizer.SGD: "sgd"}


def _hf_trainer(cfg: RunConfig, *, nodes: int, cpu: bool) -> ToolConfig:
    lev, dist, sched = cfg.section("levers"), cfg.section("distribution"), cfg.section("schedule")
    gaps: list[Gap] = []
    precision = lev.precision
    s = strategy_facts(dist.strategy)
    # Only the levers the plan chose: the user's own hyperparameters (lr, steps, schedule, seed, clipping,
    # optimizer) stay theirs -- TrainingArguments(**file) must not replace them.
    args: dict = {
        "per_device_train_batch_size": lev.micro_batch,
        "gradient_accumulation_steps": lev.accumulation,
        "bf16": precision_facts(precision).autocast == Dtype.BF16,
        "fp16": precision_facts(precision).autocast == Dtype.FP16,
        "average_tokens_across_devices": True,
    }
    if cpu:
        args["use_cpu"] = True
    if sched.optimizer != Optimizer.ADAMW:
        gaps.append(_optimizer_gap(sched, "optim=" + HF_OPTIM[sched.optimizer]))
    # Accumulation: the Trainer counts the window's loss tokens (num_items_in_batch, summed over ranks with
    # average_tokens_across_devices) and hands the count to a model whose forward takes it.
    if _windowed(lev, dist, nodes):
        gaps.append(_token_gap("the Trainer counts the window's tokens too (num_items_in_batch, "
                               "average_tokens_across_devices=True) and passes them to a model whose forward takes "
                               "**kwargs; how exact that is depends on the model's loss (trainfit verify --framework "
                               "hf-trainer measures it); a per-micro-batch mean loss gets a mean of means"))
    fsdp_config: dict | None = None
    if s.fsdp:
        fsdp_config = {"version": 2, "reshard_after_forward": s.reshard_after_forward}
        if precision_facts(precision).autocast is not None:
            gaps.append(Gap(lever="precision", trainfit=f"reduce-scatters gradients in fp32 under {dist.strategy} "
                                                        "(MixedPrecisionPolicy reduce_dtype=float32)",
                            instead=f"Accelerate's FSDP2 policy from bf16/fp16=True reduces in "
                                    f"{precision_facts(precision).compute}"))
    gaps += _hf_checkpointing(lev, args, fsdp_config)
    if fsdp_config is not None:
        args["fsdp"] = True
        args["fsdp_config"] = fsdp_config
        if _fsdp_cpu_offload(lev):
            fsdp_config["cpu_offload"] = True  # FSDP2's CPUOffloadPolicy: sharded params, grads and the step
        if dist.grad_sync == GradSync.PER_MICRO_BATCH:
            args["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    if s.shards_optimizer_by_parameter:
        gaps.append(_zero1_gap(dist.strategy, "the Trainer has no ZeRO-1 outside DeepSpeed: launched with torchrun "
                                              "it runs DDP with the optimizer state replicated"))
    if s.distributed:
        args["ddp_backend"] = "gloo" if cpu else "nccl"
        gaps.append(Gap(lever="devices", trainfit=f"launches {dist.devices} processes per node x {nodes} node(s)",
                        instead=f"not a TrainingArguments field: launch the script with torchrun "
                                f"--nproc_per_node={dist.devices} --nnodes={nodes}"))
    if lev.compile:
        args["torch_compile"] = True
        gaps.append(_compile_gap("torch_compile=True compiles the whole model once (one graph, inductor)"))
    text = json.dumps(args, indent=2) + "\n"
    return ToolConfig(tool="hf-trainer", text=text, values=args, gaps=tuple(gaps), script={})


def _hf_checkpointing(levers: LeversSection, args: dict, fsdp_config: dict | None) -> list[Gap]:
    """Activation checkpointing as TrainingArguments (``args``), or FSDP's own in ``fsdp_config`` under FSDP2
    (both filled in here); the gaps of what the Trainer checkpoints otherwise."""
    every = _block_period(levers.checkpointing)
    gaps: list[Gap] = []
    if every == 0:
        args["activation_checkpointing"] = False
    elif every == 1 and fsdp_config is not None:
        fsdp_config["activation_checkpointing"] = True  # transformers: FSDP's own, no extra all-gather
    elif every is not None:
        args["activation_checkpointing"] = True
        if every > 1:
            args["activation_checkpointing_kwargs"] = {"every_n_layers": every}
            if fsdp_config is not None:
                gaps.append(Gap(lever="checkpointing", trainfit=f"checkpoints every {every}th block inside FSDP2",
                                instead="activation_checkpointing with every_n_layers under FSDP: transformers "
                                        "warns it adds an all-gather in backward"))
    else:  # class:Name, selective, budget:F
        args["activation_checkpointing"] = True
        gaps.append(Gap(lever="checkpointing", trainfit=f"checkpoints the modules of {_ckpt_name(levers)}",
                        instead="activation_checkpointing=True checkpoints every decoder layer the model marks "
                                "(GradientCheckpointingLayer), whatever its class"))
    return gaps


def _optimizer_gap(schedule: ScheduleSection, setting: str) -> Gap:
    return Gap(lever="optimizer", trainfit=f"priced the optimizer state of {schedule.optimizer}",
               instead=f"the file leaves the optimizer to the script (the tool's default may hold another state): "
                       f"{setting}")


def _fsdp_cpu_offload(levers: LeversSection) -> bool:
    """The optimizer offloaded: under zero2/zero3 FSDP2's CPUOffloadPolicy, which each tool's FSDP switch sets."""
    return OffloadPart.OPTIMIZER in parse_offload(levers.offload)


def _compile_gap(instead: str) -> Gap:
    return Gap(lever="compile", trainfit="compiles each repeated block on its own (one graph every block reuses)",
               instead=instead + "; the plan priced the compiled step at a measured or given speed-up, which a "
                                 "different compile scope may not reach")


# -- Accelerate ----------------------------------------------------------------------------------------------


def _accelerate(cfg: RunConfig, *, nodes: int, cpu: bool) -> ToolConfig:
    lev, dist = cfg.section("levers"), cfg.section("distribution")
    gaps: list[Gap] = []
    precision = lev.precision
    s = strategy_facts(dist.strategy)
    values = _accelerate_values(dist, precision, nodes=nodes, cpu=cpu)
    script: dict = {"gradient_accumulation_steps": lev.accumulation}
    ckpt = lev.checkpointing
    if s.fsdp:
        values["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": s.reshard_after_forward,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_offload_params": _fsdp_cpu_offload(lev),
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_activation_checkpointing": _block_period(ckpt) == 1,
        }
        if precision_facts(precision).autocast is not None:
            gaps.append(Gap(lever="precision", trainfit=f"reduce-scatters gradients in fp32 under {dist.strategy} "
                                                        "(MixedPrecisionPolicy reduce_dtype=float32)",
                            instead=f"Accelerate's FSDP2 policy from mixed_precision reduces in "
                                    f"{precision_facts(precision).compute}"))
    if dist.grad_sync == GradSync.PER_MICRO_BATCH:
        script["sync_each_batch"] = True
    gaps.append(Gap(lever="micro_batch and accumulation",
                    trainfit=f"runs micro-batches of {lev.micro_batch}, {lev.accumulation} per optimizer step",
                    instead="accelerate's config file has no key for them (its loader refuses unknown keys): in "
                            "the script, DataLoader(batch_size=" + str(lev.micro_batch) + ") and "
                            + _accelerator_call(script) + " (written as comments in the file)"))
    if _windowed(lev, dist, nodes):
        gaps.append(_token_gap("accelerator.backward divides each micro-batch's loss by gradient_accumulation_steps: "
                               "a mean of means unless the loss is the micro-batch's sum over the window's token "
                               "count (gathered across ranks) times gradient_accumulation_steps x num_processes"))
    if _block_period(ckpt) != 0 and not (s.fsdp and _block_period(ckpt) == 1):
        where = "fsdp_activation_checkpointing checkpoints every wrapped layer, so it is off" if s.fsdp else \
            "the config file holds activation checkpointing only under FSDP"
        gaps.append(Gap(lever="checkpointing", trainfit=f"checkpoints {_ckpt_name(lev)}",
                        instead=where + "; enable it in the script (a transformers model: "
                                + _hf_enable_call(ckpt) + ")"))
    if s.shards_optimizer_by_parameter:
        gaps.append(_zero1_gap(dist.strategy, "accelerate has no ZeRO-1 outside DeepSpeed: MULTI_GPU/MULTI_CPU is "
                                              "DDP with the optimizer state replicated (or wrap the optimizer in "
                                              "torch.distributed.optim.ZeroRedundancyOptimizer in the script)"))
    if lev.compile:
        values["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
        gaps.append(_compile_gap("dynamo_config (backend INDUCTOR) makes accelerator.prepare compile the whole model"))
    if s.distributed and nodes > 1:
        gaps.append(Gap(lever="devices", trainfit=f"launches {dist.devices} processes on each of {nodes} nodes",
                        instead="machine_rank is written as 0 and main_process_ip is not written: set both in each "
                                "node's copy (or pass --machine_rank / --main_process_ip to accelerate launch)"))
    lines = ["# accelerate launch --config_file THIS_FILE train.py  (written by trainfit plan --write-for accelerate)",
             f"# in the script: DataLoader(batch_size={lev.micro_batch}); {_accelerator_call(script)}"]
    text = "\n".join(lines) + "\n" + _yaml(values)
    return ToolConfig(tool="accelerate", text=text, values=values, gaps=tuple(gaps), script=script)


def _accelerate_values(dist: DistributionSection, precision: PrecisionName, *, nodes: int, cpu: bool) -> dict:
    """The ``ClusterConfig`` keys every accelerate file holds: where and how many processes run, the precision."""
    s = strategy_facts(dist.strategy)
    kind = s.accelerate_distributed_type
    if cpu and kind == "MULTI_GPU":
        kind = "MULTI_CPU"
    return {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": kind,
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": precision_facts(precision).accelerate,
        "num_machines": nodes if s.distributed else 1,
        "num_processes": _total_devices(dist, nodes),
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": cpu,
    }


def _accelerator_call(script: dict) -> str:
    if script.get("sync_each_batch"):
        return (f"Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin("
                f"num_steps={script['gradient_accumulation_steps']}, sync_each_batch=True))")
    return f"Accelerator(gradient_accumulation_steps={script['gradient_accumulation_steps']})"


def _hf_enable_call(ckpt) -> str:
    if (_block_period(ckpt) or 0) > 1:
        return f"model.activation_checkpointing_enable(every_n_layers={ckpt.k})"
    return "model.activation_checkpointing_enable()"


def _yaml(values: dict) -> str:
    """``values`` as accelerate's own ``ClusterConfig`` (it refuses unknown keys and values), dumped by PyYAML:
    every string quoted as YAML needs (a bare NO/no would read as a YAML 1.1 boolean)."""
    import yaml  # accelerate's own dependency (its loader is yaml.safe_load); lazy: only this writer needs it
    from accelerate.commands.config.config_args import ClusterConfig

    ClusterConfig(**values)  # raises on a key or value accelerate does not take
    return yaml.safe_dump(values, sort_keys=False, default_flow_style=False)


# -- Lightning -----------------------------------------------------------------------------------------------


def _lightning(cfg: RunConfig, *, nodes: int, cpu: bool) -> ToolConfig:
    lev, dist = cfg.section("levers"), cfg.section("distribution")
    gaps: list[Gap] = []
    precision = lev.precision
    s = strategy_facts(dist.strategy)
    strategy = s.lightning_strategy
    devices = dist.devices if s.distributed else 1
    common = {"accelerator": "cpu" if cpu else "gpu", "devices": devices, "num_nodes": nodes if s.distributed else 1,
              "precision": precision_facts(precision).lightning}
    trainer = {**common, "strategy": _lightning_strategy(s, lev, "pytorch"),
               "accumulate_grad_batches": lev.accumulation}  # max_steps, clipping: the user's own
    values: dict = {"trainer": trainer, "fabric": {**common, "strategy": _lightning_strategy(s, lev, "fabric")},
                    "batch_size": lev.micro_batch}
    if s.fsdp:
        gaps.append(Gap(lever="strategy", trainfit=f"runs {dist.strategy} on FSDP2 (fully_shard)",
                        instead=f"Lightning's FSDPStrategy is FSDP1 (FullyShardedDataParallel) with "
                                f"sharding_strategy={s.fsdp_sharding_strategy}: the same ZeRO stage; the file's "
                                "strategy is the object's class_path and init_args: build it with "
                                "lightning.pytorch.cli.instantiate_class((), cfg['trainer']['strategy'])"))
        if dist.grad_sync == GradSync.PER_MICRO_BATCH:
            gaps.append(Gap(lever="grad_sync", trainfit="reduce-scatters gradients after every micro-batch",
                            instead="Lightning has no setting for it; its strategy's own accumulation applies"))
    if s.shards_optimizer_by_parameter:
        gaps.append(_zero1_gap(dist.strategy, 'strategy="ddp" replicates the optimizer state (or return '
                               "torch.distributed.optim.ZeroRedundancyOptimizer from configure_optimizers)"))
    ckpt = lev.checkpointing
    if _block_period(ckpt) != 0:
        fsdp_hint = "; under fsdp, FSDPStrategy(activation_checkpointing_policy={YourBlock})" if s.fsdp else ""
        gaps.append(Gap(lever="checkpointing", trainfit=f"checkpoints {_ckpt_name(lev)}",
                        instead="Trainer and Fabric take no activation-checkpointing argument: enable it in the "
                                "model (a transformers model: " + _hf_enable_call(ckpt) + ")" + fsdp_hint))
    if _windowed(lev, dist, nodes):
        gaps.append(_token_gap("Lightning divides each training_step loss by accumulate_grad_batches: a mean of means "
                               "unless training_step returns the micro-batch's sum over the window's token count "
                               "times accumulate_grad_batches"))
    if lev.compile:
        gaps.append(_compile_gap("Trainer and Fabric take no compile argument: call torch.compile on the model (or "
                                 "on each block) in the script"))
    text = json.dumps(values, indent=2) + "\n"
    return ToolConfig(tool="lightning", text=text, values=values, gaps=tuple(gaps), script={})


def _lightning_strategy(s, levers: LeversSection, package: str) -> str | dict:
    """Lightning's strategy for ``s`` (:class:`~trainfit.vocabulary.StrategyFacts`): its registered name (auto,
    ddp), or under FSDP the strategy object as LightningCLI spells one (class_path and init_args), its sharding
    strategy and CPU offload named: the name "fsdp" alone would run FULL_SHARD (zero3) whatever the plan's stage.
    ``package``: ``pytorch`` (Trainer) or ``fabric`` (Fabric), each with its own FSDPStrategy class."""
    if not s.fsdp:
        return s.lightning_strategy
    init: dict = {"sharding_strategy": s.fsdp_sharding_strategy, "state_dict_type": "sharded"}
    if _fsdp_cpu_offload(levers):
        init["cpu_offload"] = True  # FSDP1's CPUOffload(offload_params=True): sharded params, grads and the step
    return {"class_path": f"lightning.{package}.strategies.FSDPStrategy", "init_args": init}


def check_write_for(pair, *, force: bool = False):
    """``--write-for TOOL FILE`` checked before any work: a known, installed tool and a FILE that does not exist
    (unless ``force``) whose name ends as the tool reads it (accelerate picks JSON or YAML by the extension).
    Returns (tool, Path)."""
    tool, path = pair
    check_tool(tool)
    p = check_output_file("write-for", path, force=force)
    allowed = (".yaml", ".yml") if tool == "accelerate" else (SUFFIXES[tool],)
    if p.suffix.lower() not in allowed:
        raise ConfigError("write-for", str(p), f"a file name ending in {' or '.join(allowed)} for {tool}")
    return tool, p
