"""The `pscluster` command line: --version, flags each command accepts, status tables that never cut."""

import io

import pytest
from pscluster.proto import pscluster_pb2 as pb
from rich.console import Console

from pscluster.ops.cli import build_parser
from pscluster.ops.status import ClusterStatus, render


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip().startswith("pscluster 0.")


@pytest.mark.parametrize("flag", [["--port", "7000"], ["--bind-host", "0.0.0.0"], ["--metrics-port", "0"],
                                  ["--index", "1"]])
def test_status_rejects_flags_that_mean_nothing_to_it(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["status", "--cluster", "c.yaml", *flag])
    assert exit_.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_status_tables_never_cut_an_address_or_a_worker_id():
    worker_id = "a-rather-long-hostname.example.internal-123456-beef"
    address = "10.123.234.245:65001"
    status = ClusterStatus(
        ps=[(address, pb.PsStatus(global_step=3), [])], ps_problems=[""],
        coordinator=pb.CoordinatorStatus(workers=[pb.WorkerState(worker_id=worker_id, address=address,
                                                                 state="alive")]))
    out = io.StringIO()
    render(status, Console(file=out, width=40))
    assert worker_id in out.getvalue() and out.getvalue().count(address) == 2


def test_status_when_no_task_answers_is_one_line_per_problem():
    status = ClusterStatus(ps=[("127.0.0.1:7001", None, []), ("127.0.0.1:7002", None, [])],
                           ps_problems=["unreachable", "unreachable"], coordinator_error="unreachable",
                           coordinator_address="127.0.0.1:7000")
    out = io.StringIO()
    render(status, Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert "no task answered" in lines[0] and "127.0.0.1:7000" in lines[0] and "127.0.0.1:7002" in lines[0]


def test_status_with_the_wrong_token_names_the_problem_once():
    problem = "unauthenticated: wrong or missing token (--token-file, PSCLUSTER_TOKEN_FILE or PSCLUSTER_TOKEN)"
    status = ClusterStatus(ps=[("127.0.0.1:7001", None, []), ("127.0.0.1:7002", None, [])],
                           ps_problems=[problem, problem], coordinator_error=problem,
                           coordinator_address="127.0.0.1:7000")
    out = io.StringIO()
    render(status, Console(file=out, width=80))
    assert out.getvalue().count("unauthenticated") == 1


def test_status_marks_a_ps_that_joined_the_list():
    status = ClusterStatus(ps=[(f"127.0.0.1:700{i}", pb.PsStatus(num_shards=i), []) for i in range(3)],
                           ps_problems=["", "", ""], listed=2)
    out = io.StringIO()
    render(status, Console(file=out, width=120))
    rows = [line for line in out.getvalue().splitlines() if "127.0.0.1:700" in line]
    assert len(rows) == 3 and "joined" in rows[2] and not any("joined" in r for r in rows[:2])


def test_status_shows_each_copys_role_from_the_replica_table():
    def info(shard):
        return pb.ShardInfo(spec=pb.ShardSpec(variable="w", shard_index=shard, num_shards=2, shape=[1]), version=1)

    status = ClusterStatus(ps=[("127.0.0.1:7000", pb.PsStatus(), [info(0), info(1)]),
                               ("127.0.0.1:7001", pb.PsStatus(), [info(0), info(1)])], ps_problems=["", ""],
                           roles={("w", 0): (0, 1), ("w", 1): (0, 0)})  # shard 1's copy on ps 1: deposed
    out = io.StringIO()
    render(status, Console(file=out, width=160))
    table = out.getvalue().split("variables")[1]
    assert "role" in table
    rows = [line.split("│")[1:5] for line in table.splitlines() if " w " in line]
    assert [[c.strip() for c in r] for r in rows] == [["w", "1/2", "0", "P"], ["w", "2/2", "0", "P"],
                                                      ["w", "1/2", "1", "B"], ["w", "2/2", "1", "-"]]
    status.roles = None  # replicas: 1 without the table: every copy is the only one
    out = io.StringIO()
    render(status, Console(file=out, width=160))
    assert [line.split("│")[4].strip() for line in out.getvalue().split("variables")[1].splitlines()
            if " w " in line] == ["P"] * 4
