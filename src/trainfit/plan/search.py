"""Enumerate, check, cost and rank the lever settings for a job. Pure (no torch).

precision x micro-batch x checkpointing x strategy x grad_sync, with the accumulation
*derived*: micro_batch x accumulation x devices == global batch, always. A global batch
the devices cannot split evenly is refused with the nearest valid choices -- never
changed silently. Candidates that break a rule (``plan.rules``) or do not fit the device
memory with headroom are kept with their reasons; the rest are ranked by step time (the
global batch is fixed, so the shortest step is the highest throughput), then by memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from trainfit.errors import ConfigError, TrainfitError
from trainfit.plan.cost import Basis, Candidate, Links, Memory, Time, activation_precision, memory, step_time
from trainfit.plan.offload import OFFLOAD_CHOICES, offload_as_run
from trainfit.plan.rules import Context, broken_rules
from trainfit.units import fmt_bytes
from trainfit.vocabulary import PRECISIONS, STRATEGIES, GradSync


def precision_choices() -> tuple[str, ...]:
    """The precisions the planner searches by default: the table's rows as they are when called."""
    return tuple(PRECISIONS)


def strategy_choices() -> tuple[str, ...]:
    """The strategies the planner searches by default: the table's rows as they are when called (a row
    registered after import, ``vocabulary.register_strategy``, counts)."""
    return tuple(STRATEGIES)


def __getattr__(name: str):
    # PRECISION_CHOICES / STRATEGY_CHOICES, read when asked for: a module constant would copy the table at import
    if name == "PRECISION_CHOICES":
        return precision_choices()
    if name == "STRATEGY_CHOICES":
        return strategy_choices()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


CHECKPOINT_CHOICES = ("none", "every:2", "full")
GRAD_SYNC_CHOICES = tuple(GradSync)


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    global_batch: int
    """Samples per optimizer step over all devices (fixed)."""
    devices: int
    """Data-parallel degree."""
    memory_bytes: int
    """Per-device memory."""
    headroom: float = 0.10
    """Share of device memory kept free (allocator fragmentation, CUDA context, spikes)."""
    precisions: tuple[str, ...] = field(default_factory=precision_choices)
    checkpointings: tuple[str, ...] = CHECKPOINT_CHOICES
    strategies: tuple[str, ...] = field(default_factory=strategy_choices)
    micro_batches: tuple[int, ...] = ()
    """Micro-batch sizes to try (empty: :func:`micro_batch_choices` of the per-device share)."""
    compiles: tuple[bool, ...] = (False,)
    """Eager and/or ``torch.compile``d candidates; compiled ones only where a speed-up is known (measured or
    given: ``Links.compile_speedup``) -- an unpriced lever is not searched."""
    offloads: tuple[str, ...] = ("",)
    """``--offload`` settings to try, of ``plan.offload.OFFLOAD_CHOICES`` ("" nothing); each strategy runs those
    ``offload_choices`` allows (zero3 with params). Priced at ``Links.host_bytes_per_s``: where the links
    have none, offloaded candidates are excluded with that reason."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "devices", "memory_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(name.replace("_", "-"), v, "an integer >= 1")
        h = self.headroom  # NaN fails both comparisons; a string or a bool is refused before comparing
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0.0 <= h < 1.0:
            raise ConfigError("headroom", h, "a number in [0, 1)")
        bad = [o for o in self.offloads if o not in OFFLOAD_CHOICES]
        if bad or not self.offloads:
            raise ConfigError("offloads", ";".join(self.offloads), "settings of " + ", ".join(
                repr(o) for o in OFFLOAD_CHOICES))
        if self.global_batch % self.devices:
            raise ConfigError("global-batch", self.global_batch, f"a multiple of devices={self.devices}",
                              explain_batch(self.global_batch, self.devices))

    @property
    def budget_bytes(self) -> float:
        return self.memory_bytes * (1.0 - self.headroom)


EXPLAIN_SCAN = 100_000
"""Device counts :func:`explain_batch` tries at most (around the one asked for), so that huge numbers answer at once."""


def explain_batch(global_batch: int, devices: int) -> str:
    """Nearest valid choices when ``global_batch`` does not split evenly over ``devices``."""
    lo = global_batch // devices * devices
    hi = lo + devices
    near = [b for b in (lo, hi) if b > 0]
    top = min(global_batch, 4 * devices)
    if top <= EXPLAIN_SCAN:
        tried = range(1, top + 1)
    else:  # the counts nearest ``devices`` (and 1, which always divides): bounded work for any size
        half = EXPLAIN_SCAN // 2
        tried = [1, *range(max(2, devices - half), min(top, devices + half) + 1)]
    divisors = [d for d in tried if global_batch % d == 0]
    close = sorted(divisors, key=lambda d: abs(d - devices))[:3]
    return (f"each of the {devices} devices must take the same number of samples per step; nearest valid global "
            f"batches: {' or '.join(map(str, near))}; or keep {global_batch} on "
            f"{' or '.join(map(str, sorted(close)))} devices")


MICRO_BATCH_SCAN = 4096
"""The largest micro-batch tried by division; each found also gives its cofactor (see :func:`micro_batch_choices`)."""


def divisors(n: int, *, scan: int | None = None) -> list[int]:
    """The divisors of ``n``: every ``d <= min(scan, isqrt(n))`` that divides it, and ``n // d`` for each.

    Without ``scan`` that is all of them; with it the work is at most ``scan`` trial divisions for any
    ``n`` (10**18 included) and the list is still complete whenever ``n <= scan**2``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError("global-batch", n, "an integer >= 1")
    top = math.isqrt(n) if scan is None else min(scan, math.isqrt(n))
    small = [d for d in range(1, top + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def micro_batch_choices(share: int) -> tuple[list[int], str]:
    """Micro-batches to try for a per-device ``share`` of the global batch, and a note when the list is
    not every divisor: all of them up to ``MICRO_BATCH_SCAN**2`` (16.7M samples per device), beyond
    that the divisors up to ``MICRO_BATCH_SCAN`` and their cofactors (micro-batch x accumulation ==
    share always holds; only which splits are tried is bounded)."""
    mbs = divisors(share, scan=MICRO_BATCH_SCAN)
    if share <= MICRO_BATCH_SCAN**2:
        return mbs, ""
    return mbs, (f"micro-batches tried: the divisors of the per-device share {share} up to {MICRO_BATCH_SCAN} and "
                 f"their cofactors ({len(mbs)} in all; accumulation = share / micro-batch); divisors between "
                 f"{MICRO_BATCH_SCAN} and {share // MICRO_BATCH_SCAN}, if any, are not tried")


@dataclass(frozen=True, kw_only=True)
class PlanEntry:
    precision: str
    micro_batch: int
    accumulation: int
    checkpointing: str
    strategy: str
    grad_sync: str
    peak_bytes_per_device: int
    step_s: float
    scaling_efficiency: float
    fits: bool
    reasons: list[str]
    """Why it was dropped, or why it ranks where it does."""
    parts: dict[str, int] = field(default_factory=dict)
    compute_s: float = 0.0
    exposed_comm_s: float = 0.0
    compile: bool = False
    """Compiled per block (``trainfit train --compile on``)."""
    offload: str = ""
    """``--offload`` parts ("" none), priced at the host link."""
    offload_s: float = 0.0
    """Seconds of the step spent on offload's host copies (not overlapped)."""
    time_parts: dict[str, float] = field(default_factory=dict)
    """The step split by what bounds it (``plan.cost.Time.parts``: ``plan --explain``)."""

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        del d["time_parts"]  # given by --explain, for the row asked
        for key in ("compile", "offload", "offload_s"):  # said only when on: plans without them read back the same
            if not d[key]:
                del d[key]
        return d


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    entries: list[PlanEntry]
    """Fitting entries ranked fastest first, then the ones that do not fit, smallest first."""
    excluded: dict[str, int]
    """Rule reason -> how many candidates it excluded."""
    notes: list[str]
    candidates: int

    @property
    def best(self) -> PlanEntry | None:
        return self.entries[0] if self.entries and self.entries[0].fits else None


def candidates(space: SearchSpace) -> list[Candidate]:
    share = space.global_batch // space.devices
    mbs = [m for m in (space.micro_batches or micro_batch_choices(share)[0]) if share % m == 0]
    # each strategy's offload settings as it runs them (None: not one it runs, e.g. zero1 + optimizer)
    runs = {s: [o for o in (offload_as_run(w, s) for w in space.offloads) if o is not None] for s in space.strategies}
    return [Candidate(precision=p, micro_batch=m, accumulation=share // m, checkpointing=ck, strategy=s,
                      grad_sync=sync, n=space.devices, compile=compiled, offload=off)
            for p in space.precisions for ck in space.checkpointings for s in space.strategies for m in mbs
            for sync in GRAD_SYNC_CHOICES for compiled in space.compiles for off in runs[s]]


def step_floor(space: SearchSpace, uncheckpointed: list[Basis], *, ctx: Context,
               links: Callable[[str, str], Links]) -> tuple[float, Candidate | None]:
    """A lower bound on the predicted step of every candidate of ``space`` (fitting or not), and the candidate
    it comes from, priced from bases traced *without* checkpointing -- before any of ``space``'s own pairs is.

    A step's time reads a basis's FLOPs and communicated bytes only (memory decides what fits, not how fast it
    runs), and grows with each of them: so each candidate is priced at the model's FLOPs, plus what full
    checkpointing recomputes (``Basis.full_recompute_flops_per_sample``; any other policy: nothing), and at
    the fewest bytes any of the ``uncheckpointed`` bases communicates (a precision's own are no fewer).
    Offload is left out: its copies only add."""
    first = uncheckpointed[0]
    lean = dataclasses.replace(first, grad_comm_bytes=min(b.grad_comm_bytes for b in uncheckpointed),
                               param_comm_bytes=min(b.param_comm_bytes for b in uncheckpointed))
    priced = {(p, ck): dataclasses.replace(
        lean, precision=p, checkpointing=ck, hardware_flops_per_sample=first.model_flops_per_sample
        + (first.full_recompute_flops_per_sample if ck == "full" else 0.0))
        for p in space.precisions for ck in space.checkpointings}
    best: tuple[float, Candidate | None] = (math.inf, None)
    for c in candidates(dataclasses.replace(space, offloads=("",))):
        if broken_rules(c, ctx):
            continue
        t = step_time(priced[(c.precision, c.checkpointing)], c, links(c.precision, c.checkpointing)).step_s
        if t < best[0]:
            best = (t, c)
    return best


def needed_pairs(space: SearchSpace, ctx: Context) -> list[tuple[str, str]]:
    """The (precision, checkpointing) pairs :func:`search` asks a basis for, in its order: those of every
    compatible candidate, and the activation precision a strategy computes in where it differs."""
    out: dict[tuple[str, str], None] = {}
    for c in candidates(space):
        if not broken_rules(c, ctx):
            out[(c.precision, c.checkpointing)] = None
            out[(activation_precision(c.strategy, c.precision), c.checkpointing)] = None
    return list(out)


def search(space: SearchSpace, *, ctx: Context, basis: Callable[[str, str], Basis],
           links: Callable[[str, str], Links]) -> PlanResult:
    """Rank every compatible candidate; ``basis(precision, checkpointing)`` is called once per pair,
    ``links(precision, checkpointing)`` gives the rates its step time is costed at."""
    excluded: dict[str, int] = {}
    entries: list[PlanEntry] = []
    cache: dict[tuple[str, str], Basis] = {}
    all_c = candidates(space)
    for c in all_c:
        entry = _costed(c, space, ctx=ctx, basis=basis, links=links, cache=cache, excluded=excluded)
        if entry is not None:
            entries.append(entry)
    if not entries:
        raise TrainfitError("plan: no candidate is compatible with the device and device count: "
                            + "; ".join(excluded))
    _rank(entries)
    return PlanResult(entries=entries, excluded=excluded, notes=_ranked_notes(entries, space),
                      candidates=len(all_c))


OFFLOAD_UNPRICED = "offload: requires a known host link (the device row's, or --calibrate on cpu) to price its copies"
"""The reason :func:`search` excludes an offloaded candidate whose links have no host bandwidth."""


def _tally(excluded: dict[str, int], key: str) -> None:
    """Count one more candidate excluded for ``key``."""
    excluded[key] = excluded.get(key, 0) + 1


def _costed(c: Candidate, space: SearchSpace, *, ctx: Context, basis: Callable[[str, str], Basis],
            links: Callable[[str, str], Links], cache: dict[tuple[str, str], Basis],
            excluded: dict[str, int]) -> PlanEntry | None:
    """Candidate ``c`` costed and explained, or None where a rule, or offload without a host link to price it,
    excludes it (counted in ``excluded`` by reason). ``cache``: the bases asked for so far, by pair."""
    broken = broken_rules(c, ctx)
    if broken:
        for r in broken:
            _tally(excluded, f"{r.lever}: requires {r.requirement} ({r.reason})")
        return None
    b, act_b = _bases(c, basis, cache)
    lk = links(c.precision, c.checkpointing)
    if c.offload and not lk.host_bytes_per_s:
        _tally(excluded, OFFLOAD_UNPRICED)
        return None
    mem = memory(b, c, act_basis=act_b)
    t = step_time(b, c, lk, offloaded_activation_bytes=mem.offloaded_activation_bytes)
    fits = mem.peak_bytes <= space.budget_bytes
    reasons = [_offload_reason(c, b, act_b, mem, t, lk)] if c.offload else []
    reasons += _reasons(c, space, mem, t, lk, fits=fits)
    return PlanEntry(
        precision=c.precision, micro_batch=c.micro_batch, accumulation=c.accumulation,
        checkpointing=c.checkpointing, strategy=c.strategy, grad_sync=c.grad_sync,
        peak_bytes_per_device=int(mem.peak_bytes), step_s=t.step_s, scaling_efficiency=t.scaling_efficiency,
        fits=fits, reasons=reasons, parts={k: int(v) for k, v in mem.parts().items()},
        compute_s=t.compute_s, exposed_comm_s=t.exposed_comm_s, compile=c.compile, offload=c.offload,
        offload_s=t.offload_s, time_parts=t.parts())


def _bases(c: Candidate, basis: Callable[[str, str], Basis],
           cache: dict[tuple[str, str], Basis]) -> tuple[Basis, Basis | None]:
    """(the basis of ``c``'s pair, the basis its activations come from where the strategy computes in another
    precision, else None), each asked of ``basis`` once and kept in ``cache``."""
    def cached(p: str) -> Basis:
        if (p, c.checkpointing) not in cache:
            cache[(p, c.checkpointing)] = basis(p, c.checkpointing)
        return cache[(p, c.checkpointing)]

    ap = activation_precision(c.strategy, c.precision)
    return cached(c.precision), (cached(ap) if ap != c.precision else None)


def _offload_reason(c: Candidate, b: Basis, act_b: Basis | None, mem: Memory, t: Time, lk: Links) -> str:
    """What ``c``'s offload frees of the peak (against the same candidate without it) and costs per step."""
    resident = memory(b, dataclasses.replace(c, offload=""), act_basis=act_b)
    return (f"offload {c.offload}: frees {fmt_bytes(resident.peak_bytes - mem.peak_bytes)} of the "
            f"peak per device, costs {t.offload_s:.3g} s/step over the host link at "
            f"{lk.host_bytes_per_s / 1e9:.3g} GB/s (copies not overlapped: an upper bound)")


def _reasons(c: Candidate, space: SearchSpace, mem: Memory, t: Time, lk: Links, *, fits: bool) -> list[str]:
    """Why a costed candidate ranks where it does, besides offload (:func:`_offload_reason`): compiled, not
    fitting, communication-bound."""
    reasons = []
    if c.compile:
        reasons.append(f"compile: compute at {lk.compile_speedup:.3g}x the eager step's speed (measured or "
                       "given); memory as eager (the partitioner saved the same bytes on the GPTs measured)")
    if not fits:
        big = max(mem.parts().items(), key=lambda kv: kv[1])
        reasons.append(f"peak {fmt_bytes(mem.peak_bytes)} > budget {fmt_bytes(space.budget_bytes)} "
                       f"({fmt_bytes(space.memory_bytes)} less {space.headroom:.0%} headroom); largest part: "
                       f"{big[0]} {fmt_bytes(big[1])}")
    if t.exposed_comm_s > t.compute_s:
        reasons.append(f"communication-bound: {t.exposed_comm_s:.3g} s of exposed communication vs "
                       f"{t.compute_s:.3g} s of compute per step: the interconnect, not the devices, sets "
                       "the throughput")
    return reasons


def _rank(entries: list[PlanEntry]) -> None:
    """Sort ``entries`` in place: the fitting ones fastest first, then the others smallest first.

    Equal predicted times (to 0.1%): prefer no offload (its copies are priced as an upper bound, and a
    tiny one rounds away), then the larger micro-batch (fewer launches, better device utilisation, which
    the FLOP model does not see), then less memory."""
    entries.sort(key=lambda e: (not e.fits, round(math.log(e.step_s), 3) if e.fits else e.peak_bytes_per_device,
                                bool(e.offload), -e.micro_batch, e.peak_bytes_per_device, e.compile))


def _ranked_notes(entries: list[PlanEntry], space: SearchSpace) -> list[str]:
    """The plan's notes on sorted ``entries``, after putting first a near-tied entry without recompute
    (:func:`_prefer_no_recompute`, which may reorder them), and saying when not every micro-batch was tried."""
    promoted = _prefer_no_recompute(entries)
    notes = _notes(entries, space)
    if promoted:
        notes.append(promoted)
    bounded = "" if space.micro_batches else micro_batch_choices(space.global_batch // space.devices)[1]
    if bounded:
        notes.append(bounded)
    return notes


NEAR_TIE = 0.05
"""Predicted step times this close to the fastest count as a tie (the time model's spread on this
CPU: held-out rows within ~10%, see benchmarks/results/planner_accuracy.md)."""


def _prefer_no_recompute(entries: list[PlanEntry]) -> str:
    """Within a near tie, put first a fitting entry that recomputes nothing.

    Activation checkpointing is a memory lever; its predicted speed gain (a larger micro-batch)
    is worth its recompute only when it is clearly faster, and recompute is the least certain part
    of the time model. Returns the note that records the change, or ""."""
    best = entries[0]
    if not best.fits or best.checkpointing == "none":
        return ""
    for i, e in enumerate(entries[1:], 1):
        if not e.fits or e.step_s > best.step_s * (1 + NEAR_TIE):
            break
        if e.checkpointing == "none":
            entries.insert(0, entries.pop(i))
            return (f"ranked first without checkpointing: its predicted {e.step_s:.4g} s/step is within "
                    f"{NEAR_TIE:.0%} of the fastest ({best.step_s:.4g} s with checkpointing {best.checkpointing}, "
                    f"micro-batch {best.micro_batch}), and it pays no recompute")
    return ""


def _notes(entries: list[PlanEntry], space: SearchSpace) -> list[str]:
    best = entries[0]
    if best.fits:
        notes = [f"best: {best.precision}, micro-batch {best.micro_batch} x accumulation {best.accumulation} x "
                 f"{space.devices} devices = global batch {space.global_batch}, checkpointing {best.checkpointing}, "
                 f"{best.strategy}{', compiled' if best.compile else ''}{', offload ' + best.offload if best.offload else ''}: "
                 f"{best.step_s:.4g} s/step, peak {fmt_bytes(best.peak_bytes_per_device)} per device"]
        if best.exposed_comm_s > 0.25 * best.compute_s:
            notes.append(f"the interconnect decides throughput here: {best.exposed_comm_s:.3g} s of the "
                         f"{best.step_s:.3g} s step is communication not hidden behind compute "
                         f"(scaling efficiency {best.scaling_efficiency:.0%})")
        return notes
    smallest = min(entries, key=lambda e: e.peak_bytes_per_device)
    alone = [f"{k} alone needs {fmt_bytes(v)}" for k, v in smallest.parts.items() if v > space.budget_bytes]
    what = "; ".join(alone) if alone else (
        "no single part exceeds it, their sum does: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in smallest.parts.items()))
    return [f"nothing fits {fmt_bytes(space.budget_bytes)} per device ({fmt_bytes(space.memory_bytes)} less "
            f"{space.headroom:.0%} headroom): the smallest configuration ({smallest.precision}, micro-batch "
            f"{smallest.micro_batch}, checkpointing {smallest.checkpointing}, {smallest.strategy}) peaks at "
            f"{fmt_bytes(smallest.peak_bytes_per_device)}; {what}"]
