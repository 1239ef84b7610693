"""The window-KV row of a one-row decode step (SPEC §5.3-5.4): kv_norm, RoPE of the tail and the
FP8 QDQ of the new row, written into its ring slot: reference, GPU kernel, one dispatch."""

from pallas_kernels.window_kv.api import write_window_row

__all__ = ["write_window_row"]
