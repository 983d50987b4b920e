"""A basis from the memory probes: four full memory reports per (precision, checkpointing) pair, estimated
(``probes.estimate``) or measured (``probes.memory``), plus the FLOPs counted on the meta device.

The full paths of :func:`trainfit.probes.fastbasis.basis_provider` (``--basis estimate`` / ``measure``), which
imports this module only when one of them is asked for: it builds runs (``torch.distributed.tensor``, a model's
library), which the cached and analytic bases never need. Its own module so that ``probes.calibrate``, which
uses the providers, and ``probes.fastbasis``, which hands this one out, import each other in neither direction.
"""

from __future__ import annotations

from trainfit.config import RunConfig, make_config
from trainfit.plan.basis import basis_from_reports
from trainfit.plan.cost import Basis
from trainfit.probes.estimate import BASIS_BATCHES, estimate_memory, model_units
from trainfit.probes.memory import example_batch, measure_memory
from trainfit.probes.profile import task_flop_counter
from trainfit.progress import logger, stage
from trainfit.run import task_of
from trainfit.vocabulary import StrategyName

log = logger("plan")


def report_basis(base_cfg: RunConfig, precision: str, checkpointing: str, *, source: str) -> Basis:
    """Basis from two memory reports (micro-batches BASIS_BATCHES) plus FLOPs counted on the meta device."""
    cfg = make_config({"precision": precision, "checkpointing": checkpointing, "micro_batch": 1,
                       "accumulation": 1, "strategy": StrategyName.SINGLE}, base=base_cfg)
    probe = estimate_memory if source == "estimate" else measure_memory
    verb = "estimating memory report" if source == "estimate" else "measuring memory report"

    with stage("plan", 4, verb=verb, log=log) as reports:  # what the probes say inside is debug
        def rep(cfg: RunConfig, batch: int):
            reports.step(f"{precision}, {checkpointing}: micro-batch {batch} x accumulation {cfg.accumulation}")
            return probe(cfg, batch=batch)

        # Two micro-batches large enough that activations dominate the forward/backward peak: at 1
        # the peak can sit at a different moment (late in backward), which a line through it misses.
        r1, r2 = rep(cfg, BASIS_BATCHES[0]), rep(cfg, BASIS_BATCHES[1])
        cfg2 = make_config({"accumulation": 2}, base=cfg)
        q1, q2 = rep(cfg2, BASIS_BATCHES[0]), rep(cfg2, BASIS_BATCHES[1])
    task = task_of(cfg)
    counter = task_flop_counter(task, cfg.checkpointing)
    model_flops, hw_flops = counter.micro_batch(example_batch(task, 1))
    n_blocks, n_tensors, max_unit = model_units(cfg)
    return basis_from_reports(r1, r2, model_flops_per_sample=model_flops, hardware_flops_per_sample=hw_flops,
                              n_blocks=n_blocks, acc_reports=(q1, q2), n_param_tensors=n_tensors,
                              max_unit_params=max_unit)
