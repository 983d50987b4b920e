"""What ``trainfit plan`` says beside its numbers: the source lines, the offload notes, the table and ``--explain``
(pure text from a :class:`~trainfit.results.PlanReport` and the facts it was priced with)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainfit.errors import ConfigError
from trainfit.front.plan_request import SEARCH_NOTES
from trainfit.meters.devices import (
    find_device,
)
from trainfit.plan.basis import OPTIMIZER_BYTES
from trainfit.plan.offload import offload_as_run, offload_price
from trainfit.results import PlanReport
from trainfit.units import fmt_bytes
from trainfit.vocabulary import (
    OffloadPart,
    Optimizer,
    parse_offload,
    precision_facts,
)

if TYPE_CHECKING:
    pass


def _offload_source(offloads: tuple[str, ...], host_bw: float | None, row) -> str:
    """The plan's source line for offload: what was searched, and the host link it is priced at."""
    searched = [x for x in offloads if x]
    if not searched:
        why = ("--offloads none" if host_bw else f"device {row.name} has no host link to price its copies"
               + (" (pass --calibrate to measure this machine's)" if row.peak_row is None else ""))
        return f"offload: not searched ({why})"
    link = (f"{host_bw / 1e9:.3g} GB/s per direction, "
            + ("the device row's datasheet host link" if row.host_bytes_per_s else "a host copy measured on this CPU"))
    return (f"offload: searched {', '.join(x.replace(',', '+') for x in searched)} (zero3 moves params with the "
            f"optimizer; zero1 offloads activations only), priced at {link}; copies not overlapped (an upper bound)")


def _offload_notes(result, basis, row, space, base) -> list[str]:
    """What offload would free and cost for the best plan (or, when nothing fits, the smallest), when the search
    did not try it (``--offloads none``, or no host link): priced by the device row's host link, if any."""
    e = result.best or min(result.entries, key=lambda x: x.peak_bytes_per_device)
    run = offload_as_run(OffloadPart.OPTIMIZER, e.strategy)  # the strategy's row: what it offloads with it
    if run is None:
        return []
    b = basis(e.precision, e.checkpointing)
    w, _, master, _ = precision_facts(e.precision).bytes_per_param
    parts = set(parse_offload(run))
    notes = []
    for chosen in (parts, {OffloadPart.ACTIVATIONS}):
        price = offload_price(parts=chosen, strategy=e.strategy, n_params=b.n_trainable or b.n_params,
                              world_size=space.devices, accumulation=e.accumulation, weight_bytes=w,
                              state_bytes_per_param=OPTIMIZER_BYTES[Optimizer(base.optimizer)],
                              master_bytes_per_param=master,
                              activation_bytes_per_micro_batch=int(e.parts.get("activations", 0)),
                              grad_sync=e.grad_sync, host_bytes_per_s=row.host_bytes_per_s)
        if not price.traffic:
            continue
        line = f"other lever for plan {'1' if result.best else '(smallest)'}: {price.reason}"
        if price.seconds_per_step is not None and e.step_s:
            line += f" (+{price.seconds_per_step / e.step_s:.0%} of its {e.step_s:.3g} s step if not overlapped)"
        if result.best is None:
            fits = e.peak_bytes_per_device - price.frees_device_bytes <= space.budget_bytes
            line += "; it would fit" if fits else "; still too big"
        notes.append(line + f" (--offload {','.join(sorted(str(p) for p in chosen))})")
    return notes


def _source_lines(basis, used: str, row, base, *, calibrate: bool, needed, clocked: bool = False) -> list[str]:
    """One line per source of the plan's numbers: the basis, the kernels it assumes, the device, the step times."""
    first = basis(*needed[0]) if needed else None
    lines = []
    if first is not None and used != "fast":
        lines.append(f"basis ({used}): {first.source}")
    elif first is not None:
        how, _, kernels = first.source.partition("; kernels of ")
        lines.append(f"basis trace: {how.removeprefix('fast trace (')}")
        lines.append(f"kernels of {kernels}" if kernels else "kernels: this machine's (cpu)")
    if used == "analytic":
        lines.append("kernels: none traced: the analytic shape counts the tensors its blocks save (flash-style "
                     "attention: no sequence-squared probabilities)")
    elif used != "fast":
        lines.append("kernels: this machine's CPU kernels (the estimate and measure bases trace or run here)")
    peak = find_device(row.peak_row) if row.peak_row else None
    lines.append(f"device {row.name} (meters.devices, every source there): " + row.source.split(";")[0]
                 + (f"; peak FLOP/s: {peak.source.split(';')[0]}" if peak else ""))
    if not clocked:
        lines.append("step times: " + ("fitted to steps measured on this machine (--calibrate)" if calibrate else
                                       f"FLOPs / ({row.achievable_frac:.0%} of the dense peak) plus the ring model of "
                                       "the links (plan.cost, plan.comm)"))
    return lines


def _clock_lines(facts: dict, tuned: bool) -> list[str]:
    """The op-level clock's source lines: how a step is priced and every coefficient's source."""
    lines = [f"step times: op by op (plan.clock) on {facts['name']}: GEMMs at max(FLOPs / {facts['gemm_share']:.0%} of "
             f"the dense peak, bytes / HBM), attention at {facts['attention_share']:.0%} of the peak (causal flash), "
             f"memory-bound ops at {facts['hbm_share']:.0%} of {facts['hbm_bytes_per_s'] / 1e12:.3g} TB/s, "
             f"{facts['kernel_s'] * 1e6:.3g} us per kernel, all / {facts['eager_share']:.2f} (eager share); "
             f"collectives at {facts['bus_share']:.0%} of the link, FSDP prefetch and DDP buckets overlapped"
             + ("; --lora/--freeze: backward priced whole (an upper bound)" if tuned else "")]
    lines.extend(f"clock source: {s}" for s in facts["sources"])
    return lines



def format_table(entries) -> str:
    mw = max([5, *(len(str(e.micro_batch)) + 1 for e in entries)])  # a 10**18 batch keeps its columns apart
    aw = max([6, *(len(str(e.accumulation)) + 1 for e in entries)])
    cw = max([8, *(len(e.checkpointing) + 1 + len(" +compile") * e.compile for e in entries)])
    head = f"{'#':>3} {'precision':<11}{'mb':>{mw}}{'acc':>{aw}} {'ckpt':<{cw}}{'strategy':<9}{'sync':<16}" \
           f"{'peak/dev':>11}{'step s':>10}{'eff':>6}  fits / reasons"
    lines = [head]
    for i, e in enumerate(entries, 1):
        n = e.peak_bytes_per_device
        peak = fmt_bytes(n)
        why = "yes" if e.fits else "no"
        if e.reasons:
            why += ": " + "; ".join(e.reasons)
        ck = e.checkpointing + (" +compile" if e.compile else "")
        lines.append(f"{i:>3} {e.precision:<11}{e.micro_batch:>{mw}}{e.accumulation:>{aw}} {ck:<{cw}}"
                     f"{e.strategy:<9}{e.grad_sync:<16}{peak:>11}{e.step_s:>10.4g}{e.scaling_efficiency:>6.0%}  {why}")
    return "\n".join(lines)


EXPLAIN_PARTS = {"compute_bound_s": "compute-bound (GEMMs, attention)",
                 "memory_bound_s": "memory-bound (norms, activations, casts, loss, optimizer step)",
                 "recompute_s": "recompute (checkpointing)", "exposed_comm_s": "exposed communication",
                 "fixed_s": "fixed cost (kernel launches, per-step overheads)",
                 "dist_overhead_s": "measured distributed overhead", "offload_s": "offload copies"}
"""``plan --explain``'s parts of a step (``plan.cost.Time.parts``), in the order printed."""


def explain_row(shown, n: int) -> dict:
    """Row ``n`` (1-based) of the plans ``shown`` split into the parts of its step (``plan --explain``)."""
    if n > len(shown):
        raise ConfigError("explain", n, f"a row number from 1 to {len(shown)} (the rows shown)")
    e = shown[n - 1]
    return {"row": n, "precision": e.precision, "micro_batch": e.micro_batch, "accumulation": e.accumulation,
            "checkpointing": e.checkpointing, "strategy": e.strategy, "grad_sync": e.grad_sync, "step_s": e.step_s,
            "parts": dict(e.time_parts)}


def format_explain(x: dict) -> str:
    """The ``--explain`` block: each part in seconds and as a share of the step."""
    head = (f"explain row {x['row']}: {x['precision']}, micro-batch {x['micro_batch']} x {x['accumulation']}, "
            f"checkpointing {x['checkpointing']}, {x['strategy']} ({x['grad_sync']}): {x['step_s']:.4g} s/step")
    step = x["step_s"] or 1.0
    lines = [head] + [f"  {label:<62}{x['parts'].get(k, 0.0):>11.4g} s {x['parts'].get(k, 0.0) / step:>6.1%}"
                      for k, label in EXPLAIN_PARTS.items() if k in x["parts"]]
    return "\n".join(lines)


# -- what a plan is turned into: the table, a config to train, another tool's configuration -------------------------
def format_plan(report: PlanReport) -> str:
    """The plan as the command prints it: the job and its sources, the table of plans, then the search's notes
    (the first of which says the best plan, or that nothing fits) and the rest."""
    n = next((i for i, note in enumerate(report.notes) if note.startswith(SEARCH_NOTES)), len(report.notes))
    return "\n".join([*report.notes[:n], format_table(report.plans), *report.notes[n:]])
