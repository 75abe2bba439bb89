"""Attention: the paged attention layer, attention groups and their metadata builders, metadata
transforms (chunked-local virtual batches, truncated prefill) and per-group block tables."""
