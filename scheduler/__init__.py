"""Scheduler and hybrid KV cache coordinator: pure Python (no torch, no ray)."""
