"""B14 before/after in one process: another commit's PS kernels against this checkout's, alternating.

    python bench/kernel_ab.py --before 2cfaf59 --runs 3      # before, after, before, after

The `before` commit's server/optimizer_kernels.py and server/optimizers.py are read with `git show`
into a temporary folder and imported beside this checkout's; each pass runs bench/optimizers.py's
`b14(runs)` (what `python bench/run.py --only B14` runs) through one of the two. Prints a JSON line
per pass; compare each figure with the same pass's numpy copy.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# run as a script, bench/ itself is first on sys.path (bench/profile.py would shadow the standard library's)
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as bench/run.py: one BLAS thread per process


def _old_modules(commit: str, folder: pathlib.Path) -> object:
    """The commit's server/optimizers.py, importing the commit's kernels, as a module."""
    for name in ("optimizer_kernels", "optimizers"):
        text = subprocess.run(["git", "show", f"{commit}:server/{name}.py"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        text = text.replace("from pscluster.server.optimizer_kernels import", "from before_optimizer_kernels import")
        (folder / f"before_{name}.py").write_text(text)
    sys.path.insert(0, str(folder))
    return importlib.import_module("before_optimizers")


def main() -> int:
    """Alternate the two kernel sets and print each pass's figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit whose kernels are 'before'")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--passes", type=int, default=2, help="before/after pairs")
    parser.add_argument("--mib", type=int, default=1024, help="dense variable size")
    args = parser.parse_args()
    from pscluster.server import optimizers as after

    from bench import optimizers as b14

    with tempfile.TemporaryDirectory() as tmp:
        before = _old_modules(args.before, pathlib.Path(tmp))
        for i in range(args.passes):
            for label, module in (("before", before), ("after", after)):
                b14.opt = module  # type: ignore[assignment]
                start = time.time()
                result = b14.b14(runs=args.runs, nbytes=args.mib << 20)
                print(json.dumps({"pass": f"{label}{i + 1}", "wall_s": round(time.time() - start),
                                  **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
