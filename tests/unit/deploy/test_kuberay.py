"""deploy/kuberay: a RayCluster whose head holds no work and whose workers scale to zero and run ember's real
CLI, and a Service in front of the workers' gateways (parsed, not applied: no cluster in CI)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from ember.cli import build_parser

MANIFEST = Path(__file__).resolve().parents[3] / "deploy" / "kuberay" / "ember-raycluster.yaml"
RAY_FLAG = {"--ray", "auto"}   # added by the cluster package (ember/cluster); not checked against the parser here


def _docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


def _worker() -> dict[str, Any]:
    (group,) = _docs()["RayCluster"]["spec"]["workerGroupSpecs"]
    return dict(group)


def _ember_argv(container: dict[str, Any]) -> list[str]:
    script = " ".join(container["args"])
    words = shlex.split(script.split("exec ember ", 1)[1].split(";")[0])
    return words


def test_the_head_takes_no_work_and_hosts_the_controller_resource() -> None:
    cluster = _docs()["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "ember_controller" in head["rayStartParams"]["resources"]
    (container,) = head["template"]["spec"]["containers"]
    assert "$KUBERAY_GEN_RAY_START_CMD" in " ".join(container["args"])


def test_workers_scale_to_zero_and_run_ember_serve_with_real_flags() -> None:
    worker = _worker()
    assert worker["minReplicas"] == 0 and worker["replicas"] == 0 and worker["maxReplicas"] >= 1
    assert _docs()["RayCluster"]["spec"]["enableInTreeAutoscaling"] is True
    (container,) = worker["template"]["spec"]["containers"]
    argv = _ember_argv(container)
    assert argv[0] == "serve" and "--ray" in argv
    known, unknown = build_parser().parse_known_args(argv)
    assert set(unknown) <= RAY_FLAG, unknown
    assert known.port == 8000 and known.host == "0.0.0.0"
    assert {"name": "http", "containerPort": known.port} in container["ports"]
    env = {e["name"]: e for e in container["env"]}
    assert env["EMBER_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "token"


def test_the_service_selects_the_worker_gateways_on_port_8000() -> None:
    service = _docs()["Service"]
    labels = _worker()["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert selector.items() <= labels.items()
    head_labels = _docs()["RayCluster"]["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= head_labels.items()   # the head serves no requests
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8000 and port["targetPort"] == "http"
