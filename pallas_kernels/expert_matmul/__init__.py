"""Routed-expert matmul reading packed fp4 (e2m1) weights with e8m0 scales: reference, GPU kernel,
one dispatch."""

from pallas_kernels.expert_matmul.api import BlockSizes, gather_matmul, grouped_matmul, grouped_tiles

__all__ = ["BlockSizes", "gather_matmul", "grouped_matmul", "grouped_tiles"]
