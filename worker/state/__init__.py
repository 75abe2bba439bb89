"""Recurrent-state layers (Mamba-2, gated DeltaNet, short convolution), their shared base, the
state caches and the per-step state metadata."""
