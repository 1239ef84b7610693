"""hc_pre + RMSNorm in one launch (SPEC §4.4, §5): reference and GPU kernel, one dispatch."""

from pallas_kernels.hc_norm.api import BlockSizes, hc_pre_norm

__all__ = ["BlockSizes", "hc_pre_norm"]
