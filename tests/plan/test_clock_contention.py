"""The compute slowdown while a collective runs beside it (issue 30, ``plan.clock.OVERLAP_SLOWDOWN``) against hand
calculations: a prefetched collective either outlasts the slowed compute (the unit waits for the collective) or
finishes inside it (the unit pays the slowdown for as long as the collective ran)."""

from __future__ import annotations

import pytest

from trainfit.plan.clock import OVERLAP_SLOWDOWN, overlapped


def test_the_source_figure():
    # Lee et al. 2025 (arXiv 2507.03114): 18.9% average compute slowdown while overlapped
    assert OVERLAP_SLOWDOWN == 0.189


def test_a_short_collective_beside_long_compute_costs_its_slowdown():
    # collective 10 ms, compute 30 ms, compute 20% slower beside it: the 10 ms of overlap do 10 / 1.2 = 8.333 ms
    # of the compute, the other 21.667 ms run at full speed: the unit takes 31.667 ms, 1.667 ms beyond 30.
    # 5 units: the first collective waits in full (10 ms), the other 4 cost 1.667 ms each
    assert overlapped(0.010, 0.030, 5, slowdown=0.2) == pytest.approx(0.010 + 4 * 0.0016667, rel=1e-4)


def test_a_long_collective_outlasts_the_slowed_compute():
    # collective 10 ms, compute 6 ms: slowed 20% it takes 7.2 ms, still inside the 10 ms: the unit waits 10 - 6 = 4 ms
    assert overlapped(0.010, 0.006, 3, slowdown=0.2) == pytest.approx(0.010 + 2 * 0.004)
    # the boundary: compute 10 / 1.2 = 8.333 ms slowed to exactly 10 ms; both cases give 10 - 8.333 = 1.667 ms
    assert overlapped(0.010, 0.010 / 1.2, 2, slowdown=0.2) == pytest.approx(0.010 + 0.0016667, rel=1e-4)


def test_the_default_is_the_sourced_slowdown():
    # 4 ms collective behind 20 ms compute at 18.9%: 4 x 0.189 / 1.189 = 0.6358 ms per hidden unit
    assert overlapped(0.004, 0.020, 3) == pytest.approx(0.004 + 2 * 0.00063583, rel=1e-4)
    assert overlapped(0.004, 0.020, 3, slowdown=0.0) == pytest.approx(0.004)
    assert overlapped(0.004, 0.020, 0) == 0.0


def test_behind_is_the_larger_of_the_wait_and_the_slowdown():
    from trainfit.plan.clock import behind

    # 12 ms collective beside 40 ms compute at 20%: 12 x 0.2 / 1.2 = 2 ms; beside 8 ms compute: waits 12 - 8 = 4 ms
    assert behind(0.012, 0.040, slowdown=0.2) == pytest.approx(0.002)
    assert behind(0.012, 0.008, slowdown=0.2) == pytest.approx(0.004)
    assert behind(0.0, 0.040) == 0.0


def test_ddp_buckets_before_the_last_slow_the_backward_beside_them():
    # DDP on the op-level clock (plan.cost._clocked_comm): the last bucket is exposed in full; the buckets before it
    # run beside backward and cost their slowdown (what FSDP's hidden collectives cost too)
    from trainfit.plan import comm
    from trainfit.plan.basis import analytic_basis
    from trainfit.plan.clock import DeviceClock, clocked_links, ring_seconds
    from trainfit.plan.cost import Candidate, Links, step_time
    from trainfit.plan.shapes import TransformerShape

    dev = DeviceClock(name="test", peak_flops={"bf16": 100e12, "fp32": 10e12}, hbm_bytes_per_s=1e12, gemm_share=0.5,
                      attention_share=0.25, hbm_share=0.5, kernel_s=1e-6, bus_share=0.8)
    shape = TransformerShape(family="gpt", vocab_size=50257, n_layer=12, d_model=768, n_head=12, n_kv_head=12,
                             d_ff=3072, max_seq_len=1024)
    b = analytic_basis(shape, precision="bf16-true", checkpointing="none", seq_len=128)
    links = clocked_links(lambda p, ck="none": Links(flops_per_s=1.0, bandwidth_bytes_per_s=100e9, overlap=1.0), dev,
                          shape, seq_len=128)("bf16-true")
    c = Candidate(precision="bf16-true", micro_batch=8, accumulation=1, checkpointing="none", strategy="ddp",
                  grad_sync="deferred", n=8)
    t = step_time(b, c, links)
    g = b.grad_comm_bytes
    buckets = comm.ddp_buckets(g)
    ring = dict(bandwidth_bytes_per_s=100e9, bus_share=0.8, latency_s=0.0)
    # 2 (n-1)/n x bytes / (100 GB/s x 0.8): the ring all-reduce of every gradient, and of the last bucket alone
    ar = 2 * 7 / 8 * g / 80e9
    last = 2 * 7 / 8 * min(g, comm.DDP_BUCKET_BYTES) / 80e9
    assert ar == pytest.approx(ring_seconds(g, 8, all_reduce=True, **ring))
    assert buckets > 1  # several buckets: some run beside backward
    # a fast link: the earlier buckets hide behind backward, at 0.189 / 1.189 of their time
    assert t.exposed_comm_s == pytest.approx(last + (ar - last) * 0.189 / 1.189, rel=1e-6)
    assert t.comm_s == pytest.approx(ar)
