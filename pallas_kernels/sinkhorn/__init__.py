"""Hyper-connection Sinkhorn split (SPEC §4.3): reference, GPU and TPU kernels, one dispatch."""

from pallas_kernels.sinkhorn.api import BlockSizes, hc_mixes, hc_split_sinkhorn

__all__ = ["BlockSizes", "hc_mixes", "hc_split_sinkhorn"]
