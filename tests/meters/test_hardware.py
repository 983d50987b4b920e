"""The peak table: exact names only, sources on every row, None for the unknown."""

import pytest
import torch

from trainfit.meters import devices as hardware


def test_every_row_has_a_source_and_dense_fp32():
    for row in hardware.PEAKS:
        assert row.source and row.names
        assert "fp32" in row.peak_tflops
        assert set(row.peak_tflops) <= set(hardware.DTYPES)
        # Tensor-core half precision beats fp32 CUDA cores on every listed GPU.
        assert row.peak_tflops.get("fp16", 0) > row.peak_tflops["fp32"]


def test_known_device_by_exact_name():
    assert hardware.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.5e12)
    assert hardware.peak_flops("NVIDIA A100-SXM4-40GB", "tf32") == pytest.approx(156e12)


def test_unknown_device_or_dtype_gives_none_never_a_guess():
    assert hardware.peak_flops("NVIDIA Imaginary 9000", "bf16") is None
    assert hardware.peak_flops("NVIDIA H100", "bf16") is None  # a prefix is not a match
    assert hardware.peak_flops("Tesla T4", "bf16") is None  # T4 has no bf16 row
    with pytest.raises(ValueError, match="fp8"):
        hardware.peak_flops("NVIDIA H200", "fp8")


def test_compute_dtype():
    assert hardware.compute_dtype("bf16-mixed", tf32_enabled=False) == "bf16"
    assert hardware.compute_dtype("fp16-true", tf32_enabled=True) == "fp16"
    assert hardware.compute_dtype("fp32", tf32_enabled=True) == "tf32"
    assert hardware.compute_dtype("fp32", tf32_enabled=False) == "fp32"


def test_cpu_calibration_is_a_real_matmul_rate():
    import time

    cal = hardware.calibrate_cpu("fp32", size=256, seconds=0.2)
    assert cal.threads == torch.get_num_threads() and torch.get_num_threads() == cal.threads  # restored
    assert cal.flops_per_s == pytest.approx(cal.per_thread_flops_per_s * cal.threads)
    # Reference: our own one-thread timing of the same product, best of 50.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        best = min(_timed(lambda: torch.mm(a, b), time) for _ in range(50))
    finally:
        torch.set_num_threads(before)
    assert 0.2 < cal.per_thread_flops_per_s / (2 * 256**3 / best) < 5


def _timed(fn, time):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_loopback_bandwidth_is_positive():
    bw, latency = hardware.measure_loopback(nbytes=2**20, pings=5)
    assert bw > 1e6 and 0 < latency < 0.1


class _FakeRun:
    def __init__(self, device, precision="bf16-mixed"):
        from types import SimpleNamespace

        self.strategy = SimpleNamespace(device=torch.device(device))
        self.cfg = SimpleNamespace(precision=precision)


@pytest.mark.parametrize("name, known", [("NVIDIA H200", True), ("NVIDIA Imaginary 9000", False)])
def test_profile_peak_on_a_gpu_is_the_table_row_or_null(monkeypatch, name, known):
    from trainfit.probes.profile import _peak

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    peak, dtype, source = _peak(_FakeRun("cuda:0"))
    assert dtype == "bf16"
    if known:
        assert peak == pytest.approx(989.5e12) and "H200" in source and "datasheet" in source
    else:
        assert peak is None and "not in the peak table" in source and name in source
