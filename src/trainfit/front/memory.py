"""``trainfit memory`` as library calls: what fills memory in one optimizer step, estimated or measured.

    from trainfit.front.memory import estimate_memory, measure_memory
    r = estimate_memory(model="gpt-tiny", precision="bf16-mixed", devices=4, nodes=2, strategy="zero3")
    r.peak_bytes, r.extra["max_micro_batch"]   # with budget="24GiB"

Each returns the :class:`~trainfit.results.MemoryReport` of the configured micro-batch, with what the command
prints beside it in ``extra``: ``activations_per_sample_bytes`` and ``scaling`` (a second micro-batch reported and
a line fitted through both), ``budget_bytes``/``max_micro_batch`` with a budget, ``per_rank`` under torchrun.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from trainfit.config import MAX_COUNTS, DistributionSection, RunConfig
from trainfit.errors import ConfigError, check_int
from trainfit.front.request import config_of
from trainfit.meters.devices import device_row
from trainfit.probes.batchfit import fit_batch_scaling, second_batch
from trainfit.probes.compile import compiled_saved_bytes
from trainfit.probes.estimate import estimate_memory as estimate_step
from trainfit.probes.memory import example_batch
from trainfit.probes.memory import measure_memory as measure_step
from trainfit.probes.profile import task_flop_counter
from trainfit.progress import info
from trainfit.results import MemoryReport
from trainfit.run import task_of
from trainfit.strategies import launch
from trainfit.strategies import process_group as pg
from trainfit.tasks.files import load_text_data
from trainfit.tasks.spec import DataSpec
from trainfit.units import parse_bytes
from trainfit.vocabulary import parse_checkpoint_policy

ESTIMATE, MEASURE = "estimate", "measure"


def estimate_memory(config: RunConfig | None = None, *, devices: int = 1, nodes: int = 1, device: str = "cpu",
                    budget: int | str | None = None, **fields: Any) -> MemoryReport:
    """Trace one optimizer step under fake tensors (nothing allocated): per-rank bytes of ``config`` (or the
    RunConfig ``fields``) spread over ``devices`` per node x ``nodes`` ranks, with ``device``'s kernels.

    Raises:
        ConfigError: a bad field, device count or budget (one line, as ``trainfit memory --estimate`` says it).
    """
    world = _ranks(devices, nodes)
    cfg, budget_bytes = _request(config, fields, budget, ranks=world)
    device_row(device)  # an unknown device is refused before any work
    step = _estimator(cfg.section("distribution"), world, device)
    return _with_scaling(cfg, step, ESTIMATE, budget_bytes, joined=None)


def measure_memory(config: RunConfig | None = None, *, budget: int | str | None = None,
                   **fields: Any) -> MemoryReport:
    """Run two real optimizer steps on this machine and account every live storage of the second.

    Under torchrun each rank measures its own shards (``extra["per_rank"]`` on rank 0).

    Raises:
        ConfigError: a bad field or budget (one line, as ``trainfit memory`` says it).
    """
    cfg, budget_bytes = _request(config, fields, budget)
    joined = launch.join_if_launched(timeout_s=cfg.collective_timeout_s)  # torchrun: measure inside each rank
    return _with_scaling(cfg, measure_step, MEASURE, budget_bytes, joined=joined)


def compare_checkpointing(config: RunConfig | None = None, *, specs: str, method: str = MEASURE, devices: int = 1,
                          nodes: int = 1, device: str = "cpu", **fields: Any) -> list[dict]:
    """One row per policy in ``specs`` (comma-separated; ``class:A,B`` takes the names after it): the same
    run measured or estimated under each, and the recompute FLOPs ``FlopCounterMode`` counts for one step.

    Raises:
        ConfigError: a bad or empty spec, before any work.
    """
    cfg, _ = _request(config, fields, None, ranks=_ranks(devices, nodes) if method == ESTIMATE else None)
    if method == ESTIMATE:
        device_row(device)
        step = _estimator(cfg.section("distribution"), _ranks(devices, nodes), device)
    else:
        step = measure_step
    policies = [parse_checkpoint_policy(p) for p in _split_specs(specs)]  # every spec checked before any work
    task = task_of(cfg)
    mbs = [example_batch(task, cfg.micro_batch)] * cfg.accumulation
    rows = []
    for policy in policies:
        r = step(dataclasses.replace(cfg, checkpointing=policy))
        flops = task_flop_counter(task, policy).step(mbs)
        rows.append({"checkpointing": policy.spec, "activations_bytes": r.activations_bytes,
                     "peak_bytes": r.peak_bytes, "peak_phase": r.peak_phase,
                     "model_flops": flops.model_flops, "recompute_flops": flops.hardware_flops - flops.model_flops})
    return rows


def _request(config, fields: dict, budget, ranks: int | None = None) -> tuple[RunConfig, int | None]:
    cfg = config_of(config, fields, ranks=ranks)
    return cfg, (parse_bytes("budget", budget) if budget is not None else None)


def _ranks(devices: int, nodes: int) -> int:
    """Ranks of the estimate: ``devices`` per node x ``nodes`` (as torchrun and Lightning count them)."""
    check_ranks(devices, nodes)
    return devices * nodes


def check_ranks(devices: object, nodes: object) -> None:
    """``devices`` per node and ``nodes`` of an estimate: each an integer from 1 to the bound of a config's
    devices (``config.MAX_COUNTS``); the command line refuses its flags here too, in the same words."""
    top = MAX_COUNTS["devices"]
    check_int("devices", devices, minimum=1, maximum=top, fix=f"at most {top:,}: more than one run can use (a typo?)")
    check_int("nodes", nodes, minimum=1, maximum=top, fix=f"at most {top:,}: more than one run can use (a typo?)")


def _estimator(dist: DistributionSection, world: int, device: str) -> Callable[..., MemoryReport]:
    def step(c: RunConfig, batch: Any = None) -> MemoryReport:
        return estimate_step(c, batch=batch, world_size=world, strategy=dist.strategy, target=device)
    return step


def _split_specs(specs: str) -> list[str]:
    parts: list[str] = []
    for part in (p.strip() for p in str(specs).split(",")):
        if part and parts and parts[-1].startswith("class:") and ":" not in part:
            parts[-1] += "," + part  # class:A,B
        elif part:
            parts.append(part)
    if not parts:
        raise ConfigError("compare_checkpointing", specs, "comma-separated policies, e.g. none,selective,full")
    return parts


def _with_scaling(cfg: RunConfig, step, method: str, budget: int | None, *, joined) -> MemoryReport:
    """The report of ``cfg``'s micro-batch and a second one, the line through both, and the budget's fit."""
    report = step(cfg)
    if cfg.compile:  # the step above ran (or was traced) eagerly: say what the compiled step saves instead
        report = dataclasses.replace(report, notes=(*report.notes, compile_note(cfg, method, joined)))
    if cfg.data:  # rows from files: the sizing batch is the longest micro-batch this data produces
        longest = load_text_data(DataSpec.from_config(cfg)).longest  # cached: read once by the task already
        info("memory", f"activations sized for rows of {longest} tokens, the longest this data produces"
             + (" (packing: full seq_len)" if cfg.packing else ""))
    other = step(cfg, batch=second_batch(report.batch))
    scaling = fit_batch_scaling(cfg, batches=(report.batch, other.batch), reports=(report, other))
    extra: dict[str, Any] = {"activations_per_sample_bytes": round(scaling.activations_per_sample_bytes),
                             "scaling": scaling.to_dict()}
    # Under torchrun each rank measured its own shards; rank 0 reports them all.
    per_rank = pg.gather_to_rank0({p: report.parts[p] for p in ("params", "grads", "optimizer")}) if joined else None
    if per_rank:
        extra["per_rank"] = per_rank
    if budget:
        extra["budget_bytes"] = budget
        extra["max_micro_batch"] = scaling.max_micro_batch(budget)
    return dataclasses.replace(report, extra={**report.extra, **extra})


def compile_note(cfg: RunConfig, method: str, world) -> str:
    """``compile=True``: the tracker's dispatch mode keeps dynamo from compiling (measured: 0 graphs) and fake
    tensors cannot run compiled code, so the parts are the eager step's; one line with what the compiled
    forward saves for backward, measured on one micro-batch here (``probes.compile.compiled_saved_bytes``)."""
    if method == ESTIMATE or world is not None:
        return ("compile: the parts above are the eager step's (fake tensors cannot run compiled code); on the "
                "built-in GPTs the compiled forward saved the same bytes for backward (docs/compile.md); "
                "`trainfit memory --compile on` without --estimate measures it for this model")
    # The tracked steps above ran under the tracker, and dynamo remembers the frames it skipped there: forget
    # them, or the compiled run below would run eagerly too (measured: 0 graphs).
    torch._dynamo.reset()
    c = compiled_saved_bytes(cfg)
    return (f"compile: the parts above are the eager step's (dynamo compiles nothing under the tracker); saved for "
            f"backward by one micro-batch, measured: eager {c.eager_bytes:,} B, compiled {c.compiled_bytes:,} B "
            f"({c.graphs} graphs, {c.scope}); the partitioner's estimate of the compiled regions is "
            f"{c.gap_frac:+.1%} from measured")
