"""Top-k selections without sorts: the ascending top-k positions of bf16 score rows (the
indexer's selection, SPEC §5.7) and the MoE gate's ranked top-k of f32 expert scores (SPEC §6.1);
and the gate's logits (a single row with its RMSNorm in the same launch): reference, GPU kernel,
one dispatch each."""

from pallas_kernels.topk.api import BlockSizes, router_logits, router_topk, router_topk_scored, topk_positions

__all__ = ["BlockSizes", "router_logits", "router_topk", "router_topk_scored", "topk_positions"]
