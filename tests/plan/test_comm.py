"""The communication model against hand calculations (pure, no process group)."""

import pytest

from trainfit.plan import comm

G = 100e6  # gradient bytes of a 25M-parameter fp32 model


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64])
def test_ddp_is_a_ring_all_reduce(n):
    assert comm.bytes_per_step("ddp", n=n, grad_bytes=G) == pytest.approx(2 * (n - 1) / n * G)


@pytest.mark.parametrize("n", [2, 8])
def test_zero_stages_against_zero_paper(n):
    ddp = comm.bytes_per_step("ddp", n=n, grad_bytes=G)
    # Stage 1/2: reduce-scatter grads + all-gather params = DDP's volume (2 psi).
    assert comm.bytes_per_step("zero1", n=n, grad_bytes=G) == pytest.approx(ddp)
    assert comm.bytes_per_step("zero2", n=n, grad_bytes=G) == pytest.approx(ddp)
    # Stage 3: params gathered twice + grads reduce-scattered = 3 psi = 1.5x DDP.
    assert comm.bytes_per_step("zero3", n=n, grad_bytes=G) == pytest.approx(1.5 * ddp)


def test_accumulation_and_per_micro_batch_sync():
    n, k, p = 4, 3, 50e6  # bf16 params gathered, fp32 grads reduced
    f = (n - 1) / n
    # ZeRO-3 gathers params in every micro-batch's forward and backward; grads once (deferred).
    assert comm.bytes_per_step("zero3", n=n, grad_bytes=G, param_bytes=p, accumulation=k) == pytest.approx(
        2 * k * f * p + f * G)
    assert comm.bytes_per_step("zero3", n=n, grad_bytes=G, param_bytes=p, accumulation=k,
                               per_micro_batch=True) == pytest.approx(2 * k * f * p + k * f * G)
    assert comm.bytes_per_step("zero2", n=n, grad_bytes=G, param_bytes=p, accumulation=k,
                               per_micro_batch=True) == pytest.approx(k * f * G + f * p)
    # DDP ignores per_micro_batch (no_sync is its deferral); one all-reduce per step.
    assert comm.bytes_per_step("ddp", n=n, grad_bytes=G, accumulation=k, per_micro_batch=True) == pytest.approx(
        2 * f * G)


def test_seconds_latency_plus_bandwidth():
    # ring all-reduce on 4 devices: 2*(4-1) = 6 latency steps, 1.5 G bytes.
    t = comm.comm_seconds("ddp", n=4, grad_bytes=G, bandwidth_bytes_per_s=10e9, latency_s=1e-4)
    assert t == pytest.approx(6 * 1e-4 + 1.5 * G / 10e9)


def test_predict_speedup_and_overlap():
    kw = dict(compute_s=0.2, grad_bytes=G, bandwidth_bytes_per_s=1e9)
    p = comm.predict("ddp", n=2, **kw)
    comm_s = G / 1e9  # 2*(1/2)*G bytes at 1 GB/s
    assert p.step_s == pytest.approx(0.2 + comm_s)
    assert p.speedup == pytest.approx(2 * 0.2 / (0.2 + comm_s))
    assert p.efficiency == pytest.approx(p.speedup / 2)
    hidden = comm.predict("ddp", n=2, backward_s=0.08, overlap=1.0, **kw)
    assert hidden.exposed_comm_s == pytest.approx(comm_s - 0.08)
    one = comm.predict("ddp", n=1, **kw)
    assert (one.speedup, one.comm_s) == (1.0, 0.0)


def test_comm_dominates_beyond_matches_hand_crossover():
    # Latency only: comm(n) = 2(n-1) * 0.01 s exceeds compute 1 s once n - 1 > 50.
    kw = dict(compute_s=1.0, grad_bytes=0.0, bandwidth_bytes_per_s=1e9, latency_s=0.01)
    assert comm.comm_dominates_beyond("ddp", **kw) == 52
    # Bandwidth only: comm tends to 2G/bw = 0.2 s < 1 s: never dominates.
    assert comm.comm_dominates_beyond("ddp", compute_s=1.0, grad_bytes=G, bandwidth_bytes_per_s=1e9) is None
    # Already dominated at 2 devices.
    assert comm.comm_dominates_beyond("ddp", compute_s=0.01, grad_bytes=G, bandwidth_bytes_per_s=1e9) == 2


def test_every_row_has_a_source_and_formula():
    from trainfit.vocabulary import STRATEGIES

    assert set(comm.DISTRIBUTED) == {s.name for s in STRATEGIES.values() if s.distributed}
    for name in comm.DISTRIBUTED:
        row = STRATEGIES[name]
        assert row.traffic_source and row.traffic_formula and row.collectives


@pytest.mark.parametrize("kw, word", [
    (dict(strategy="tp", n=2), "strategy"),
    (dict(strategy="ddp", n=0), "n=0"),
    (dict(strategy="ddp", n=2, accumulation=0), "accumulation"),
])
def test_bad_input_names_the_field(kw, word):
    with pytest.raises(ValueError, match=word):
        comm.bytes_per_step(kw.pop("strategy"), grad_bytes=G, **kw)


def test_bad_prediction_input():
    with pytest.raises(ValueError, match="overlap"):
        comm.predict("ddp", n=2, compute_s=1.0, grad_bytes=G, bandwidth_bytes_per_s=1e9, overlap=2.0)
    with pytest.raises(ValueError, match="bandwidth"):
        comm.comm_seconds("ddp", n=2, grad_bytes=G, bandwidth_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="compute_s"):
        comm.predict("ddp", n=2, compute_s=0.0, grad_bytes=G, bandwidth_bytes_per_s=1e9)


def test_slowest_of_is_the_quantile_of_the_maximum():
    xs = [float(i) for i in range(101)]  # uniform 0..100
    assert comm.slowest_of(xs, 1) == pytest.approx(50.0)
    # median of the max of 2 uniform draws: F(x)^2 = 1/2 -> x = 100 / sqrt(2)
    assert comm.slowest_of(xs, 2) == pytest.approx(100 / 2**0.5, abs=0.5)
    assert comm.slowest_of([3.0, 1.0, 2.0], 1000) == pytest.approx(3.0, abs=0.01)


def test_straggler_time_adds_to_the_step():
    p = comm.predict("ddp", n=2, compute_s=1.0, grad_bytes=0.0, bandwidth_bytes_per_s=1e9, straggler_s=0.25)
    assert p.step_s == pytest.approx(1.25) and p.speedup == pytest.approx(2 / 1.25)


# --- per-call latency: hand counts of the collectives trainfit's strategies issue per step ---

MiB = 2**20


def test_ddp_bucket_count_by_hand():
    # 1 MiB first bucket, then 25 MiB buckets (DDP defaults).
    assert comm.ddp_buckets(0.5 * MiB) == 1
    assert comm.ddp_buckets(1 * MiB) == 1
    assert comm.ddp_buckets(1 * MiB + 1) == 2
    assert comm.ddp_buckets(26 * MiB) == 2
    assert comm.ddp_buckets(100 * MiB) == 1 + 4  # 99 MiB after the first: ceil(99 / 25) = 4


def test_collective_calls_by_hand():
    # gpt-tiny with 2 blocks: 29 tensors, 3 FSDP units (2 blocks + root), 548 kB of fp32 gradients.
    kw = dict(grad_bytes=547_840, n_param_tensors=29, fsdp_units=3)
    ddp = comm.collective_calls("ddp", **kw, accumulation=2)
    assert (ddp.all_reduce, ddp.broadcast, ddp.all_gather, ddp.reduce_scatter, ddp.small_all_reduce) == (1, 0, 0, 0, 2)
    z1 = comm.collective_calls("zero1", **kw)
    assert (z1.all_reduce, z1.broadcast, z1.small_all_reduce) == (1, 29, 2)
    # zero2, 2 micro-batches synced each: gathers 3 x 2 (resharded after every backward), scatters 3 x 2,
    # small: count + loss + clip norm.
    z2 = comm.collective_calls("zero2", **kw, accumulation=2, per_micro_batch=True)
    assert (z2.all_gather, z2.reduce_scatter, z2.all_reduce, z2.small_all_reduce) == (6, 6, 0, 3)
    z2d = comm.collective_calls("zero2", **kw, accumulation=2)
    assert (z2d.all_gather, z2d.reduce_scatter) == (6, 3)
    # zero3: gathers in forward and again in backward per micro-batch.
    z3 = comm.collective_calls("zero3", **kw, accumulation=1)
    assert (z3.all_gather, z3.reduce_scatter, z3.small_all_reduce) == (6, 3, 3)
    assert comm.collective_calls("zero3", **kw, grad_clip=False, loss_scaling=True).small_all_reduce == 3


def test_call_latency_in_comm_seconds():
    # zero3 on 2 devices, 1 micro-batch, 3 units: 6 gathers + 3 scatters, 1 ring step each = 9 steps
    # (small all-reduces are costed apart); bytes as before: 2(1/2)P + (1/2)G.
    calls = comm.collective_calls("zero3", grad_bytes=G, n_param_tensors=29, fsdp_units=3)
    t = comm.comm_seconds("zero3", n=2, grad_bytes=G, bandwidth_bytes_per_s=1e9, latency_s=1e-3, calls=calls)
    assert t == pytest.approx(9 * 1e-3 + 1.5 * G / 1e9)
    # zero1 on 4 devices, G = 100 MB = 95.4 MiB: 1 + ceil(94.4 / 25) = 5 bucket all-reduces (6 steps each)
    # + 29 broadcasts (3 steps each); the 2 small all-reduces add 6 steps each.
    z1 = comm.collective_calls("zero1", grad_bytes=G, n_param_tensors=29, fsdp_units=3)
    assert z1.ring_steps(4, small=False) == 5 * 6 + 29 * 3
    assert z1.ring_steps(4) == 5 * 6 + 29 * 3 + 2 * 6


def test_calls_reject_bad_counts():
    with pytest.raises(ValueError, match="broadcast"):
        comm.Calls(broadcast=-1)
    with pytest.raises(ValueError, match="strategy"):
        comm.collective_calls("zero4", grad_bytes=G, n_param_tensors=1, fsdp_units=1)
