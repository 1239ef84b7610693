"""Sparse attention with a sink (SPEC §5.10): reference, GPU and TPU kernels, one dispatch."""

from pallas_kernels.sparse_attention.api import BlockSizes, sparse_attn

__all__ = ["BlockSizes", "sparse_attn"]
