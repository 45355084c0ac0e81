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
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moeflow.errors import closest


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    memory_gb: float
    intra_gbps: float
    inter_gbps: float
    source: str
    efficiency: float = 0.5
    """Fraction of peak a well-tuned large matmul workload reaches (assumption; MFU 40-55% is what
    Megatron-LM, Llama 3 and DeepSeek-V3 report on H100/H800 class parts)."""
    half_tokens: float = 256.0
    """Tokens per micro-batch per GPU at which matmul efficiency halves (assumption: small matmuls
    under-use the tensor cores; eff(n) = efficiency * n / (n + half_tokens))."""
    mxfp8: bool = False
    """Tensor cores that take MXFP8 (block-scaled FP8) at the fp8 rate."""

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


_H100 = GPU("H100-80GB", 989, 1979, 80, 450, 50, "NVIDIA H100 datasheet (SXM5)")
GPUS: dict[str, GPU] = {
    g.name: g
    for g in [
        _H100,
        replace(_H100, name="H800", intra_gbps=200, source="NVIDIA H800 / DeepSeek-V3 report sec. 3.2.2"),
        replace(_H100, name="H200", memory_gb=141, source="NVIDIA H200 datasheet (SXM)"),
        GPU("B200", 2250, 4500, 180, 900, 50, "NVIDIA HGX B200 datasheet", mxfp8=True),
        GPU("A100-40GB", 312, None, 40, 300, 25, "NVIDIA A100 datasheet (SXM)"),
        GPU("A100-80GB", 312, None, 80, 300, 25, "NVIDIA A100 datasheet (SXM)"),
        GPU("MI300X", 1307.4, 2614.9, 192, 448, 50, "AMD Instinct MI300X datasheet"),
        GPU("MI325X", 1307.4, 2614.9, 256, 448, 50, "AMD Instinct MI325X datasheet"),
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
