"""deploy/kuberay: every manifest renders, has the fields its kind requires, and every reference in it resolves:
Secrets and ConfigMaps (and the keys read from them), volumes, ports, probe paths (against the gateway's real
routes, reachable without an API key), the image (against deploy/Containerfile and deploy/build-image.sh), and the
`ember serve` command line (against ember's own parser)."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.testclient import TestClient

from ember.cli import build_parser
from ember.gateway.app import create_app
from ember.gateway.auth import Auth
from ember.keys.store import KeyFile, KeyRing
from ember.metrics import Metrics
from ember.testing.service import FakeService

ROOT = Path(__file__).resolve().parents[3]
KUBERAY = ROOT / "deploy" / "kuberay"
CONTAINERFILE = (ROOT / "deploy" / "Containerfile").read_text()
REQUIRED = {   # per kind, the paths every object of it must have
    "RayCluster": ["spec.rayVersion", "spec.headGroupSpec.rayStartParams",
                   "spec.headGroupSpec.template.spec.containers", "spec.workerGroupSpecs"],
    "Service": ["spec.selector", "spec.ports"],
    "ConfigMap": ["data"],
    "Secret": ["stringData"],
    "Kustomization": ["resources"],
}


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), f"{path.name}: a document that is not a mapping"
            out.append((path.name, doc))
    return out


def objects(kind: str | None = None) -> list[dict[str, Any]]:
    return [d for _, d in documents() if kind is None or d["kind"] == kind]


def get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj[part]
    return obj


def pods() -> Iterator[tuple[str, dict[str, Any]]]:
    """(group, pod spec) of every pod template of every RayCluster."""
    for cluster in objects("RayCluster"):
        yield "head", cluster["spec"]["headGroupSpec"]["template"]["spec"]
        for group in cluster["spec"]["workerGroupSpecs"]:
            yield group["groupName"], group["template"]["spec"]


def containers() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for group, pod in pods():
        for container in pod["containers"]:
            yield group, pod, container


def defined(kind: str) -> dict[str, set[str]]:
    """Objects of `kind` by name, with the keys they hold."""
    return {o["metadata"]["name"]: set(o.get("data") or {}) | set(o.get("stringData") or {}) for o in objects(kind)}


def test_every_manifest_has_the_fields_its_kind_requires() -> None:
    for name, doc in documents():
        assert {"apiVersion", "kind"} <= doc.keys(), name
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["name"], name
        for path in REQUIRED.get(doc["kind"], []):
            get(doc, path)   # a KeyError names what is missing
    kinds = {d["kind"] for d in objects()}
    assert {"RayCluster", "Service", "ConfigMap", "Secret", "Kustomization"} <= kinds
    for group, pod in pods():
        for container in pod["containers"]:
            assert {"name", "image"} <= container.keys(), group
    for cluster in objects("RayCluster"):
        for group in cluster["spec"]["workerGroupSpecs"]:
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_kustomization_lists_every_manifest_but_the_example_secrets() -> None:
    (kustomization,) = objects("Kustomization")
    files = {p.name for p in KUBERAY.glob("*.yaml")} - {"kustomization.yaml", "secrets.example.yaml"}
    assert set(kustomization["resources"]) == files
    assert all((KUBERAY / r).is_file() for r in kustomization["resources"])


def test_every_secret_and_configmap_a_pod_reads_is_defined_with_the_key_it_reads() -> None:
    secrets, maps = defined("Secret"), defined("ConfigMap")
    for group, pod, container in containers():
        for env in container.get("env", []):
            ref = env.get("valueFrom", {})
            if "secretKeyRef" in ref:
                name, key = ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]
                assert key in secrets.get(name, set()), f"{group}: Secret {name} has no key {key}"
            if "configMapKeyRef" in ref:
                name, key = ref["configMapKeyRef"]["name"], ref["configMapKeyRef"]["key"]
                assert key in maps.get(name, set()), f"{group}: ConfigMap {name} has no key {key}"
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                assert source["secretRef"]["name"] in secrets, group
            if "configMapRef" in source:
                assert source["configMapRef"]["name"] in maps, group
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, group
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps, group
        assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in pod["volumes"]}, group


def test_no_model_comes_from_a_pods_disk() -> None:
    for group, pod in pods():
        for volume in pod["volumes"]:   # caches and scratch only: nothing persistent, nothing of the host's
            assert volume.keys() & {"emptyDir", "secret"}, f"{group}: volume {volume['name']}"
    for models in [o["data"]["EMBER_MODELS"] for o in objects("ConfigMap") if "EMBER_MODELS" in o["data"]]:
        assert models.split() and all(m.startswith("store:") for m in models.split())
    for _, _, container in containers():
        args = serve_args(container)
        assert "--models" not in args   # only what EMBER_MODELS (the store objects) expands to
        assert "--store-root" not in args


def serve_args(container: dict[str, Any]) -> list[str]:
    """The `ember serve` command line the container execs, the shell's variables left as they are."""
    script = " ".join(container["args"])
    found = re.search(r"exec ember (serve .*?)(?:\n|$)", script.replace("\\\n", " "))
    assert found, "the container execs `ember serve`"
    return [a for a in shlex.split(found.group(1)) if a != "${models[@]}"]


def test_ember_is_the_process_tini_runs_and_its_flags_are_real() -> None:
    entrypoint = re.search(r'^ENTRYPOINT \["([^"]+)"', CONTAINERFILE, re.M)
    assert entrypoint
    (cluster,) = objects("RayCluster")
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for group, _, container in containers():
        assert "lifecycle" not in container, group          # no postStart hook nobody supervises
        assert container["command"][0] == entrypoint.group(1), group
        script = container["args"][0]
        assert '"${KUBERAY_GEN_RAY_START_CMD//--block/}"' in script   # ray start returns; ember is what runs on
        assert script.rstrip().splitlines()[-2].lstrip().startswith("exec ember serve")
        args = build_parser().parse_args(serve_args(container))
        assert args.ray == "auto" and args.auth == "on" and args.host == "0.0.0.0", group
        env = {e["name"]: e for e in container["env"]}
        assert {"EMBER_JOBS_URL", "EMBER_MODELS", "EMBER_TLS_DIR", "POD_IP"} <= env.keys(), group
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert env["EMBER_TLS_DIR"]["value"] in mounts
        assert args.advertise_url.startswith("https://")   # the gateways serve HTTPS with the cluster's certs
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert build_parser().parse_args(serve_args(head)).cpu_slots == 0
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert all(g["minReplicas"] == 0 for g in cluster["spec"]["workerGroupSpecs"])


def test_image_user_and_port_are_the_containerfiles() -> None:
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version
    script = (ROOT / "deploy" / "build-image.sh").read_text()
    assert "IMAGE=${IMAGE:-localhost/ember:$version}" in script   # what the build tags
    (kustomization,) = objects("Kustomization")
    (image,) = kustomization["images"]
    assert image["newTag"] == version.group(1)
    user = re.search(r"^USER (\d+)", CONTAINERFILE, re.M)
    expose = re.search(r"^EXPOSE (\d+)", CONTAINERFILE, re.M)
    assert user and expose
    for group, pod, container in containers():
        assert container["image"] == f"{image['name']}:{version.group(1)}", group
        assert pod["securityContext"]["runAsUser"] == int(user.group(1)) and pod["securityContext"]["runAsNonRoot"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["gateway"] == int(expose.group(1))
        assert build_parser().parse_args(serve_args(container)).port == ports["gateway"]


def test_rayversion_is_the_ray_the_image_is_built_with() -> None:
    try:
        ray = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ray is not installed here: the image's version is unknown")
    (cluster,) = objects("RayCluster")
    assert cluster["spec"]["rayVersion"] == ray


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[TestClient]:
    """ember's real gateway, API keys required."""
    KeyFile(tmp_path / "keys.json").create("ops", "admin")
    with TestClient(create_app(FakeService(), Metrics(), auth=Auth(KeyRing(tmp_path / "keys.json")))) as client:
        yield client


def test_every_probe_is_a_gateway_route_open_without_a_key_on_a_declared_port(gateway: TestClient) -> None:
    probes = 0
    for group, _, container in containers():
        ports = {p["name"] for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert kind in container, f"{group}: no {kind}"
            check = container[kind]["httpGet"]
            assert check["port"] in ports and check["scheme"] == "HTTPS", f"{group} {kind}"
            reply = gateway.get(check["path"])
            assert reply.status_code == 200, f"{group} {kind} {check['path']}: {reply.status_code}"
            probes += 1
        assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert probes == 6
    healthcheck = re.search(r"HEALTHCHECK .*?(/v2/health/\w+)", CONTAINERFILE, re.S)
    assert healthcheck and gateway.get(healthcheck.group(1)).status_code == 200


def test_the_service_reaches_every_gateway_the_heads_and_the_workers() -> None:
    (service,) = objects("Service")
    (cluster,) = objects("RayCluster")
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    for port in service["spec"]["ports"]:
        for group, _, container in containers():
            assert port["targetPort"] in {p["name"] for p in container["ports"]}, group
