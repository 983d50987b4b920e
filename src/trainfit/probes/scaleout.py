"""Scale-out predictions for a profiled run: bandwidth (given or measured) + the comm model.

The bytes and the formulas live in :mod:`trainfit.plan.comm` (pure); this module only
supplies the measured parts: the compute time from the profile, the gradient bytes of the
real model, and the interconnect bandwidth -- given, measured with all-reduces on a live
process group, or (single CPU process) measured over TCP loopback, which is what gloo uses
between processes on one host. A single GPU has no measurable interconnect: without
``--bandwidth`` no prediction is made (never a guessed link speed).
"""

from __future__ import annotations

import statistics
import time

import torch

from trainfit.meters import devices as hardware
from trainfit.plan import comm
from trainfit.progress import logger, say
from trainfit.run import Run
from trainfit.vocabulary import strategy_facts

log = logger("profile")

NS = (1, 2, 4, 8, 16, 32, 64)
"""Device counts of the predicted curves."""


def bandwidth(run: Run, opts, grad_bytes: int) -> tuple[float | None, float, str]:
    """(bytes/s, latency s, source) for scale-out predictions."""
    if opts.bandwidth_bytes_per_s is not None:
        return opts.bandwidth_bytes_per_s, opts.latency_s or 0.0, "given (--bandwidth)"
    st = run.strategy
    if st.world_size > 1:  # time real all-reduces on the live process group
        n = st.world_size
        say(log, "profile: timing all-reduces on the live %d-process group (5 small, 5 large) ...", n)
        # At least 16 MiB, so that the bandwidth term outweighs latency and noise.
        big = torch.zeros(min(max(grad_bytes, 16 * 2**20), 64 * 2**20) // 4, device=st.device)
        small = torch.zeros(1, device=st.device)

        def timed(t: torch.Tensor) -> float:
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                st.all_reduce_sum(t)
                float(t[0])  # host-device sync
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        t_small, t_big = timed(small), timed(big)
        latency = t_small / (2 * (n - 1))
        sent = 2 * (n - 1) / n * big.numel() * 4
        # Subtract the latency part when it is clearly smaller; else bound the bandwidth from below.
        bw = sent / (t_big - t_small if t_big > 2 * t_small else t_big)
        return bw, latency if opts.latency_s is None else opts.latency_s, \
            f"measured: all-reduce of {big.numel() * 4:,} bytes on the live {n}-process group"
    if st.device.type == "cpu":
        say(log, "profile: measuring TCP loopback bandwidth (gloo's path between processes on this host) ...")
        bw, latency = hardware.measure_loopback()
        return bw, latency if opts.latency_s is None else opts.latency_s, \
            "measured: TCP loopback on 127.0.0.1 (gloo's path between processes on this host)"
    return None, 0.0, "no interconnect bandwidth known for a single GPU: pass --bandwidth (e.g. 450GB/s)"


def scaling(run: Run, opts, compute_s: float, backward_s: float, samples: list[float] | None = None,
            small_all_reduces: int = 0) -> dict:
    """Scale-out curves for every strategy.

    ``samples``: per-step compute times (the slowest of n ranks sets a synchronous step);
    ``small_all_reduces``: the step's own latency-bound collectives (token count, loss, overflow).
    """
    params = [p for p in run.model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    bw, latency, source = bandwidth(run, opts, grad_bytes)
    strategy = run.cfg.strategy if run.cfg.strategy in comm.DISTRIBUTED else comm.DISTRIBUTED[0]
    out = {"strategy": strategy, "grad_bytes": grad_bytes, "small_all_reduces": small_all_reduces, "bandwidth_bytes_per_s": bw, "latency_s": latency,
           "bandwidth_source": source, "overlap": opts.overlap, "compute_s": compute_s, "curves": {},
           "comm_dominates_beyond": None}
    if bw is None or compute_s <= 0:
        return out
    kw = dict(compute_s=compute_s, grad_bytes=grad_bytes, bandwidth_bytes_per_s=bw, latency_s=latency,
              backward_s=backward_s, overlap=opts.overlap, accumulation=run.cfg.accumulation,
              small_all_reduces=small_all_reduces,
              per_micro_batch=run.cfg.grad_sync == "per-micro-batch")
    samples = samples or [compute_s]
    # The calls each strategy really issues per step (DDP buckets, ZeroRedundancyOptimizer's
    # per-parameter broadcasts, FSDP2 per-unit gathers/scatters), as the planner counts them.
    inner = getattr(run.model, "module", run.model)
    units = len(run.task.block_names(inner)) + 1
    calls = {s: comm.collective_calls(s, grad_bytes=grad_bytes, n_param_tensors=len(params), fsdp_units=units,
                                      accumulation=run.cfg.accumulation,
                                      per_micro_batch=run.cfg.grad_sync == "per-micro-batch")
             for s in comm.DISTRIBUTED}
    out["calls_per_step"] = {s: c.total() for s, c in calls.items()}
    for s in comm.DISTRIBUTED:
        curve = [comm.predict(s, n=n, straggler_s=max(0.0, comm.slowest_of(samples, n) - compute_s), calls=calls[s],
                              **kw) for n in NS]
        points = [{k: v for k, v in p.to_dict().items() if k != "source"} for p in curve]
        out["curves"][s] = {"formula": strategy_facts(s).traffic_formula, "source": strategy_facts(s).traffic_source,
                            "points": points}
    out["comm_dominates_beyond"] = comm.comm_dominates_beyond(strategy, calls=calls[strategy], **kw)
    return out


def scaling_note(sc: dict) -> str:
    pts = {p["n"]: p for p in sc["curves"].get(sc["strategy"], {}).get("points", [])}
    if not pts:
        return ""
    parts = ", ".join(f"{n}: {pts[n]['speedup']:.2f}x ({pts[n]['efficiency']:.0%})" for n in (2, 4, 8) if n in pts)
    beyond = sc["comm_dominates_beyond"]
    tail = (f"communication exceeds compute beyond {beyond} devices" if beyond
            else "communication stays below compute up to 65536 devices")
    return (f"scale out with {sc['strategy']}: predicted speed-up (efficiency) on {parts}; {tail} "
            f"(bandwidth {sc['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, {sc['bandwidth_source']})")
