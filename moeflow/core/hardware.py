"""Accelerator table: peak dense FLOP/s, memory, default link bandwidths.

FLOP/s are dense (no 2:4 sparsity), per GPU. Bandwidths are GB/s (1e9 B/s) per GPU per direction:
intra = NVLink / Infinity Fabric, inter = the GPU's share of the scale-out NIC (IB / RoCE / EFA).
`None` means the vendor publishes no such number (e.g. A100 has no fp8 tensor cores).
Sources (vendor datasheets):
- H100 SXM5 80GB, H800: NVIDIA H100 Tensor Core GPU datasheet: bf16 989 TFLOPS, fp8 1979 TFLOPS (dense;
  the sheet lists 2x with sparsity), 80 GB HBM3, NVLink 900 GB/s bidirectional. HGX H100 pairs each GPU
  with a ConnectX-7 400 Gb/s NIC (50 GB/s). H800: same compute and memory, NVLink 400 GB/s bidirectional
  (DeepSeek-V3 report, arXiv:2412.19437 sec. 3.2.2: "IB (50 GB/s)", NVLink "160 GB/s" achievable).
- H200 SXM: NVIDIA H200 datasheet: same tensor FLOPs as H100 SXM, 141 GB HBM3e, NVLink 900 GB/s.
- B200 (HGX B200): NVIDIA HGX B200 datasheet: fp8 4.5 PFLOPS, bf16 2.25 PFLOPS dense per GPU,
  ~180 GB HBM3e per GPU (1.44 TB per 8), NVLink 5 1.8 TB/s bidirectional; 400 Gb/s NIC per GPU assumed.
  Blackwell's tensor cores also take MXFP8 (block-scaled e4m3) at the fp8 rate (NVIDIA Blackwell architecture
  technical brief); Hopper and the MI300 series have no block-scaled formats.
- A100 SXM 40GB/80GB: NVIDIA A100 datasheet: bf16 312 TFLOPS dense, no fp8; NVLink 600 GB/s
  bidirectional; DGX A100 has a 200 Gb/s HDR NIC per GPU (25 GB/s).
- MI300X: AMD Instinct MI300X datasheet: bf16 1307.4 TFLOPS, fp8 2614.9 TFLOPS dense, 192 GB HBM3,
  7 Infinity Fabric links x 64 GB/s per direction (448 GB/s); 400 Gb/s NIC per GPU assumed.
- MI325X: AMD Instinct MI325X datasheet: same compute as MI300X, 256 GB HBM3e, same Infinity Fabric.
HBM bandwidth (the same datasheets): A100 40GB 1555 GB/s, A100 80GB 2039 GB/s, H100 / H800 3350 GB/s,
H200 4800 GB/s, B200 8000 GB/s, MI300X 5300 GB/s, MI325X 6000 GB/s.
Large-matmul efficiency (`matmul_efficiency`): the fraction of the datasheet peak that the best-shaped
dense bf16 / fp8 matmul reaches, "Maximum Achievable Matmul FLOPS" (MAMF) measured with torch by S. Bekman,
"Machine Learning Engineering", compute/accelerator/README.md (github.com/stas00/ml-engineering, commit
744d01e): bf16 A100 SXM 271.2 of 312 (86.9%), H100 SXM 794.5 of 989 (80.3%, "H200 is the same"), B200 1745
of 2250 (77.6%), MI300X 668.4 of 1300 (51.4%), MI325X 784.9 of 1300 (60.4%); fp8 H100 1402.6 of 1979
(70.9%), H200 1453.4 (73.4%), B200 3432.5 of 4500 (76.3%). No fp8 figure for MI300X/MI325X: their bf16
fraction is used (an assumption).
Host side (ZeRO-Offload, parallel.offload): `pcie_gbps` is the GPU's host link per direction, PCIe Gen5 x16 for
H100 / H200 / H800 / B200 / MI300X / MI325X (64 GB/s; the datasheets' "128 GB/s" is both directions) and Gen4
x16 for the A100 (32 GB/s of the datasheet's 64); `host_gb` is the host memory per GPU of the vendor's 8-GPU
system (DGX H100 / H200 / B200 and DGX A100 640GB: 2 TB; DGX A100 320GB: 1 TB; 2 TB assumed for MI300X / MI325X
platforms), and `host_step_gbps` the host memory bandwidth a GPU's optimizer step gets (an assumption: a
two-socket host's ~400 GB/s shared by 8 GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moeflow.core.errors import closest


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    memory_gb: float
    intra_gbps: float
    inter_gbps: float
    source: str
    hbm_gbps: float = 0.0
    """Device memory bandwidth in GB/s: what memory-bound kernels (norms, activations, small matmuls) run at."""
    matmul_efficiency: float = 0.8
    """Fraction of the bf16 peak the largest, best-shaped matmuls reach (MAMF / datasheet, see above)."""
    fp8_matmul_efficiency: float | None = None
    """The same for fp8 matmuls; None = matmul_efficiency."""
    efficiency: float = 0.5
    """Whole-model fraction of peak, used only by `moeflow simulate ep` for its compute estimate (assumption;
    MFU 40-55% is what Megatron-LM, Llama 3 and DeepSeek-V3 report). The planner models compute per operation
    (moeflow.plan.compute) from matmul_efficiency and hbm_gbps instead."""

    mxfp8: bool = False
    """Tensor cores that take MXFP8 (block-scaled FP8) at the fp8 rate."""
    pcie_gbps: float = 64.0
    """Host link per direction, GB/s (module doc): what ZeRO-Offload's copies run at."""
    host_gb: float = 256.0
    """Host memory per GPU, GB (module doc): what ZeRO-Offload may fill."""
    host_step_gbps: float = 50.0
    """Host memory bandwidth one GPU's host-side optimizer step gets, GB/s (an assumption, module doc)."""

    def matmul_fraction(self, precision: str) -> float:
        """Fraction of `peak_flops(precision)` that large matmuls reach."""
        if precision in ("fp8", "mxfp8") and self.fp8_matmul_efficiency is not None:
            return self.fp8_matmul_efficiency
        return self.matmul_efficiency

    @property
    def half_tokens(self) -> float:
        """Rows at which a matmul against a large weight is half as fast as a large one (the bf16 roofline's
        ridge point, matmul_efficiency * peak / HBM bandwidth, in FLOP per byte: a bf16 matmul of M rows
        against a K x N weight with M << K, N does about M FLOPs per byte it reads)."""
        return self.matmul_efficiency * self.bf16_tflops * 1e12 / (self.hbm_gbps * 1e9)

    def peak_flops(self, precision: str) -> float:
        if precision == "bf16":
            return self.bf16_tflops * 1e12
        if precision in ("fp8", "mxfp8"):
            if self.fp8_tflops is None:
                raise ValueError(f"--precision {precision} is not supported on {self.name} (no fp8 tensor cores); "
                                 f"use --precision bf16")
            if precision == "mxfp8" and not self.mxfp8:
                raise ValueError(f"--precision mxfp8 is not supported on {self.name} (no MXFP8 tensor cores; Blackwell "
                                 f"has them); use --precision fp8")
            return self.fp8_tflops * 1e12
        raise ValueError(f"--precision = {precision!r} is not one of ['bf16', 'fp8', 'mxfp8']")


_H100 = GPU("H100-80GB", 989, 1979, 80, 450, 50, "NVIDIA H100 datasheet (SXM5)", hbm_gbps=3350,
            matmul_efficiency=0.803, fp8_matmul_efficiency=0.709)
_A100 = GPU("A100-80GB", 312, None, 80, 300, 25, "NVIDIA A100 datasheet (SXM)", hbm_gbps=2039,
            matmul_efficiency=0.869, pcie_gbps=32)
_MI300X = GPU("MI300X", 1307.4, 2614.9, 192, 448, 50, "AMD Instinct MI300X datasheet", hbm_gbps=5300,
              matmul_efficiency=0.514)
GPUS: dict[str, GPU] = {
    g.name: g
    for g in [
        _H100,
        replace(_H100, name="H800", intra_gbps=200, source="NVIDIA H800 / DeepSeek-V3 report sec. 3.2.2"),
        replace(_H100, name="H200", memory_gb=141, hbm_gbps=4800, fp8_matmul_efficiency=0.734,
                source="NVIDIA H200 datasheet (SXM)"),
        GPU("B200", 2250, 4500, 180, 900, 50, "NVIDIA HGX B200 datasheet", hbm_gbps=8000, mxfp8=True,
            matmul_efficiency=0.776, fp8_matmul_efficiency=0.763),
        replace(_A100, name="A100-40GB", memory_gb=40, hbm_gbps=1555, host_gb=128),
        _A100,
        _MI300X,
        replace(_MI300X, name="MI325X", memory_gb=256, hbm_gbps=6000, matmul_efficiency=0.604,
                source="AMD Instinct MI325X datasheet"),
    ]
}
# extra memory a GPU cannot give to the model: CUDA context, NCCL buffers, allocator fragmentation
RESERVED_GB = 4.0


def get_gpu(name: str) -> GPU:
    """Look a GPU up by name (case-insensitive); ValueError with the closest names otherwise."""
    by_lower = {k.lower(): v for k, v in GPUS.items()}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    prefix = [k for k in GPUS if k.lower().startswith(name.lower())]
    hint = f" Did you mean {' or '.join(repr(k) for k in prefix)}?" if prefix else closest(name, GPUS)
    raise ValueError(
        f"--gpu = {name!r} is not in the hardware table.{hint} Known: {', '.join(GPUS)}; "
        "or use --calibrate to measure this machine"
    )
