"""max_inflight_per_worker 2 vs 4 on B13, W2 (B2 async) and B4, alternating in one run.

    python bench/inflight.py --pairs 3 --closures 200

B13: two 2 PS + 2 worker clusters live side by side (the coordinator's setting is all that differs),
repetitions alternating between them (ABBA), `closures` timed closures after 20 warm-up ones each. W2 and
B4 run on fresh clusters per measurement, alternating settings in the same order. Prints every
measurement and the medians with the 4 / 2 ratios.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench import closures, sparse, training  # noqa: E402

SETTINGS = (2, 4)


def main() -> None:
    """Alternate the settings on every benchmark; print runs, medians and ratios."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--closures", type=int, default=200, help="timed B13 closures per repetition")
    ap.add_argument("--only", default="B13,W2,B4", help="comma-separated subset of B13, W2, B4")
    args = ap.parse_args()
    only = set(args.only.split(","))
    runs: dict[str, dict[int, list[float]]] = {}

    def record(name: str, setting: int, value: float) -> None:
        runs.setdefault(name, {s: [] for s in SETTINGS})[setting].append(value)
        print(json.dumps({"figure": name, "max_inflight_per_worker": setting, "value": round(value, 4)}), flush=True)

    def order(pair: int) -> tuple[int, ...]:
        return SETTINGS if pair % 2 == 0 else SETTINGS[::-1]

    if "B13" in only:
        clusters = {s: sparse.PsclusterRun(inflight=s) for s in SETTINGS}
        try:
            for pair in range(args.pairs):
                for s in order(pair):
                    record("b13_rows_per_s", s, clusters[s].rep(args.closures))
        finally:
            for run in clusters.values():
                run.close()
    for pair in range(args.pairs):
        for s in order(pair):
            if "W2" in only:
                w = training.w2(inflight=s)
                record("w2_steps_per_s", s, w["steps_per_s"])
                record("w2_accuracy", s, w["accuracy"])
            if "B4" in only:
                b = closures.b4(inflight=s)
                record("b4_closures_per_s", s, b["closures_per_s"])
                record("b4_round_trip_ms", s, b["round_trip_ms"])
    summary = {name: {"median_2": statistics.median(r[2]), "median_4": statistics.median(r[4]),
                      "ratio_4_over_2": statistics.median(r[4]) / statistics.median(r[2])} for name, r in runs.items()}
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
