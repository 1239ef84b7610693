"""The indexer's scores (SPEC §5.7): sum over heads of relu(q.k) * w in the reference's bf16 steps:
reference, GPU kernel, one dispatch."""

from pallas_kernels.index_scores.api import index_scores

__all__ = ["index_scores"]
