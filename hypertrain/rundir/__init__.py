"""What a run leaves on disk: its directory and lock, its records (metrics.jsonl and the W&B mirror),
its checkpoints with their digests."""
