"""Pallas kernels (GPU and TPU), each beside its pure-jnp reference: sinkhorn, sparse_attention,
expert_matmul, fp8_matmul."""
