"""The parameter-server daemon: variable store, PS-side optimizers, sync replicas, checkpoints.

A PS task owns the variable shards placed on it (ordinal mod P), applies pushed gradients with each
shard's optimizer, deduplicates pushes by id (exactly-once), and checkpoints atomically.

    pscluster ps --cluster cluster.yaml --index 0 --checkpoint-dir ckpt --restore
"""
