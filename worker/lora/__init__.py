"""LoRA adapters on the worker: PEFT files, adapter slots on the projections, the slot LRU."""
