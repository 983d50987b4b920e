"""``trainfit profile`` as a library call: where each optimizer step's time goes, MFU, and ordered advice.

    from trainfit.front.profile import profile
    r = profile(model="gpt-tiny", steps=5, warmup=1, batch_probe=False)
    r.step_s, r.bottleneck, r.advice[0].text

Under torchrun every rank joins the process group and profiles; each returns its own report (``rank``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainfit.config import DistributionSection, RunConfig
from trainfit.errors import ConfigError, check_int
from trainfit.front.request import config_of
from trainfit.outputs import check_output_dir
from trainfit.probes.profile import ProfileOptions
from trainfit.probes.profile import profile as profile_run
from trainfit.results import ProfileReport
from trainfit.run import build_run
from trainfit.strategies import launch
from trainfit.strategies import process_group as pg
from trainfit.strategies.single import Single
from trainfit.units import parse_bytes
from trainfit.vocabulary import StrategyName, strategy_facts

DEFAULT_STEPS = 20
"""Profiled steps when ``steps`` is not given (a config's ``steps`` is a training length, not this)."""


def profile(config: RunConfig | None = None, *, steps: int | None = None, warmup: int = 3, batch_probe: bool = True,
            precision_probe: bool = True, overlap: float = 0.0, bandwidth: str | float | None = None,
            trace: str | None = None, force: bool = False, device: str | None = None,
            **fields: Any) -> ProfileReport:
    """Profile ``steps`` optimizer steps of ``config`` (or the RunConfig ``fields``) after ``warmup`` ones.

    Args:
        steps: profiled steps (default 20); ``warmup``: steps run first and discarded.
        batch_probe: also profile twice the micro-batch; ``precision_probe``: also step the precisions that need
            no more memory, to advise when the chosen one is slower here.
        overlap: fraction of backward that hides communication in scale-out predictions, in [0, 1].
        bandwidth: interconnect bandwidth for those predictions (``"25GB/s"`` or bytes per second; default measured).
        trace: a new or empty directory for a torch.profiler Chrome trace (``force``: any directory).
        device: ``"cpu"`` (default) or ``"cuda"`` for strategy single.

    Raises:
        ConfigError: a bad field or option (one line, as ``trainfit profile`` says it), before any step.
    """
    cfg = config_of(config, fields)
    options = profile_options(steps=steps, warmup=warmup, batch_probe=batch_probe, precision_probe=precision_probe,
                              overlap=overlap, bandwidth=bandwidth, trace=trace, force=force)
    strategy = _strategy(cfg.section("distribution"), device)
    launch.join_if_launched(timeout_s=cfg.collective_timeout_s)  # torchrun: every rank profiles
    try:
        return profile_run(build_run(cfg, strategy=strategy), options)
    finally:
        pg.destroy()


def profile_options(*, steps: int | None, warmup: int, batch_probe: bool, precision_probe: bool, overlap: float,
                    bandwidth: str | float | None, trace: str | None, force: bool) -> ProfileOptions:
    """The options, each checked (one ConfigError line naming the option) before any work."""
    steps = DEFAULT_STEPS if steps is None else steps
    check_int("steps", steps, minimum=1)
    check_int("warmup", warmup, minimum=0)
    if isinstance(overlap, int) and not isinstance(overlap, bool):
        overlap = float(overlap)
    if not (isinstance(overlap, float) and math.isfinite(overlap) and 0.0 <= overlap <= 1.0):
        raise ConfigError("overlap", overlap, "a number in [0, 1]")
    if trace:
        check_output_dir("--trace", trace, force=force)
    return ProfileOptions(steps=steps, warmup=warmup, batch_probe=batch_probe, overlap=overlap, trace_dir=trace,
                          precision_probe=precision_probe, bandwidth_bytes_per_s=parse_bandwidth(bandwidth))


def parse_bandwidth(value: str | float | None) -> float | None:
    """``"25GB/s"`` (or a number of bytes per second) -> bytes per second; None stays None (measured)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError("--bandwidth", value, "bytes per second > 0, such as 25GB/s")
        return float(value)
    t = str(value).strip()
    if not t.lower().endswith("/s"):
        raise ConfigError("--bandwidth", value, "bytes per second such as 25GB/s or 400MiB/s")
    return float(parse_bytes("--bandwidth", t[:-2]))


def _strategy(dist: DistributionSection, device: str | None):
    """``device="cuda"``: strategy single on the GPU (refused without one, or for a distributed strategy)."""
    if device in (None, "cpu"):
        return None
    if device != "cuda":
        raise ConfigError("--device", device, ("cpu", "cuda"))
    if not torch.cuda.is_available():
        raise ConfigError("--device", "cuda", "cpu (no CUDA device is visible)")
    if strategy_facts(dist.strategy).distributed:
        raise ConfigError("--device", "cuda", f"only with strategy={StrategyName.SINGLE} (distributed runs pick "
                          "their device)")
    return Single("cuda")
