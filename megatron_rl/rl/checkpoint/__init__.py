"""Training checkpoints: saving (sync or async) and loading with torch.distributed.checkpoint, their
checksums and trust rule, bounded reads, retention, failures in one line, and what a resume must
share with its config (the data position, carried groups and routes)."""
