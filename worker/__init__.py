"""The worker daemon: runs step closures against the PS tasks; holds no training state.

A worker registers with the coordinator, heartbeats, and runs each closure it is sent inside a
`ClosureScope` (deterministic push ids for exactly-once updates, its own per-worker iterators).
SIGTERM means preemption: it stops taking closures, finishes the ones it has, and leaves.

    pscluster worker --cluster cluster.yaml
"""
