"""deploy/kuberay: the RayCluster and the gateways' Service say what docs/cluster.md says they do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KUBERAY = Path(__file__).resolve().parents[3] / "deploy" / "kuberay"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((KUBERAY / name).read_text())
    return data


def test_the_head_runs_no_work_and_the_worker_group_scales_to_zero() -> None:
    spec = load("raycluster.yaml")["spec"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (group,) = spec["workerGroupSpecs"]
    assert group["minReplicas"] == 0 and group["maxReplicas"] >= group["replicas"]
    (worker,) = group["template"]["spec"]["containers"]
    start = " ".join(worker["lifecycle"]["postStart"]["exec"]["command"])
    assert "ember serve --ray auto" in start and "--host 0.0.0.0" in start and "--auth on" in start
    assert {"name": "gateway", "containerPort": 8000} in worker["ports"]


def test_the_head_runs_a_gateway_only_so_a_worker_group_at_zero_still_takes_requests() -> None:
    head = load("raycluster.yaml")["spec"]["headGroupSpec"]["template"]["spec"]
    (container,) = head["containers"]
    start = " ".join(container["lifecycle"]["postStart"]["exec"]["command"])
    assert "ember serve --ray auto --cpu-slots 0" in start and "--models /models" in start
    assert {"name": "gateway", "containerPort": 8000} in container["ports"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert {v["name"] for v in head["volumes"]} == {m["name"] for m in container["volumeMounts"]}


def test_the_service_reaches_every_gateway_the_heads_and_the_workers() -> None:
    service = load("ember-gateway.yaml")
    assert service["spec"]["selector"] == {"ray.io/cluster": load("raycluster.yaml")["metadata"]["name"]}
    assert service["spec"]["ports"][0]["targetPort"] == "gateway"
