"""CUDA calibration's pure part (issue 30, item 4): measured timings -> the device row the clock uses, checked by
hand on injected fake timings (no GPU needed). ``benchmarks/gpu_check_plan.py --clock`` measures them for real."""

from __future__ import annotations

import pytest

from trainfit.meters.devices import clock_facts, device_row
from trainfit.plan.clock import DeviceClock, gemm_seconds
from trainfit.probes.calibrate import DeviceTimings, calibrated_clock_facts, calibrated_device_clock

H100_BF16, H100_FP32, H100_HBM = 989.5e12, 67.0e12, 3.35e12  # the table's H100-SXM row (datasheet)
BIG = 2.0 * 8192**3  # FLOPs of the large GEMM


def _timings(*, bf16_share=0.8, fp32_share=0.9, hbm_share=0.9, launch_s=5e-6, h2d=50e9, d2h=40e9) -> DeviceTimings:
    """Timings a device with the given shares would measure (seconds worked out by hand from the shares)."""
    return DeviceTimings(
        device_name="fake H100",
        gemms=(("large", 8192, 8192, 8192, "bf16", BIG / (bf16_share * H100_BF16)),
               ("skinny", 256, 8192, 8192, "bf16", 1e-3),
               ("large", 8192, 8192, 8192, "fp32", BIG / (fp32_share * H100_FP32))),
        copy_bytes=2**30, copy_s=2 * 2**30 / (hbm_share * H100_HBM),
        h2d_bytes=2**28, h2d_s=2**28 / h2d, d2h_bytes=2**28, d2h_s=2**28 / d2h, launch_s=launch_s)


def test_timings_become_the_shares_the_clock_uses():
    facts = clock_facts(device_row("h100"))
    out, host = calibrated_clock_facts(facts, _timings())
    assert out["gemm_shares"]["bf16"] == pytest.approx(0.8)
    assert out["gemm_shares"]["fp32"] == pytest.approx(0.9)
    assert out["gemm_share"] == pytest.approx(0.8)  # bf16's: what an unmeasured dtype (fp16 here) runs at
    assert out["hbm_share"] == pytest.approx(0.9)
    assert out["kernel_s"] == 5e-6
    assert host == pytest.approx(40e9)  # the slower direction
    assert out["peak_flops"] == facts["peak_flops"] and out["hbm_bytes_per_s"] == facts["hbm_bytes_per_s"]
    assert out["sources"][0].startswith("calibrated on this device (fake H100")
    assert not any(line.startswith("kernel shares") for line in out["sources"])  # replaced by the measurement


def test_the_calibrated_clock_prices_a_gemm_at_the_measured_rate():
    """A 4096 x 4096 x 4096 bf16 GEMM on the calibrated clock: 2 m n k / (peak x 0.8) + the measured kernel cost;
    fp16 (not measured) at bf16's share; fp32 at its own 0.9."""
    clock, host, lines = calibrated_device_clock(device_row("h100"), timings=_timings())
    assert isinstance(clock, DeviceClock) and host == pytest.approx(40e9) and lines[0].startswith("calibrated")
    n = 4096
    assert gemm_seconds(n, n, n, dtype="bf16", elem_bytes=2, dev=clock) == pytest.approx(
        2 * n**3 / (H100_BF16 * 0.8) + 5e-6)
    assert gemm_seconds(n, n, n, dtype="fp16", elem_bytes=2, dev=clock) == pytest.approx(
        2 * n**3 / (989.5e12 * 0.8) + 5e-6)
    assert gemm_seconds(n, n, n, dtype="fp32", elem_bytes=4, dev=clock) == pytest.approx(
        2 * n**3 / (H100_FP32 * 0.9) + 5e-6)


def test_a_rate_over_the_datasheet_is_capped_and_the_skinny_ratio_is_reported():
    out, _ = calibrated_clock_facts(clock_facts(device_row("h100")), _timings(bf16_share=1.05, hbm_share=1.1))
    assert out["gemm_shares"]["bf16"] == 1.0 and out["hbm_share"] == 1.0
    # the skinny GEMM priced on the calibrated clock vs its 1 ms: roofline max(FLOPs, bytes) + kernel, by hand
    m, n, k = 256, 8192, 8192
    priced = max(2 * m * n * k / H100_BF16, 2 * (m * k + k * n + m * n) / (H100_HBM * 1.0)) + 5e-6
    assert f"skinny 256x8192x8192 bf16 priced/measured {priced / 1e-3:.2f}" in out["sources"][0]


def test_a_timed_causal_attention_becomes_the_attention_share():
    """SDPA's causal forward and backward of 2 x 16 heads x 4096 x 128 in bf16: the causal half of QK^T and AV,
    4 b s^2 h d / 2 FLOPs forward, 2.5x that backward; timed at what 45% of the H100's peak would take."""
    import dataclasses

    executed = 4 * 2 * 4096**2 * 16 * 128 / 2
    att_s = 3.5 * executed / (0.45 * H100_BF16)
    t = dataclasses.replace(_timings(), attention=(2, 16, 4096, 128, "bf16", att_s))
    out, _ = calibrated_clock_facts(clock_facts(device_row("h100")), t)
    assert out["attention_share"] == pytest.approx(0.45)
    assert "causal SDPA attention 2x16x4096x128 bf16" in out["sources"][0]
    assert out["sources"][-1].startswith("links and the eager share: the table's")
    untimed, _ = calibrated_clock_facts(clock_facts(device_row("h100")), _timings())
    assert untimed["attention_share"] == clock_facts(device_row("h100"))["attention_share"]  # the table's 0.35
    assert untimed["sources"][-1].startswith("attention, links and the eager share: the table's")


def test_timings_without_a_known_dtype_are_refused():
    t = DeviceTimings(device_name="x", gemms=(("large", 8, 8, 8, "int8", 1.0),), copy_bytes=1, copy_s=1.0,
                      h2d_bytes=1, h2d_s=1.0, d2h_bytes=1, d2h_s=1.0, launch_s=0.0)
    with pytest.raises(ValueError, match="timings.gemms"):
        calibrated_clock_facts(clock_facts(device_row("h100")), t)


def test_the_cpu_row_has_nothing_to_calibrate_this_way():
    with pytest.raises(ValueError, match="no clock facts"):
        calibrated_device_clock(device_row("cpu"), timings=_timings())


def test_calibrate_on_a_gpu_row_without_cuda_is_one_line(capsys):
    """On this CPU-only machine a GPU row cannot be calibrated: refused before any work, in one line."""
    import torch

    from trainfit.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU check script runs the calibration")
    rc = main(["plan", "--global-batch", "32", "--device-memory", "80GiB", "--device", "h100", "--calibrate"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "calibrate" in err[0] and "CUDA" in err[0], err
