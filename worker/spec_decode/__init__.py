"""Speculative decoding on the workers: draft proposers and the lossless verifier."""
