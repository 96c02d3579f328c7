"""`pscluster status`: the live cluster as tables: PS tasks and their shards, workers, the queue."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from pscluster.config import Settings
from pscluster.errors import PsclusterError, UnauthenticatedError
from pscluster.net import rpc
from pscluster.proto import pscluster_pb2 as pb
from pscluster.proto import pscluster_pb2_grpc as pb_grpc


@dataclass
class ClusterStatus:
    """What `status` found; a None status did not answer, and its problem says why."""

    ps: list[tuple[str, pb.PsStatus | None, list[pb.ShardInfo]]] = field(default_factory=list)
    ps_problems: list[str] = field(default_factory=list)
    coordinator: pb.CoordinatorStatus | None = None
    coordinator_error: str = ""
    coordinator_address: str = ""
    listed: int | None = None  # PS tasks the cluster file lists; the others joined (docs/elastic.md)
    # the newest replica table the PS tasks hold: (variable, shard) -> (primary, backup); None without one
    roles: dict[tuple[str, int], tuple[int, int]] | None = None

    def role(self, variable: str, shard: int, ps: int) -> str:
        """A copy's role: P (primary), B (backup), or '-' (a copy the replica table gives other PS tasks: a
        deposed or restored one, dropped at its next roles update); one copy without a table is P."""
        if self.roles is None:
            return "P"
        primary, backup = self.roles.get((variable, shard), (-1, -1))
        return "P" if primary == ps else "B" if backup == ps else "-"

    def answered(self) -> tuple[int, int]:
        """(tasks that answered, tasks asked)."""
        asked = len(self.ps) + bool(self.coordinator_address)
        return sum(st is not None for _, st, _ in self.ps) + (self.coordinator is not None), asked

    def complete(self, settings: Settings) -> bool:
        """True when every PS and the coordinator (if the spec names one) answered."""
        return all(st is not None for _, st, _ in self.ps) and \
            (self.coordinator is not None or not settings.cluster.coordinator)


def _problem(err: PsclusterError) -> str:
    if isinstance(err, UnauthenticatedError):
        return "unauthenticated: wrong or missing token (--token-file, PSCLUSTER_TOKEN_FILE or PSCLUSTER_TOKEN)"
    return "unreachable"


def gather(settings: Settings, timeout: float = 3.0) -> ClusterStatus:
    """Ask every PS task and the coordinator (if the spec names one) for their state."""
    out = ClusterStatus(listed=len(settings.cluster.ps))
    addresses, out.roles = _ps_list(settings, timeout)
    for address in addresses:
        channel = rpc.open_channel(address, settings)
        stub = pb_grpc.ParameterServerStub(channel)
        try:
            status = rpc.call(stub.Status, pb.PsStatusRequest(), timeout=timeout)
            shards = list(rpc.call(stub.ListShards, pb.ListShardsRequest(), timeout=timeout).shards)
            out.ps.append((address, status, shards))
            out.ps_problems.append("")
        except PsclusterError as exc:
            out.ps.append((address, None, []))
            out.ps_problems.append(_problem(exc))
        finally:
            channel.close()
    if settings.cluster.coordinator:
        out.coordinator_address = settings.cluster.coordinator
        channel = rpc.open_channel(settings.cluster.coordinator, settings)
        try:
            out.coordinator = rpc.call(pb_grpc.CoordinatorStub(channel).Status, pb.CoordinatorStatusRequest(),
                                       timeout=timeout)
        except PsclusterError as exc:
            out.coordinator_error = _problem(exc)
        finally:
            channel.close()
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def _print(console: Console, table: Table) -> None:
    """Print table as wide as its content needs, whatever the terminal: never cut an address or an id."""
    need = Measurement.get(console, console.options.update(max_width=1 << 16), table).maximum
    console.width = max(console.width, need)
    console.print(table)


def _render_silence(status: ClusterStatus, console: Console) -> None:
    """Nothing answered: one line per distinct problem instead of empty tables."""
    tasks: dict[str, list[str]] = {}
    for i, (address, _, _) in enumerate(status.ps):
        problem = status.ps_problems[i] if i < len(status.ps_problems) else "unreachable"
        tasks.setdefault(problem, []).append(f"ps {i} {address}")
    if status.coordinator_address:
        tasks.setdefault(status.coordinator_error or "unreachable", []).append(
            f"coordinator {status.coordinator_address}")
    for problem, names in tasks.items():
        hint = " (is the cluster running? see `pscluster up`)" if problem == "unreachable" else ""
        console.print(f"[red]no task answered[/red]: {problem}{hint}: {', '.join(names)}", soft_wrap=True)


def _ps_list(settings: Settings, timeout: float) -> tuple[list[str], dict[tuple[str, int], tuple[int, int]] | None]:
    """The coordinator's PS list, which PS tasks that joined extend (replicas: 2: it rides the replica table
    every PS holds), the cluster file's when no PS has a newer one; and the newest replica table (None: the
    cluster has none)."""
    newest, epoch = list(settings.cluster.ps), 0
    if not settings.replica_table:
        return newest, None
    roles: pb.SetRolesRequest | None = None
    for address in settings.cluster.ps:
        channel = rpc.open_channel(address, settings)
        try:
            table = rpc.call(pb_grpc.ParameterServerStub(channel).GetRoles, pb.GetRolesRequest(), timeout=timeout)
        except PsclusterError:
            continue  # the PS rows below say why
        finally:
            channel.close()
        if table.ps_epoch > epoch and table.ps_addresses:
            newest, epoch = list(table.ps_addresses), table.ps_epoch
        if roles is None or table.version > roles.version:
            roles = table
    return newest, {} if roles is None else {(r.ref.variable, r.ref.shard_index): (r.primary, r.backup)
                                             for r in roles.roles}


def render(status: ClusterStatus, console: Console) -> None:
    """Print the tables (or one line per problem when no task answered)."""
    if status.answered()[0] == 0:
        _render_silence(status, console)
        return
    ps_table = Table(title="parameter servers")
    for col in ("ps", "address", "state", "global step", "restored step", "shards", "held", "stale dropped"):
        ps_table.add_column(col)
    var_table = Table(title="variables")
    for col in ("variable", "shard", "ps", "role", "shape", "dtype", "optimizer", "version"):
        var_table.add_column(col)
    for i, (address, st, shards) in enumerate(status.ps):
        if st is None:
            problem = status.ps_problems[i] if i < len(status.ps_problems) else "unreachable"
            ps_table.add_row(str(i), address, f"[red]{problem}", "", "", "", "", "")
            continue
        joined = status.listed is not None and i >= status.listed
        ps_table.add_row(str(i), address, "[green]up" + (" (joined)" if joined else ""), str(st.global_step),
                         str(st.restored_step) if st.restored_step >= 0 else "-", str(st.num_shards),
                         _mib(st.total_bytes), str(st.dropped_stale))
        for info in shards:
            s = info.spec
            var_table.add_row(s.variable, f"{s.shard_index + 1}/{s.num_shards}", str(i),
                              status.role(s.variable, s.shard_index, i), str(tuple(s.shape)),
                              s.dtype, s.optimizer.kind + (" sparse" if s.sparse else ""), str(info.version))
    _print(console, ps_table)
    _print(console, var_table)
    if status.coordinator is not None:
        c = status.coordinator
        console.print(f"coordinator: {c.queued} queued, {c.running} running, {c.done} done, {c.retried} retried, "
                      f"{c.failed} failed, {c.lost_updates} updates lost to PS restarts", soft_wrap=True)
        workers = Table(title="workers")
        for col in ("worker", "address", "state", "closures done", "steps/s (10 s)"):
            workers.add_column(col)
        for w in sorted(c.workers, key=lambda w: w.address):
            workers.add_row(w.worker_id, w.address, w.state, str(w.closures_done), f"{w.steps_per_s:.1f}")
        _print(console, workers)
        jobs = Table(title="jobs")
        for col in ("job", "state", "queued", "running", "done", "failed", "idle s"):
            jobs.add_column(col)
        for j in c.jobs:
            state = f"ended: {j.ended}" if j.ended else "live"
            jobs.add_row(j.job, state, str(j.queued), str(j.running), str(j.done), str(j.failed),
                         f"{j.idle_s:.1f}" if not j.ended else "-")
        _print(console, jobs)
    elif status.coordinator_error:
        console.print(f"[yellow]coordinator {status.coordinator_error}", soft_wrap=True)


def show(settings: Settings, console: Console | None = None, wait: float = 0.0,
         clock: Callable[[], float] = time.monotonic) -> int:
    """Gather (for up to `wait` s until every task answers) and print; exit code 1 when a PS did not answer."""
    deadline = clock() + wait
    status = gather(settings)
    while not status.complete(settings) and clock() < deadline:
        time.sleep(min(0.2, max(0.0, deadline - clock())))
        status = gather(settings)
    console = console or Console()
    render(status, console)
    answered, asked = status.answered()
    if wait > 0 and answered < asked:
        console.print(f"[yellow]--wait {wait:g} s ran out: {answered} of {asked} tasks answered", soft_wrap=True)
    return 0 if all(st is not None for _, st, _ in status.ps) else 1


def wait_for_file(path: str, seconds: float) -> None:
    """Return once path exists, or after seconds (the caller then reports the missing file as usual)."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
