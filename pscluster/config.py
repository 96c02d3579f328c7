"""Configuration: frozen pydantic models, and the one loader that reads files and the environment.

Precedence (later wins): cluster file (YAML, TOML or JSON) -> `TF_CONFIG` -> `PSCLUSTER_*`
environment variables -> explicit overrides (CLI flags). Nothing else in pscluster reads os.environ.

    settings = load_settings(cluster_file="cluster.yaml", overrides={"task_type": "ps", "task_index": 0})
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import logging
import os
import pathlib
import tomllib
from collections.abc import Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from pscluster.errors import ConfigError

log = logging.getLogger(__name__)
_WARNED_OPEN_TOKEN_FILES: set[str] = set()  # one warning per file and process, not per load

MiB = 1 << 20


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_address(addr: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {addr!r} is not host:port with a port in 1..65535")
    return addr


class ClusterSpec(_Frozen):
    """Addresses of the cluster's tasks, as TF's ClusterSpec (`chief` is the coordinator)."""

    ps: list[str] = Field(min_length=1)
    worker: list[str] = Field(default_factory=list)
    coordinator: str | None = None

    @field_validator("ps", "worker")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for addr in value:
            _check_address(addr)
        if len(set(value)) != len(value):
            raise ValueError(f"duplicate addresses in {value}")
        return value

    @field_validator("coordinator")
    @classmethod
    def _coordinator(cls, value: str | None) -> str | None:
        return None if value is None else _check_address(value)


TaskType = Literal["ps", "worker", "coordinator", "evaluator"]


class Settings(_Frozen):
    """Everything a daemon or a client needs; validated once at start."""

    cluster: ClusterSpec
    task_type: TaskType | None = None
    task_index: int = Field(default=0, ge=0)
    token: SecretStr | None = None
    # TLS (pscluster/net/tls.py): a directory from `pscluster certs`, or the three files; with
    # require_client_cert every daemon also checks its peers' certificates and roles (mutual TLS)
    tls_dir: pathlib.Path | None = None
    tls_ca_file: pathlib.Path | None = None
    tls_cert_file: pathlib.Path | None = None
    tls_key_file: pathlib.Path | None = None
    require_client_cert: bool = False
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None  # host others use to reach this task (default: bind_host)
    port: int | None = Field(default=None, ge=0, lt=65536)  # overrides the port of the cluster address
    max_message_bytes: int = Field(default=64 * MiB, ge=MiB, le=2047 * MiB)
    chunk_bytes: int = Field(default=4 * MiB, ge=64 * 1024)
    stream_threshold_bytes: int = Field(default=16 * MiB, ge=0)
    checkpoint_dir: pathlib.Path | None = None
    keep_checkpoints: int = Field(default=3, ge=1)
    # coordinator: automatic checkpoints every N global steps and/or T seconds (None: that trigger off);
    # on by default, active whenever the PS tasks have a checkpoint directory
    auto_checkpoint: bool = True
    checkpoint_every_steps: int | None = Field(default=None, ge=1)
    checkpoint_every_s: float | None = Field(default=60.0, gt=0)
    restore: bool = False
    # training curves and evaluations as TensorBoard event files under logdir (coordinator: logdir/train,
    # evaluator: logdir/eval); closures' pscluster.report(...) scalars are averaged per curve_interval_s
    logdir: pathlib.Path | None = None
    curve_interval_s: float = Field(default=5.0, gt=0)
    nan_policy: Literal["reject", "allow"] = "reject"
    rpc_timeout_s: float = Field(default=60.0, gt=0)
    # framed sockets (PS bulk port, worker closure port, their clients): a send or receive that makes no
    # progress for this long closes the connection; the client side sees a retryable UnavailableError
    socket_timeout_s: float = Field(default=30.0, gt=0)
    # framed ports' admission (pscluster/net/admission.py, SECURITY.md): a peer has auth_timeout_s to send its
    # token; an authenticated connection idle for idle_timeout_s is closed (clients reconnect)
    auth_timeout_s: float = Field(default=10.0, gt=0)
    idle_timeout_s: float = Field(default=600.0, gt=0)
    max_connections: int = Field(default=128, ge=4, le=4096)  # per framed port
    max_connections_per_peer: int = Field(default=64, ge=1, le=4096)
    max_unauthenticated: int = Field(default=16, ge=1, le=1024)  # connections still authenticating, per port
    # the largest tensor (a shard, a pushed gradient, a pull reply) a daemon accepts: bigger ones are refused
    # with a precise error before anything is allocated
    max_tensor_bytes: int = Field(default=4 * 1024 * MiB, ge=MiB)
    # copies of every shard (docs/ps_failures.md): 2 gives each shard a backup on another PS that holds every
    # acknowledged update (a PS killed loses none); 1 (one copy, checkpoint restore) is the default
    replicas: int = Field(default=1, ge=1, le=2)
    # replicas: 1 with the replica table (docs/elastic.md): clients route by it, so shards can move between
    # PS tasks (scale, add, drain); replicas: 2 always has the table
    elastic: bool = False
    replication_timeout_s: float = Field(default=5.0, gt=0)  # a backup's confirmation, per push (replicas: 2)
    heartbeat_interval_s: float = Field(default=0.5, gt=0)
    heartbeat_timeout_s: float = Field(default=2.0, gt=0)
    server_threads: int = Field(default=16, ge=2, le=256)
    dedup_window: int = Field(default=1_000_000, ge=1000)
    metrics_port: int | None = Field(default=None, ge=0, lt=65536)  # serve Prometheus metrics (0: any port)
    metrics_host: str = "127.0.0.1"  # the metrics port serves without a token: loopback unless told otherwise
    bulk_transport: bool = True  # pull/push tensors over the PS's raw TCP port; False: gRPC only
    # same-host bulk connections (no TLS) carry payloads through shared memory (pscluster/net/shm.py)
    shared_memory: bool = True
    # async jobs (coordinator): fused push-pull, ps-lite's PushPull. A closure's push brings back the pushed
    # variables' new values, and the worker's next pull of exactly those variables, if within
    # push_pull_max_age_s (a worker setting), uses them instead of another round trip (pscluster/client/fresh.py)
    push_pull: bool = False
    push_pull_max_age_s: float = Field(default=0.5, gt=0)
    max_inflight_per_worker: int = Field(default=2, ge=1, le=64)
    no_worker_timeout_s: float | None = Field(default=300.0, gt=0)
    drain_timeout_s: float = Field(default=10.0, ge=0)
    result_retention_s: float = Field(default=600.0, gt=0)  # daemon: keep an unfetched remote result this long
    job_idle_timeout_s: float = Field(default=30.0, gt=0)  # daemon: end a client's job after this long without a keepalive
    # -- daemon start-up and fixed ports (issue 11) ------------------------------------------------
    startup_timeout_s: float = Field(default=300.0, gt=0)  # how long a daemon waits for what it needs
    framed_port: int | None = Field(default=None, ge=0, lt=65536)  # PS bulk / worker closure port (None: any)
    # a daemon started by a program (LocalCluster, `pscluster up`) stops when that program dies, even by
    # SIGKILL, instead of running on as an orphan that holds ports and checkpoints
    parent_pid: int | None = Field(default=None, ge=1)

    @field_validator("bind_host", "metrics_host")
    @classmethod
    def _host(cls, value: str) -> str:
        if value in ("localhost", "0.0.0.0", "::"):
            return value
        try:
            ipaddress.ip_address(value)
        except ValueError as exc:
            raise ValueError(f"bind_host {value!r} is not an IP address") from exc
        return value

    @field_validator("token")
    @classmethod
    def _token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("the token is empty, which would turn authentication off; set a real token or none")
        return value

    @model_validator(mode="after")
    def _secure(self) -> Settings:
        if self.task_type is not None:
            count = {"ps": len(self.cluster.ps), "worker": len(self.cluster.worker) or 1 << 30,
                     "coordinator": 1, "evaluator": 1}[self.task_type]
            if self.task_index >= count:
                raise ValueError(f"task_index {self.task_index} is out of range for {count} {self.task_type} task(s)")
        if not is_loopback(self.bind_host) and self.token is None and not self.uses_tls:
            raise ValueError(
                f"bind_host {self.bind_host!r} listens beyond loopback with neither a token nor TLS; "
                "set PSCLUSTER_TOKEN or --token-file, and/or --tls-dir")
        if self.require_client_cert and not self.uses_tls:
            raise ValueError("require_client_cert needs TLS: set tls_dir (pscluster certs) or the tls_*_file settings")
        if self.replicas > 1 and len(self.cluster.ps) < self.replicas:
            raise ValueError(f"replicas={self.replicas} needs at least {self.replicas} PS tasks; the cluster lists "
                             f"{len(self.cluster.ps)}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        return self

    def own_address(self) -> str:
        """This task's address in the cluster spec."""
        if self.task_type == "ps":
            return self.cluster.ps[self.task_index]
        if self.task_type == "coordinator" and self.cluster.coordinator:
            return self.cluster.coordinator
        if self.task_type == "worker" and self.task_index < len(self.cluster.worker):
            return self.cluster.worker[self.task_index]
        return f"{self.bind_host}:0"

    def listen_address(self) -> str:
        """host:port to bind: bind_host, and the port of own_address unless `port` overrides it."""
        port = self.port if self.port is not None else int(self.own_address().rpartition(":")[2])
        return f"{self.bind_host}:{port}"

    @property
    def replica_table(self) -> bool:
        """Whether the coordinator keeps a replica table and clients route by it (replicas: 2, or elastic)."""
        return self.replicas > 1 or self.elastic

    @property
    def uses_tls(self) -> bool:
        """True when TLS files are configured."""
        return self.tls_dir is not None or self.tls_ca_file is not None

    def token_value(self) -> str | None:
        """The shared token in clear, or None."""
        return self.token.get_secret_value() if self.token else None


def is_loopback(host: str) -> bool:
    """True when host names only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_file(path: pathlib.Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read cluster file {path}: {exc.strerror}") from exc
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"cluster file {path} is not valid {path.suffix.lstrip('.').upper() or 'YAML'}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {path} must hold a mapping, got {type(data).__name__}")
    # A bare cluster spec (ps:/worker:) or full settings (cluster: plus settings fields).
    return data if "cluster" in data else {"cluster": data}


def read_cluster_file(path: pathlib.Path) -> dict[str, Any]:
    """The cluster spec (ps/worker/coordinator addresses) of a cluster file.

    Raises:
        ConfigError: unreadable or malformed file.
    """
    cluster = _read_file(path)["cluster"]
    if not isinstance(cluster, dict):
        raise ConfigError(f"cluster file {path}: `cluster` must be a mapping of roles to addresses")
    return cluster


TF_JOBS = frozenset({"chief", "coordinator", "ps", "worker", "evaluator"})


def _check_tf_jobs(cluster: Mapping[str, Any]) -> None:
    """Refuse what TF refuses: a job name TF does not know, more than one chief."""
    unknown = sorted(set(cluster) - TF_JOBS)
    if unknown:
        raise ConfigError(f"TF_CONFIG.cluster has unknown job(s) {unknown}; known jobs: {sorted(TF_JOBS)}")
    for job in ("chief", "coordinator", "evaluator"):
        tasks = cluster.get(job)
        if isinstance(tasks, list) and len(tasks) > 1:
            raise ConfigError(f"TF_CONFIG.cluster.{job} lists {len(tasks)} tasks {tasks}; at most one is allowed")


def _from_tf_config(raw: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"TF_CONFIG is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError("TF_CONFIG must be a JSON object with 'cluster' and 'task'")
    out: dict[str, Any] = {}
    cluster = data.get("cluster")
    if cluster is not None:
        if not isinstance(cluster, dict):
            raise ConfigError("TF_CONFIG.cluster must be an object")
        _check_tf_jobs(cluster)
        spec: dict[str, Any] = {k: v for k, v in cluster.items() if k in ("ps", "worker")}
        chief = cluster.get("chief") or cluster.get("coordinator")
        if chief:
            spec["coordinator"] = chief[0] if isinstance(chief, list) else chief
        out["cluster"] = spec
    task = data.get("task")
    if isinstance(task, dict):
        kind = task.get("type")
        if kind is not None and kind not in TF_JOBS:
            raise ConfigError(f"TF_CONFIG.task.type {kind!r} is not one of {sorted(TF_JOBS)}")
        out["task_type"] = "coordinator" if kind == "chief" else kind
        out["task_index"] = task.get("index", 0)
    return out


_ENV_FIELDS = {
    "PSCLUSTER_BIND_HOST": "bind_host",
    "PSCLUSTER_ADVERTISE_HOST": "advertise_host",
    "PSCLUSTER_METRICS_PORT": "metrics_port",
    "PSCLUSTER_METRICS_HOST": "metrics_host",
    "PSCLUSTER_LOGDIR": "logdir",
    "PSCLUSTER_PUSH_PULL": "push_pull",
    "PSCLUSTER_SHARED_MEMORY": "shared_memory",
    "PSCLUSTER_PUSH_PULL_MAX_AGE_S": "push_pull_max_age_s",
    "PSCLUSTER_TLS_DIR": "tls_dir",
    "PSCLUSTER_TLS_CA_FILE": "tls_ca_file",
    "PSCLUSTER_TLS_CERT_FILE": "tls_cert_file",
    "PSCLUSTER_TLS_KEY_FILE": "tls_key_file",
    "PSCLUSTER_REQUIRE_CLIENT_CERT": "require_client_cert",
    "PSCLUSTER_AUTH_TIMEOUT_S": "auth_timeout_s",
    "PSCLUSTER_IDLE_TIMEOUT_S": "idle_timeout_s",
    "PSCLUSTER_MAX_TENSOR_BYTES": "max_tensor_bytes",
    "PSCLUSTER_TASK_INDEX": "task_index",
    "PSCLUSTER_CHECKPOINT_DIR": "checkpoint_dir",
    "PSCLUSTER_AUTO_CHECKPOINT": "auto_checkpoint",
    "PSCLUSTER_CHECKPOINT_EVERY_STEPS": "checkpoint_every_steps",
    "PSCLUSTER_CHECKPOINT_EVERY_S": "checkpoint_every_s",
    "PSCLUSTER_MAX_MESSAGE_BYTES": "max_message_bytes",
    "PSCLUSTER_NAN_POLICY": "nan_policy",
    "PSCLUSTER_HEARTBEAT_INTERVAL_S": "heartbeat_interval_s",
    "PSCLUSTER_HEARTBEAT_TIMEOUT_S": "heartbeat_timeout_s",
    "PSCLUSTER_STARTUP_TIMEOUT_S": "startup_timeout_s",
    "PSCLUSTER_SOCKET_TIMEOUT_S": "socket_timeout_s",
    "PSCLUSTER_JOB_IDLE_TIMEOUT_S": "job_idle_timeout_s",
}


def load_token(token_file: str | pathlib.Path | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The shared token: token_file, else PSCLUSTER_TOKEN_FILE, else PSCLUSTER_TOKEN; None if none is set.

    Raises:
        ConfigError: the token file cannot be read.
    """
    env = os.environ if env is None else env
    token_file = token_file or env.get("PSCLUSTER_TOKEN_FILE")
    if token_file:
        try:
            token = pathlib.Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"token_file {token_file}: {exc.strerror}") from exc
        if not token:
            # an empty token would turn authentication off, silently, on a cluster meant to have it
            raise ConfigError(f"token_file {token_file} is empty; write the token into it "
                              "(python -c \"import secrets; print(secrets.token_hex(16))\" > FILE)")
        _warn_if_others_can_read(str(token_file))
        return token
    from_env = env.get("PSCLUSTER_TOKEN")
    if from_env is not None and not from_env.strip():
        raise ConfigError("PSCLUSTER_TOKEN is set but empty; set it to the cluster's token or unset it")
    return from_env.strip() if from_env is not None else None


def _warn_if_others_can_read(path: str) -> None:
    """A token others on the host can read lets them act as any role: say so (as ssh does for keys)."""
    try:
        mode = os.stat(path).st_mode & 0o777
    except OSError:
        return
    if mode & 0o077 and path not in _WARNED_OPEN_TOKEN_FILES:
        _WARNED_OPEN_TOKEN_FILES.add(path)
        log.warning("token_file %s can be read by other users (mode %03o); chmod 600 %s", path, mode, path)


def load_settings(cluster_file: str | pathlib.Path | None = None,
                  env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """Merge cluster file, TF_CONFIG, PSCLUSTER_* and overrides into validated Settings.

    Raises:
        ConfigError: naming the offending field and value.
    """
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    if cluster_file is not None:
        merged.update(_read_file(pathlib.Path(cluster_file)))
    if env.get("TF_CONFIG"):
        tf = _from_tf_config(env["TF_CONFIG"])
        if cluster_file is not None:
            tf.pop("cluster", None)  # an explicit cluster file wins over the environment's spec
        merged.update(tf)
    for var, field in _ENV_FIELDS.items():
        if var in env:
            merged[field] = env[var]
    token = load_token((overrides or {}).get("token_file"), env)
    if token is not None:
        merged["token"] = token
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None and k != "token_file"})
    if "cluster" not in merged:
        raise ConfigError("no cluster spec: pass --cluster FILE or set TF_CONFIG")
    return validate(merged)


def validate(data: Mapping[str, Any]) -> Settings:
    """Settings from a mapping; ConfigError names each bad field and echoes its value."""
    try:
        return Settings.model_validate(dict(data))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "settings"
            value = err.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            loc = err["loc"]
            if loc == ("replicas",) and err["type"] in ("less_than_equal", "greater_than_equal"):
                problems.append(f"replicas: {value!r}: only 1 or 2 copies are supported")
                continue
            if err["type"] == "extra_forbidden" and len(loc) == 2 and loc[0] == "cluster" and \
                    loc[1] in Settings.model_fields:
                # a setting written beside the addresses of a bare cluster file
                shown += (f": `{loc[1]}` is a setting; a cluster file with settings puts the addresses under a "
                          f"top-level `cluster:` key and the settings beside it")
            elif err["type"] == "extra_forbidden" and loc:
                known = ClusterSpec.model_fields if loc[0] == "cluster" and len(loc) == 2 else \
                    Settings.model_fields if len(loc) == 1 else {}
                close = difflib.get_close_matches(str(loc[-1]), list(known), n=1)
                shown += f": did you mean {close[0]!r}?" if close else ""
            problems.append(f"{field}: {err['msg']}{shown}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from exc
