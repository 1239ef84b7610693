"""Dense matmul reading block-scaled fp8 (e4m3) weights with e8m0 scales: reference, GPU kernel,
one dispatch."""

from pallas_kernels.fp8_matmul.api import BlockSizes, fp8_matmul

__all__ = ["BlockSizes", "fp8_matmul"]
