"""Operations tooling: the `pscluster` command line, daemon start-up, certificates, cluster status,
metrics, and the launchers that compose roles into a running cluster (local processes, Ray).

These are entry points: they may import anything, roles included. Nothing below them imports them,
except that a role's `main` uses `daemon` and `metrics`.
"""
