"""The `pscluster` command: ps, worker, coordinator, evaluator, up, status, certs, scale."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pscluster.config import Settings, load_settings
from pscluster.errors import ConfigError, PsclusterError, StartupError


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pscluster")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _client(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", help="cluster spec file (YAML, TOML or JSON); else TF_CONFIG")
    p.add_argument("--token-file", help="file holding the shared token (else PSCLUSTER_TOKEN_FILE, then PSCLUSTER_TOKEN)")
    _tls(p)
    p.add_argument("--log-level", default="INFO")


def _tls(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-dir", help="TLS on every channel: a directory written by `pscluster certs`")
    p.add_argument("--require-client-cert", action="store_true", default=None,
                   help="mutual TLS: peers must present a certificate of the CA, checked against their role")


def _common(p: argparse.ArgumentParser) -> None:
    _client(p)
    p.add_argument("--bind-host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on instead of the cluster spec's")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)")
    p.add_argument("--metrics-host", help="address of the metrics port (default 127.0.0.1: it serves without a token)")
    p.add_argument("--exit-with-parent", type=int, metavar="PID", dest="parent_pid",
                   help="stop when process PID (the program that started this daemon) has ended")


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser (also used by tests that check deploy manifests)."""
    parser = argparse.ArgumentParser(prog="pscluster", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pscluster {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    ps = sub.add_parser("ps", help="run a parameter-server daemon")
    _common(ps)
    ps.add_argument("--index", type=int, default=None, help="task index in the cluster's ps list")
    ps.add_argument("--join", action="store_true", help="a PS the cluster file does not list: ask the coordinator "
                    "for a task index (replicas: 2 or `elastic: true`; needs --port; then `pscluster scale --add INDEX`)")
    ps.add_argument("--checkpoint-dir", help="directory for checkpoints (shared by all PS tasks)")
    ps.add_argument("--keep-checkpoints", type=int)
    ps.add_argument("--restore", action="store_true", help="load the newest complete checkpoint at start")
    ps.add_argument("--nan-policy", choices=["reject", "allow"])
    ps.add_argument("--framed-port", type=int, help="port of the raw tensor (bulk) listener (default: any free port)")
    wk = sub.add_parser("worker", help="run a worker daemon")
    _common(wk)
    wk.add_argument("--index", type=int, default=None, help="which address of the cluster's worker list to "
                    "listen on, if any; the worker number is given at registration")
    wk.add_argument("--framed-port", type=int, help="port of the framed closure listener (default: any free port)")
    co = sub.add_parser("coordinator", help="run a coordinator daemon")
    _common(co)
    co.add_argument("--checkpoint-every-steps", type=int, help="automatic checkpoint every N global steps")
    co.add_argument("--checkpoint-every-s", type=float, help="automatic checkpoint every T seconds (default 60)")
    co.add_argument("--no-auto-checkpoint", action="store_true", help="no automatic checkpoints")
    co.add_argument("--logdir", help="write training curves (TensorBoard event files) under DIR/train")
    co.add_argument("--push-pull", action="store_true", default=None,
                    help="async jobs: fused push-pull (a push brings back the values the worker's next pull uses)")
    ev = sub.add_parser("evaluator", help="run a user's eval function on checkpoints or live variables (TF's evaluator)")
    _client(ev)
    ev.add_argument("--eval-fn", required=True, metavar="MODULE:FUNCTION",
                    help="a function taking {variable: numpy array}, returning {metric: number}")
    ev.add_argument("--from", dest="source", choices=["checkpoints", "variables"],
                    help="each new checkpoint (default with --checkpoint-dir) or variables pulled every --every-s")
    ev.add_argument("--every-s", type=float, default=30.0, help="seconds between evaluations (default 30)")
    ev.add_argument("--checkpoint-dir", help="the cluster's checkpoint directory")
    ev.add_argument("--logdir", help="write evaluations (TensorBoard event files) under DIR/eval")
    ev.add_argument("--exit-with-parent", type=int, metavar="PID", dest="parent_pid",
                    help="stop when process PID (the program that started this daemon) has ended")
    up = sub.add_parser("up", help="run a whole cluster on this machine, supervised")
    up.add_argument("--ps", type=int, default=2, help="number of PS tasks")
    up.add_argument("--workers", type=int, default=2, help="number of workers")
    up.add_argument("--base-port", type=int, default=0,
                    help="coordinator on this port, then PS, workers, framed listeners on the next ones "
                         "(2 * (ps + workers) + 1 ports in all; 0: pick free ports)")
    up.add_argument("--checkpoint-dir", help="checkpoint directory, restored from when it holds a checkpoint "
                                             "(default: a temporary one)")
    up.add_argument("--write-cluster", help="write the cluster spec here for clients")
    up.add_argument("--token-file", help="file holding the shared token (else PSCLUSTER_TOKEN_FILE, then PSCLUSTER_TOKEN)")
    _tls(up)
    up.add_argument("--log-level", default="INFO")
    ce = sub.add_parser("certs", help="create a CA and a certificate per task of a cluster file (TLS, mutual TLS)")
    ce.add_argument("--cluster", help="the cluster spec file the certificates are for (its hosts become SANs)")
    ce.add_argument("--ps", type=int, default=0, help="without --cluster: certificates for this many PS tasks")
    ce.add_argument("--out", required=True, help="an empty directory for ca.pem and <task>.pem/.key")
    ce.add_argument("--workers", type=int, default=0, help="certificates for at least this many workers")
    ce.add_argument("--host", action="append", default=[], help="another host name or IP for every certificate")
    ce.add_argument("--days", type=int, default=365, help="validity in days")
    ce.add_argument("--log-level", default="INFO")
    st = sub.add_parser("status", help="show the live cluster")
    _client(st)
    st.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                    help="wait up to SECONDS for every PS and the coordinator to answer")
    sc = sub.add_parser("scale", help="change the active PS tasks of a running replicas: 2 or `elastic: true` "
                        "cluster (docs/elastic.md)")
    _client(sc)
    change = sc.add_mutually_exclusive_group(required=True)
    change.add_argument("--ps", type=int, metavar="N", help="PS tasks 0..N-1 hold the shards; the others are drained")
    change.add_argument("--add", type=int, metavar="TASK", help="a drained PS task takes its share of the shards again")
    change.add_argument("--remove", type=int, metavar="TASK", help="drain one PS task: its shards move to the others")
    return parser


def _scale(args: argparse.Namespace) -> int:
    from pscluster.coordinator.remote import scale
    from pscluster.net import rpc
    from pscluster.proto import pscluster_pb2 as pb
    from pscluster.proto import pscluster_pb2_grpc as pb_grpc

    settings = settings_from_args(args, None)
    if not settings.cluster.coordinator:
        print("pscluster scale: the cluster spec names no coordinator address; scale talks to the coordinator",
              file=sys.stderr)
        return 2
    request = pb.ScaleRequest(count=args.ps) if args.ps is not None else \
        pb.ScaleRequest(add=args.add) if args.add is not None else pb.ScaleRequest(remove=args.remove)
    channel = rpc.open_channel(settings.cluster.coordinator, settings)
    try:
        report = scale(pb_grpc.CoordinatorStub(channel), request)
    except PsclusterError as exc:
        print(f"pscluster scale: {exc}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    freezes = sorted(report.freezes_s)
    worst = f", freeze per moved primary: median {1e3 * freezes[len(freezes) // 2]:.1f} ms, max " \
        f"{1e3 * freezes[-1]:.1f} ms" if freezes else ""
    print(f"active PS tasks: {', '.join(map(str, report.active))}; {report.moved} shard copies moved{worst}")
    for task in report.left:
        print(f"ps {task} left the PS list: stop its process")
    return 0


def settings_from_args(args: argparse.Namespace, task_type: str | None) -> Settings:
    """Settings from parsed flags, merged over file and environment."""
    overrides: dict[str, Any] = {
        "task_type": task_type, "task_index": getattr(args, "index", None),
        "bind_host": getattr(args, "bind_host", None), "port": getattr(args, "port", None), "checkpoint_dir": getattr(args, "checkpoint_dir", None),
        "keep_checkpoints": getattr(args, "keep_checkpoints", None),
        "restore": getattr(args, "restore", None) or None, "nan_policy": getattr(args, "nan_policy", None),
        "token_file": args.token_file, "metrics_port": getattr(args, "metrics_port", None),
        "metrics_host": getattr(args, "metrics_host", None),
        "tls_dir": getattr(args, "tls_dir", None), "require_client_cert": getattr(args, "require_client_cert", None),
        "logdir": getattr(args, "logdir", None), "push_pull": getattr(args, "push_pull", None),
        "framed_port": getattr(args, "framed_port", None), "parent_pid": getattr(args, "parent_pid", None),
        "checkpoint_every_steps": getattr(args, "checkpoint_every_steps", None),
        "checkpoint_every_s": getattr(args, "checkpoint_every_s", None),
        "auto_checkpoint": False if getattr(args, "no_auto_checkpoint", False) else None,
    }
    return load_settings(args.cluster, overrides=overrides)


def _certs(args: argparse.Namespace) -> int:
    import pathlib

    from pscluster.config import read_cluster_file
    from pscluster.ops.certs import hosts_of, task_names, write_certs

    cluster: dict[str, Any] = read_cluster_file(pathlib.Path(args.cluster)) if args.cluster else \
        {"ps": ["127.0.0.1"] * args.ps}  # `pscluster up` on this machine: loopback addresses only
    names = task_names(cluster, args.workers)
    hosts = hosts_of(cluster, args.host)
    write_certs(pathlib.Path(args.out), names, hosts, days=args.days)
    print(f"wrote {args.out}/ca.pem and certificates for {', '.join(names)} (hosts: {', '.join(hosts)}; "
          f"'worker' serves every worker without a worker-<i> of its own, 'ps' every PS that joins); keys are 0600, keep ca.key off the "
          f"task machines")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pscluster` command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format=f"%(asctime)s {args.command} %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "ps":
            from pscluster.server.main import join, serve

            settings = settings_from_args(args, "ps")
            if args.join:
                try:
                    settings = join(settings)
                except PsclusterError as exc:  # refused (replicas: 1) or no coordinator: one line, as scale says it
                    print(f"pscluster ps --join: {exc}", file=sys.stderr)
                    return 2
            serve(settings)
        elif args.command == "worker":
            from pscluster.worker.main import serve as serve_worker

            serve_worker(settings_from_args(args, "worker"))
        elif args.command == "coordinator":
            from pscluster.coordinator.main import serve as serve_coordinator

            serve_coordinator(settings_from_args(args, "coordinator"))
        elif args.command == "up":
            from pscluster.ops.launcher import up_main

            return up_main(args)
        elif args.command == "evaluator":
            from pscluster.ops.evaluator import serve as serve_evaluator

            serve_evaluator(settings_from_args(args, "evaluator"), args.eval_fn, args.source, args.every_s)
        elif args.command == "certs":
            return _certs(args)
        elif args.command == "scale":
            return _scale(args)
        elif args.command == "status":
            from pscluster.ops.status import show, wait_for_file

            if args.cluster and args.wait:
                wait_for_file(args.cluster, args.wait)  # `pscluster up --write-cluster F &` may not have written it yet
            return show(settings_from_args(args, None), wait=args.wait)
    except ConfigError as exc:
        print(f"pscluster {args.command}: {exc}", file=sys.stderr)
        return 2
    except StartupError as exc:
        print(f"pscluster {exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
