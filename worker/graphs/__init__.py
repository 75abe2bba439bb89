"""Captured decode steps: capture sizes and padding (`capture_sizes`), the persistent buffers
of a decode step (`static_batch`) and its CUDA graphs (`decode_graphs`)."""
