"""What the planner assumes about a device and its links, with the source of every row. Pure.

Peak FLOP/s come from ``measure.hardware`` (datasheets); this table adds memory, link
bandwidth per device per direction, and the fraction of peak large-model training
achieves. A device not listed gives an error naming the ones that are -- never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class DeviceRow:
    name: str
    peak_row: str | None
    """Row name in measure.hardware.PEAKS (None: calibrated, e.g. the CPU)."""
    memory_bytes: int | None
    intra_bytes_per_s: float | None
    """Per device, one direction, inside a node."""
    inter_bytes_per_s: float | None
    """Per device, one direction, between nodes."""
    achievable_frac: float
    """Share of the dense peak a tuned large-model step reaches."""
    overlap: float
    """Share of backward time that can hide communication (separate comm stream on GPUs)."""
    source: str


_MFU = "Llama 3 paper (Dubey et al. 2024, table 4): 38-43% bf16 MFU on H100 at scale -> 0.40"
DEVICES: dict[str, DeviceRow] = {
    "h100": DeviceRow(name="h100", peak_row="H100-SXM", memory_bytes=80 * 2**30, intra_bytes_per_s=450e9,
                      inter_bytes_per_s=50e9, achievable_frac=0.40, overlap=1.0,
                      source="NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional (450 GB/s per direction); "
                             "DGX H100: one 400 Gb/s ConnectX-7 per GPU (50 GB/s); " + _MFU),
    "a100": DeviceRow(name="a100", peak_row="A100", memory_bytes=80 * 2**30, intra_bytes_per_s=300e9,
                      inter_bytes_per_s=25e9, achievable_frac=0.40, overlap=1.0,
                      source="NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional (300 per direction); "
                             "DGX A100: one 200 Gb/s HDR NIC per GPU (25 GB/s); " + _MFU),
    "cpu": DeviceRow(name="cpu", peak_row=None, memory_bytes=None, intra_bytes_per_s=None, inter_bytes_per_s=None,
                     achievable_frac=1.0, overlap=0.0,
                     source="calibrated on this machine (measure.hardware.calibrate_cpu); gloo on CPU does not "
                            "overlap communication with backward; memory and bandwidth must be given"),
}


def device_row(name: str) -> DeviceRow:
    row = DEVICES.get(name.lower())
    if row is None:
        raise ConfigError("device", name, tuple(DEVICES), "add a row to trainfit.plan.devices.DEVICES")
    return row


def dtypes_of(row: DeviceRow) -> tuple[str, ...]:
    if row.peak_row is None:
        return ("fp32", "bf16", "fp16")
    from trainfit.measure.hardware import find_device

    peak = find_device(row.peak_row)
    return tuple(k for k in ("fp32", "bf16", "fp16") if peak and k in peak.peak_tflops)
