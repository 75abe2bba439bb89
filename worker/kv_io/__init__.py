"""KV pages in and out of a rank: export and import for transfers between engines, the direct
rank-to-rank connection, the offload tier's host and disk stores, and the shard layout they
share."""
