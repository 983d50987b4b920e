"""The clock's newer terms against hand calculations (issue 30): HSDP's cross-node all-reduce of each unit's shard,
with and without the backward it hides behind; a large GEMM at a per-dtype measured share."""

from __future__ import annotations

import pytest

from trainfit.plan.clock import DeviceClock, gemm_seconds, hsdp_all_reduce

DEV = DeviceClock(name="test", peak_flops={"bf16": 100e12, "fp32": 10e12}, hbm_bytes_per_s=1e12, gemm_share=0.5,
                  attention_share=0.25, hbm_share=0.5, kernel_s=1e-6, bus_share=0.8)


def test_hsdp_all_reduce_of_each_shard_across_the_replicas():
    # Llama-2-7B-sized bf16 gradients, sharded over a node of 8, 12 nodes, 33 units (32 blocks + the root):
    # each GPU all-reduces 14e9 / 8 / 33 bytes per unit over a 12-GPU ring at 12.5 GB/s x 0.8
    grads, units, link, lat = 14e9, 33, 12.5e9, 5e-6
    shard = grads / 8 / units
    per_unit = 2 * (11 / 12 * shard / (12.5e9 * 0.8) + 11 * lat)
    kw = {"shard_over": 8, "replicas": 12, "units": units, "bandwidth_bytes_per_s": link, "bus_share": 0.8,
          "latency_s": lat}
    total, exposed = hsdp_all_reduce(grads, backward_s=0.2, **kw)
    assert total == pytest.approx(units * per_unit)
    # each unit hides behind the next unit's backward (0.2 / 33 = 6.1 ms, shorter than its ~9.8 ms all-reduce):
    # what outlasts it is exposed, the last in full
    hide = 0.2 / units
    assert per_unit > hide
    assert exposed == pytest.approx(per_unit + (units - 1) * max(0.0, per_unit - hide))
    # a long backward hides every all-reduce but the last unit's (perfect overlap) ...
    assert hsdp_all_reduce(grads, backward_s=100.0, slowdown=0.0, **kw)[1] == pytest.approx(per_unit)
    # ... or, with the backward beside each slowed 18.9%, each hidden one costs per_unit x 0.189 / 1.189
    assert hsdp_all_reduce(grads, backward_s=100.0, **kw)[1] == pytest.approx(per_unit * (1 + 32 * 0.189 / 1.189))
    # no backward to hide behind: all of it
    assert hsdp_all_reduce(grads, backward_s=0.0, **kw)[1] == pytest.approx(units * per_unit)


def test_one_replica_sends_nothing_across_nodes():
    assert hsdp_all_reduce(1e9, shard_over=8, replicas=1, units=10, backward_s=1.0, bandwidth_bytes_per_s=1e9,
                           bus_share=0.8) == (0.0, 0.0)


def test_a_measured_per_dtype_share_prices_that_dtype_only():
    dev = DeviceClock(**{**DEV.__dict__, "gemm_shares": {"fp32": 0.9}})
    n = 4096
    assert gemm_seconds(n, n, n, dtype="fp32", elem_bytes=4, dev=dev) == pytest.approx(2 * n**3 / (10e12 * 0.9) + 1e-6)
    assert gemm_seconds(n, n, n, dtype="bf16", elem_bytes=2, dev=dev) == pytest.approx(2 * n**3 / (100e12 * 0.5) + 1e-6)
    with pytest.raises(ValueError, match=r"gemm_shares\['bf16'\]"):
        DeviceClock(**{**DEV.__dict__, "gemm_shares": {"bf16": 1.2}})
