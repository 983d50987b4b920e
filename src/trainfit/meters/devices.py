"""Device and hardware facts, one table each, with the source of every row; CPU calibration.

``PEAKS``: dense peak FLOP/s per device and dtype (what MFU is measured against).
``DEVICES``: what the planner assumes about a device and its links (memory, link bandwidth, HBM
bandwidth, its generation's kernel shares in ``KERNEL_SHARES`` for ``plan.clock``), by the names
``--device`` takes.

Figures are *dense* tensor-core (or CUDA-core for fp32) peaks from the vendor datasheets;
where a datasheet lists "with sparsity" figures we halve them and say so. A device that is
not in the table gives ``None`` -- never a guess from a similar name. Device names are
matched exactly against the strings ``torch.cuda.get_device_name()`` returns (listed per
row); add a row rather than loosening the match.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from trainfit.errors import ConfigError
from trainfit.vocabulary import TORCH_DTYPE_NAMES, Dtype, precision_facts

DTYPES = tuple(Dtype)
FP32, TF32, BF16, FP16 = Dtype


@dataclass(frozen=True, kw_only=True)
class PeakRow:
    device: str
    """Canonical device name."""
    names: tuple[str, ...]
    """Exact ``torch.cuda.get_device_name()`` strings that mean this device."""
    peak_tflops: dict[str, float]
    """Dense peak TFLOP/s per dtype (fp32 = non-tensor-core FMA rate)."""
    source: str
    """Datasheet the figures come from."""


_HALVED = "sparsity figures halved to dense"
PEAKS: tuple[PeakRow, ...] = (
    PeakRow(device="H100-SXM", names=("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"),
            peak_tflops={FP32: 67.0, TF32: 494.5, BF16: 989.5, FP16: 989.5},
            source=f"NVIDIA H100 Tensor Core GPU datasheet (2023), SXM column; {_HALVED}"),
    PeakRow(device="H100-PCIe", names=("NVIDIA H100 PCIe",),
            peak_tflops={FP32: 51.0, TF32: 378.0, BF16: 756.5, FP16: 756.5},
            source=f"NVIDIA H100 Tensor Core GPU datasheet (2023), PCIe column; {_HALVED}"),
    PeakRow(device="H200-SXM", names=("NVIDIA H200",),
            peak_tflops={FP32: 67.0, TF32: 494.5, BF16: 989.5, FP16: 989.5},
            source=f"NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM column; {_HALVED}"),
    PeakRow(device="A100", names=("NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB",
                                  "NVIDIA A100 80GB PCIe"),  # one peak for all four: same GA100 clocks
            peak_tflops={FP32: 19.5, TF32: 156.0, BF16: 312.0, FP16: 312.0},
            source="NVIDIA A100 Tensor Core GPU datasheet (2021); dense figures as listed (sparse ones are 2x)"),
    PeakRow(device="L4", names=("NVIDIA L4",),
            peak_tflops={FP32: 30.3, TF32: 60.0, BF16: 121.0, FP16: 121.0},
            source=f"NVIDIA L4 Tensor Core GPU datasheet (2023); {_HALVED}"),
    PeakRow(device="L40S", names=("NVIDIA L40S",),
            peak_tflops={FP32: 91.6, TF32: 183.0, BF16: 362.05, FP16: 362.05},
            source="NVIDIA L40S GPU datasheet (2023); dense figures as listed (sparse ones are 2x)"),
    PeakRow(device="MI300X", names=("AMD Instinct MI300X",),
            peak_tflops={FP32: 163.4, TF32: 653.7, BF16: 1307.4, FP16: 1307.4},
            source="AMD Instinct MI300X accelerator data sheet (2023): dense matrix figures (FP32 matrix 163.4; "
                   "TF32, FP16, BF16 as listed without sparsity)"),
    PeakRow(device="A10", names=("NVIDIA A10",),
            peak_tflops={FP32: 31.2, TF32: 62.5, BF16: 125.0, FP16: 125.0},
            source="NVIDIA A10 Tensor Core GPU datasheet (2021); dense figures as listed (sparse ones are 2x)"),
    PeakRow(device="V100-SXM2", names=("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"),
            peak_tflops={FP32: 15.7, FP16: 125.0},
            source="NVIDIA Tesla V100 GPU datasheet (2020), SXM2 column (no bf16/tf32 support)"),
    PeakRow(device="T4", names=("Tesla T4",),
            peak_tflops={FP32: 8.1, FP16: 65.0},
            source="NVIDIA T4 Tensor Core GPU datasheet (2019), mixed-precision FP16/FP32 (no bf16/tf32)"),
)


def find_device(name: str) -> PeakRow | None:
    """The table row whose exact names include ``name`` (or whose canonical name is ``name``)."""
    for row in PEAKS:
        if name == row.device or name in row.names:
            return row
    return None


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of ``device_name`` for ``dtype``; None when the device or dtype is not in the table.

    Raises:
        ValueError: ``dtype`` is not one of fp32, tf32, bf16, fp16.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; allowed: one of: {', '.join(DTYPES)}")
    row = find_device(device_name)
    if row is None or dtype not in row.peak_tflops:
        return None
    return row.peak_tflops[dtype] * 1e12


def compute_dtype(precision_name: str, *, tf32_enabled: bool) -> str:
    """The dtype matmuls run in under a precision policy (fp32 -> tf32 when TF32 is enabled)."""
    compute = precision_facts(precision_name).compute
    return TF32 if compute == FP32 and tf32_enabled else compute


@dataclass(frozen=True, kw_only=True)
class DeviceRow:
    name: str
    peak_row: str | None
    """Row name in PEAKS above (None: calibrated, e.g. the CPU)."""
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
    host_bytes_per_s: float | None = None
    """Per device, one direction, between device and host memory (offload traffic); None: unknown (CPU: none)."""
    hbm_bytes_per_s: float | None = None
    """Datasheet memory bandwidth (what the memory-bound ops of the op-level clock run at); None: the CPU."""
    arch: str | None = None
    """Key of :data:`KERNEL_SHARES`: what the GEMMs, attention and collectives of this generation reach."""


@dataclass(frozen=True, kw_only=True)
class KernelShares:
    """What one GPU generation's kernels reach, as shares of its datasheet figures (``plan.clock``)."""

    gemm: float
    """Share of the dense peak a large, well-shaped GEMM sustains."""
    attention: float
    """Share of the dense peak the fused attention kernel (SDPA flash) sustains, forward + backward."""
    hbm: float
    """Share of the datasheet memory bandwidth a streaming elementwise kernel reaches."""
    kernel_s: float
    """Fixed cost of one kernel (launch and ramp-up)."""
    bus: float
    """NCCL/RCCL ring bus bandwidth as a share of the per-direction link bandwidth."""
    source: str
    eager: float
    """Share of the kernel-priced rate an eager PyTorch FSDP step sustains on this generation (launch gaps, hooks,
    the allocator, collectives sharing the SMs): fitted on published steps (``eager_source``)."""
    eager_source: str


_FA2 = ("Dao 2023, FlashAttention-2 (arXiv 2307.08691): FlashAttention-2 reaches 50-73% of the A100's peak, close "
        "to the 80-90% optimized GEMMs reach")
_FA3 = ("Shah et al. 2024, FlashAttention-3 (arXiv 2407.08608): FlashAttention-2 (what SDPA's flash backend runs) "
        "reaches 35% of the H100's peak, a Hopper-native warp-specialised kernel 75%")
_ASSUMED = ("assumed, no measurement read: streaming kernels at 80% of the datasheet bandwidth, 4 us per kernel, "
            "ring collectives at 80% of the link")
_MAMF = ("Bekman, ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison "
         "table' (BF16 matmul, best shape of mamf-finder.py's search): ")
_FITTED = ("fitted: the median measured/priced step over the held-in rows of benchmarks/planner_published.py "
           "(MosaicML llm-foundry's {table} table at sequence 2048 on 8 GPUs, {n} rows; the A100 40GB rows, the "
           "IBM/Meta FSDP blog's and TinyLlama's are held out)")
_EAGER_AMPERE = 0.78
_EAGER_HOPPER = 0.67
_FITTED_AMPERE = _FITTED.format(table="A100 80GB", n=9)
_FITTED_HOPPER = (_FITTED.format(table="H100 80GB BF16", n=5) + f"; lower than Ampere's {_EAGER_AMPERE}, as expected "
                  "if the host-side work of a step (launches, hooks, the allocator) does not speed up with the GPU "
                  "while its kernels run about 3x faster")
KERNEL_SHARES: dict[str, KernelShares] = {
    "ampere": KernelShares(gemm=0.859, attention=0.6, hbm=0.8, kernel_s=4e-6, bus=0.8,
                           source=f"GEMM 0.859: {_MAMF}A100 SXM 267.9 of 312 TFLOPS (CUDA 12.1); attention 0.6: "
                                  f"{_FA2}; {_ASSUMED}",
                           eager=_EAGER_AMPERE, eager_source=f"eager share {_EAGER_AMPERE}: {_FITTED_AMPERE}"),
    "hopper": KernelShares(gemm=0.801, attention=0.35, hbm=0.8, kernel_s=4e-6, bus=0.8,
                           source=f"GEMM 0.801: {_MAMF}H100 SXM 792.1 of 989 TFLOPS (CUDA 12.1); attention 0.35: "
                                  f"{_FA3}; {_ASSUMED}",
                           eager=_EAGER_HOPPER, eager_source=f"eager share {_EAGER_HOPPER}: {_FITTED_HOPPER}"),
    "ada": KernelShares(gemm=0.859, attention=0.6, hbm=0.8, kernel_s=4e-6, bus=0.8,
                        source=f"as Ampere (the same mma.sync tensor-core path; no Ada figure read): GEMM {_MAMF}A100 "
                               f"SXM's 0.859; {_FA2}; {_ASSUMED}",
                        eager=_EAGER_AMPERE,
                        eager_source=f"eager share {_EAGER_AMPERE}: Ampere's (no published Ada step read; an L4/L40S "
                                     f"GEMM runs at or below an A100's rate); Ampere's is {_FITTED_AMPERE}"),
    "cdna3": KernelShares(gemm=0.601, attention=0.35, hbm=0.8, kernel_s=4e-6, bus=0.8,
                          source=f"GEMM 0.601: {_MAMF}MI300X 781.9 of 1300 TFLOPS (ROCm 6.2); attention 0.35 assumed, "
                                 f"no measurement read (pass --calibrate on the device); {_ASSUMED}",
                          eager=_EAGER_HOPPER,
                          eager_source=f"eager share {_EAGER_HOPPER}: Hopper's (no published MI300X step read; its "
                                       f"achievable GEMM rate, 781.9 TFLOPS, is an H100's); Hopper's is "
                                       f"{_FITTED_HOPPER}"),
}
"""Per GPU generation: the shares ``plan.clock`` prices kernels at, and the eager share, with their sources."""


_MFU = "Llama 3 paper (Dubey et al. 2024, table 4): 38-43% bf16 MFU on H100 at scale -> 0.40"
_NVL3 = "NVLink 3: 600 GB/s bidirectional (300 per direction)"
_NVL4 = "NVLink 4: 900 GB/s bidirectional (450 per direction)"
_PCIE4, _PCIE5 = "PCIe Gen4 x16: 64 GB/s bidirectional (32 per direction)", "PCIe Gen5 x16: 128 GB/s bidirectional (64)"
DEVICES: dict[str, DeviceRow] = {
    "h100": DeviceRow(name="h100", peak_row="H100-SXM", memory_bytes=80 * 2**30, intra_bytes_per_s=450e9,
                      inter_bytes_per_s=50e9, achievable_frac=0.40, overlap=1.0,
                      host_bytes_per_s=64e9, hbm_bytes_per_s=3.35e12, arch="hopper",
                      source="NVIDIA H100 datasheet, SXM column: 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s "
                             "bidirectional (450 GB/s per direction); "
                             "DGX H100: one 400 Gb/s ConnectX-7 per GPU (50 GB/s); PCIe Gen5 128 GB/s bidirectional "
                             "to the host (64 GB/s per direction); " + _MFU),
    "h200": DeviceRow(name="h200", peak_row="H200-SXM", memory_bytes=141 * 2**30, intra_bytes_per_s=450e9,
                      inter_bytes_per_s=50e9, achievable_frac=0.40, overlap=1.0, host_bytes_per_s=64e9,
                      hbm_bytes_per_s=4.8e12, arch="hopper",
                      source="NVIDIA H200 datasheet (2024), SXM column: 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s "
                             "bidirectional "
                             "(450 GB/s per direction), PCIe Gen5 128 GB/s bidirectional to the host (64 per "
                             "direction); DGX H200: one 400 Gb/s ConnectX-7 per GPU (50 GB/s); " + _MFU),
    "a100": DeviceRow(name="a100", peak_row="A100", memory_bytes=80 * 2**30, intra_bytes_per_s=300e9,
                      inter_bytes_per_s=25e9, achievable_frac=0.40, overlap=1.0,
                      host_bytes_per_s=32e9, hbm_bytes_per_s=2.039e12, arch="ampere",
                      source="NVIDIA A100 datasheet, 80GB SXM column: HBM2e at 2,039 GB/s; NVLink 600 GB/s "
                             "bidirectional (300 per direction); "
                             "DGX A100: one 200 Gb/s HDR NIC per GPU (25 GB/s); PCIe Gen4 64 GB/s bidirectional to "
                             "the host (32 per direction); " + _MFU),
    "a100-40gb": DeviceRow(name="a100-40gb", peak_row="A100", memory_bytes=40 * 2**30, intra_bytes_per_s=300e9,
                           inter_bytes_per_s=25e9, achievable_frac=0.40, overlap=1.0, host_bytes_per_s=32e9,
                           hbm_bytes_per_s=1.555e12, arch="ampere",
                           source=f"NVIDIA A100 datasheet, 40GB SXM column: HBM2 at 1,555 GB/s; {_NVL3}; DGX A100: one "
                                  f"200 Gb/s HDR NIC per GPU (25 GB/s); {_PCIE4} to the host; " + _MFU),
    "a100-pcie": DeviceRow(name="a100-pcie", peak_row="A100", memory_bytes=80 * 2**30, intra_bytes_per_s=32e9,
                           inter_bytes_per_s=None, achievable_frac=0.40, overlap=1.0, host_bytes_per_s=32e9,
                           hbm_bytes_per_s=1.935e12, arch="ampere",
                           source=f"NVIDIA A100 datasheet, 80GB PCIe column: HBM2e at 1,935 GB/s; devices talk over "
                                  f"{_PCIE4} (the NVLink bridge joins pairs only), also the host link; between nodes "
                                  "pass --bandwidth-inter; " + _MFU),
    "a100-pcie-40gb": DeviceRow(name="a100-pcie-40gb", peak_row="A100", memory_bytes=40 * 2**30,
                                intra_bytes_per_s=32e9, inter_bytes_per_s=None, achievable_frac=0.40, overlap=1.0,
                                host_bytes_per_s=32e9, hbm_bytes_per_s=1.555e12, arch="ampere",
                                source=f"NVIDIA A100 datasheet, 40GB PCIe column: HBM2 at 1,555 GB/s; {_PCIE4} between "
                                       "devices and to the host; between nodes pass --bandwidth-inter; " + _MFU),
    "h100-pcie": DeviceRow(name="h100-pcie", peak_row="H100-PCIe", memory_bytes=80 * 2**30, intra_bytes_per_s=64e9,
                           inter_bytes_per_s=None, achievable_frac=0.40, overlap=1.0, host_bytes_per_s=64e9,
                           hbm_bytes_per_s=2.0e12, arch="hopper",
                           source=f"NVIDIA H100 datasheet, PCIe column: 80 GB HBM2e at 2 TB/s; devices talk over "
                                  f"{_PCIE5} (the NVLink bridge joins pairs only), also the host link; between nodes "
                                  "pass --bandwidth-inter; " + _MFU),
    "l40s": DeviceRow(name="l40s", peak_row="L40S", memory_bytes=48 * 2**30, intra_bytes_per_s=32e9,
                      inter_bytes_per_s=None, achievable_frac=0.40, overlap=1.0, host_bytes_per_s=32e9,
                      hbm_bytes_per_s=864e9, arch="ada",
                      source=f"NVIDIA L40S datasheet (2023): 48 GB GDDR6 at 864 GB/s, no NVLink: {_PCIE4} between "
                             "devices and to the host; between nodes pass --bandwidth-inter; " + _MFU),
    "mi300x": DeviceRow(name="mi300x", peak_row="MI300X", memory_bytes=192 * 2**30, intra_bytes_per_s=448e9,
                        inter_bytes_per_s=50e9, achievable_frac=0.40, overlap=1.0, host_bytes_per_s=64e9,
                        hbm_bytes_per_s=5.3e12, arch="cdna3",
                        source="AMD Instinct MI300X data sheet (2023): 192 GB HBM3 at 5.3 TB/s; seven Infinity Fabric "
                               "links of 128 GB/s bidirectional to the other seven GPUs of an 8-GPU platform (896 GB/s "
                               "aggregate bidirectional, 448 per direction); PCIe Gen5 x16 128 GB/s bidirectional to "
                               "the host (64 per direction); between nodes one 400 Gb/s NIC per GPU assumed (50 GB/s); "
                               + _MFU),
    "l4": DeviceRow(name="l4", peak_row="L4", memory_bytes=24 * 2**30, intra_bytes_per_s=32e9,
                    inter_bytes_per_s=None, achievable_frac=0.40, overlap=1.0, host_bytes_per_s=32e9,
                    hbm_bytes_per_s=300e9, arch="ada",
                    source="NVIDIA L4 datasheet (2023): 24 GB GDDR6 at 300 GB/s, no NVLink: devices talk over PCIe "
                           "Gen4 x16 "
                           "(64 GB/s bidirectional, 32 per direction), which is also the host link; between nodes "
                           "it depends on the cloud (pass --bandwidth-inter); " + _MFU),
    "cpu": DeviceRow(name="cpu", peak_row=None, memory_bytes=None, intra_bytes_per_s=None, inter_bytes_per_s=None,
                     achievable_frac=1.0, overlap=0.0,
                     source="calibrated on this machine (calibrate_cpu below); gloo on CPU does not "
                            "overlap communication with backward; memory and bandwidth must be given"),
}


def clock_facts(row: DeviceRow) -> dict | None:
    """The keyword arguments of ``plan.clock.DeviceClock`` for a GPU row (peaks, bandwidth, kernel shares and every
    source), or None for a row without them (the CPU: its rate is calibrated)."""
    peak = find_device(row.peak_row) if row.peak_row else None
    if peak is None or row.hbm_bytes_per_s is None or row.arch is None:
        return None
    k = KERNEL_SHARES[row.arch]
    return dict(name=row.name, peak_flops={d: t * 1e12 for d, t in peak.peak_tflops.items()},
                hbm_bytes_per_s=row.hbm_bytes_per_s, gemm_share=k.gemm, attention_share=k.attention, hbm_share=k.hbm,
                kernel_s=k.kernel_s, bus_share=k.bus, eager_share=k.eager,
                sources=(f"peak: {peak.source}", f"memory and links: {row.source.split('; ' + _MFU)[0]}",
                         f"kernel shares ({row.arch}): {k.source}", k.eager_source))


def device_row(name: str) -> DeviceRow:
    row = DEVICES.get(name.lower())
    if row is None:
        raise ConfigError("device", name, tuple(DEVICES), "add a row to trainfit.meters.devices.DEVICES")
    return row


def dtypes_of(row: DeviceRow) -> tuple[str, ...]:
    if row.peak_row is None:
        return (FP32, BF16, FP16)
    peak = find_device(row.peak_row)
    return tuple(k for k in (FP32, BF16, FP16) if peak and k in peak.peak_tflops)



@dataclass(frozen=True, kw_only=True)
class Calibration:
    flops_per_s: float
    """Achievable rate with ``threads`` threads: the best one-thread rate x threads."""
    per_thread_flops_per_s: float
    """Best measured one-thread matmul rate."""
    dtype: str
    size: int
    """Square matmul size used."""
    threads: int
    """torch CPU threads of the run (``torch.get_num_threads()``)."""
    source: str = ("measured: best of repeated one-thread square matmuls on this CPU x threads "
                   "(trainfit.meters.devices.calibrate_cpu)")


def calibrate_cpu(dtype: str = FP32, *, size: int | None = None, seconds: float = 0.3) -> Calibration:
    """Achievable CPU matmul FLOP/s: the best one-thread rate of repeated ``size x size``
    matmuls, times the run's thread count.

    A CPU has no datasheet peak we can trust per SKU and thread count, so MFU on CPU is
    reported against this measured rate. One thread, because a multi-threaded product on a
    shared machine waits for its slowest (descheduled) thread and can read 10-100x low, which
    would inflate MFU; x threads assumes matmul scales linearly with cores (an upper bound on
    the achievable rate, so MFU errs low).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not valid; allowed: one of: {', '.join(DTYPES)}")
    import torch  # here, not at the top: the device table is read by plans that build nothing

    # Half-precision CPU matmuls are far slower: keep them small so calibration stays short.
    size = size or (512 if dtype in (FP32, TF32) else 256)
    threads = torch.get_num_threads()
    torch_dtype = getattr(torch, TORCH_DTYPE_NAMES[dtype])
    a = torch.randn(size, size, dtype=torch_dtype)
    b = torch.randn(size, size, dtype=torch_dtype)
    torch.set_num_threads(1)
    try:
        torch.mm(a, b)  # warm-up
        best = float("inf")
        start = time.perf_counter()
        reps = 0
        # Best of many: single products can be descheduled for milliseconds on a shared machine,
        # so keep going until both the time and the count are reached (at most 3x the time).
        while (reps < 20 or time.perf_counter() - start < seconds) and time.perf_counter() - start < 3 * seconds:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
            reps += 1
    finally:
        torch.set_num_threads(threads)
    per_thread = 2 * size**3 / best
    return Calibration(flops_per_s=per_thread * threads, per_thread_flops_per_s=per_thread, dtype=dtype, size=size,
                       threads=threads)


def _echo(srv, nbytes: int, pings: int) -> None:
    import socket

    conn, _ = srv.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(pings):
            conn.sendall(conn.recv(1))
        got = 0
        while got < nbytes:
            got += len(conn.recv(1 << 20))
        conn.sendall(b"k")


def measure_loopback(nbytes: int = 8 * 2**20, pings: int = 50) -> tuple[float, float]:
    """(bytes/s, one-way latency s) of TCP on 127.0.0.1 between two processes -- the path gloo
    uses between ranks on one host, including the wait for the peer process to be scheduled
    (which dominates small collectives on a busy machine). Costs ~0.1-0.5 s."""
    import multiprocessing
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    # fork: the child only runs socket code (no torch), and starts in milliseconds.
    child = multiprocessing.get_context("fork").Process(target=_echo, args=(srv, nbytes, pings), daemon=True)
    child.start()
    payload = b"\0" * nbytes
    try:
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rtts = []
            for _ in range(pings):
                t0 = time.perf_counter()
                c.sendall(b"x")
                c.recv(1)
                rtts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            c.sendall(payload)
            c.recv(1)
            elapsed = time.perf_counter() - t0
    finally:
        srv.close()
        child.join(10)
    return nbytes / elapsed, sorted(rtts)[len(rtts) // 2] / 2


def measure_host_copy(nbytes: int = 64 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of one host-to-host memory copy (``Tensor.copy_`` of ``nbytes``, best of ``repeats``).

    What ``plan --calibrate`` prices offload with on a CPU-only machine, where "device" and "host" are the
    same memory: the copy the offload lever makes (a saved activation, a gradient to its host buffer) is a
    memcpy. On a GPU the link is the datasheet's (``DEVICES[name].host_bytes_per_s``). Costs ~0.1 s.
    """
    import torch  # here, as in calibrate_cpu: only a calibrating plan measures

    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not the copy
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
