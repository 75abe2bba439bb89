"""The hybrid KV cache core: specs and the config builder, the block pool and its free queue, one
manager per layer type, the coordinators that agree on one prefix hit, and the manager facade.

    KVCacheManager (manager.py) ─► coordinator ─► one manager per group ─► BlockPool
"""
