"""W2 async steps/s and B4 (empty-closure round trip) of two checkouts, alternating, in one run.

    python bench/ab_trees.py BEFORE_DIR AFTER_DIR --pairs 5

Each directory is a checkout with its own .venv (made by `make`); each run starts a fresh process in that
tree, so both trees see the same machine in turns. Prints every run and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

CODE = ("import json, sys; sys.path.insert(0, '.'); from bench import training, closures; "
        "w = training.w2(); b = closures.b4(); print(json.dumps({'w2_steps_per_s': w['steps_per_s'], "
        "'accuracy': w['accuracy'], 'b4_round_trip_ms': b['round_trip_ms'], "
        "'b4_cpu_ms_per_closure': b['coordinator_cpu_ms'], 'b4_closures_per_s': b['closures_per_s']}))")


def run_once(tree: str) -> dict[str, float]:
    """One W2 + B4 measurement in a fresh process of `tree`."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([os.path.join(tree, ".venv", "bin", "python"), "-c", CODE], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=900, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    """Alternate the two trees (ABBA order) and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    trees = {"before": args.before, "after": args.after}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for i in range(args.pairs):
        order = list(trees.items()) if i % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            runs[name].append(run_once(tree))
            print(name, runs[name][-1], flush=True)
    for name, results in runs.items():
        print(name, {k: round(statistics.median(r[k] for r in results), 4) for k in results[0]})


if __name__ == "__main__":
    main()
