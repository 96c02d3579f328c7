"""Where a W2 step's CPU goes: core time per step of every process, split by component.

    python bench/run.py --only PROFILE           # CPU per step by process (+ components if py-spy is installed)

Each process's CPU (user + system, from /proc) is read before and after the timed steps of a W2 run
(bench/training.py), so the figure is core time per step, not wall time, and holds on a busy machine.
If `py-spy` is on PATH (`pip install py-spy`; a profiling tool, not a dependency), every process is
sampled during the same steps and each sample is charged to the innermost frame that belongs to a
known component (the table below), so "model" means the MLP's numpy, "framing" the socket code
around it, and so on.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator

from bench import training
from pscluster.ops.launcher import LocalCluster

# (component, path fragments of a frame's file); the innermost matching frame of a sample decides.
COMPONENTS: list[tuple[str, tuple[str, ...]]] = [
    ("model", ("mnist.py",)),
    ("optimizer", ("server/optimizers.py",)),
    ("store+validation", ("server/store.py", "server/ps.py", "pscluster/specs.py")),
    ("decode/encode", ("pscluster/codec.py", "pscluster/net/grpc_tensors.py", "google/protobuf", "_pb2")),
    ("pickling", ("cloudpickle", "pickle.py", "pscluster/closures.py", "copyreg")),
    ("framing+sockets", ("pscluster/net/framing.py", "pscluster/net/frame_server.py", "pscluster/net/frame_loop.py",
                         "pscluster/net/shm.py", "pscluster/net/bulk.py", "server/bulk.py", "worker/frames.py",
                         "socket.py", "selectors.py", "ssl.py")),
    ("grpc", ("grpc/", "grpc_")),
    ("locks+threads", ("threading.py", "queue.py", "concurrent/futures")),
    ("closure runtime", ("worker/runner.py", "pscluster/client/context.py", "pscluster/client/client.py",
                         "pscluster/client/datasets.py", "pscluster/client/variables.py", "pscluster/placement.py")),
    ("dispatch+scheduling", ("coordinator/",)),
    ("worker daemon", ("worker/",)),
    ("metrics+logging", ("prometheus_client", "logging/")),
]


def _cpu_ticks(pid: int) -> int:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _component(stack: str) -> str:
    for frame in reversed(stack.split(";")):
        for name, fragments in COMPONENTS:
            if any(f in frame for f in fragments):
                return name
    return "other (interpreter, numpy outside the model)"


def parse_collapsed(text: str) -> collections.Counter[str]:
    """py-spy's raw (collapsed) output -> samples per component."""
    out: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out[_component(stack)] += int(count)
    return out


class CpuProbe:
    """A training.w2 probe: CPU ticks per process around the timed steps, plus optional py-spy samples."""

    def __init__(self, spy: bool = True, rate: int = 250) -> None:
        self.spy = spy and shutil.which("py-spy") is not None
        self.rate = rate
        self.ticks: dict[str, int] = {}
        self.samples: dict[str, collections.Counter[str]] = {}

    @contextlib.contextmanager
    def __call__(self, cluster: LocalCluster) -> Iterator[None]:
        procs = {"coordinator+driver": os.getpid()}
        procs.update({f"ps{d.index}": d.pid for d in cluster.ps})
        procs.update({f"worker{d.index}": d.pid for d in cluster.workers})
        with tempfile.TemporaryDirectory(prefix="pscluster-profile-") as tmp:
            spies = {}
            if self.spy:
                for name, pid in procs.items():
                    spies[name] = subprocess.Popen(
                        ["py-spy", "record", "--pid", str(pid), "--rate", str(self.rate), "--format", "raw",
                         "--nonblocking", "--gil", "-o", f"{tmp}/{name}.txt"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            before = {name: _cpu_ticks(pid) for name, pid in procs.items()}
            try:
                yield
            finally:
                self.ticks = {name: _cpu_ticks(pid) - before[name] for name, pid in procs.items()}
                for name, spy in spies.items():
                    spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                    try:
                        spy.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        spy.kill()
                        spy.wait()
                    path = pathlib.Path(f"{tmp}/{name}.txt")
                    if path.exists():
                        self.samples[name] = parse_collapsed(path.read_text())
                        if os.environ.get("PSCLUSTER_PROFILE_KEEP"):
                            shutil.copy(path, os.environ["PSCLUSTER_PROFILE_KEEP"] + f"/{name}.txt")


def profile_w2(steps: int = 3000, spy: bool = True) -> dict[str, object]:
    """W2 async (2 PS + 2 workers, 1 step per closure) with a CpuProbe: ms of CPU per step per process."""
    probe = CpuProbe(spy=spy)
    r = training.w2(steps=steps, probe=probe)
    hz = os.sysconf("SC_CLK_TCK")
    per_step = {name: 1000.0 * t / hz / steps for name, t in probe.ticks.items()}
    shares = {name: {c: n / max(1, sum(s.values())) for c, n in s.most_common()}
              for name, s in probe.samples.items()}
    return {"steps_per_s": r["steps_per_s"], "accuracy": r["accuracy"], "cpu_ms_per_step": per_step,
            "total_cpu_ms_per_step": sum(per_step.values()), "components": shares}
