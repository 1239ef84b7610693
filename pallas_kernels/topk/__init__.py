"""Ascending top-k positions of bf16 score rows (the indexer's selection, SPEC §5.7): reference,
GPU kernel, one dispatch."""

from pallas_kernels.topk.api import BlockSizes, topk_positions

__all__ = ["BlockSizes", "topk_positions"]
