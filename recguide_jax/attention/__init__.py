"""Attention of query blocks over the paged KV cache: the XLA path (`paged`), the full-gather reference (`reference`) and the choice between them and the Pallas kernels (`dispatch`)."""
