"""The rings' one-way imports, checked in a fresh interpreter (other tests import everything)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ember
from ember.testing.controller import write


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(m for m in sys.modules if m.startswith('ember')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_contract_module_loads_no_weight_store() -> None:
    loaded = _loaded_after("ember.wire.contract")
    assert not {m for m in loaded if m.startswith("ember.store")}


@pytest.mark.parametrize("module", ["ember.serving.controller", "ember.jobs.store", "ember.serving.jobs"])
def test_serving_and_the_job_store_never_import_the_gateway(module: str) -> None:
    loaded = _loaded_after(module)
    assert not {m for m in loaded if m.startswith("ember.gateway")}


@pytest.mark.parametrize("module", ["ember.core.scheduler", "ember.core.autoscaler", "ember.core.batching",
                                    "ember.core.access", "ember.core.ratelimit", "ember.core.placement",
                                    "ember.core.lifecycle", "ember.core.warm_pool"])
def test_the_core_imports_nothing_outside_itself(module: str) -> None:
    loaded = _loaded_after(module)
    outside = {m for m in loaded if m not in ("ember", "ember.errors") and not m.startswith("ember.core")}
    assert not outside


@pytest.mark.parametrize("module", ["ember.keepalive.policies", "ember.keepalive.preset", "ember.keepalive.arrivals"])
def test_the_keepalive_package_imports_only_itself_and_the_core(module: str) -> None:
    loaded = _loaded_after(module)
    outside = {m for m in loaded if m not in ("ember", "ember.errors")
               and not m.startswith(("ember.core", "ember.keepalive"))}
    assert not outside


# Which of the three inner packages each may import, anywhere in a module (late imports too): one way, downwards.
_BELOW = {"core": set(), "keepalive": {"core"}, "serving": {"core", "keepalive"}}


def test_core_keepalive_and_serving_import_one_way_with_no_circle() -> None:
    package = Path(ember.__file__).parent
    upward = {}
    for name, allowed in _BELOW.items():
        for path in (package / name).rglob("*.py"):
            inner = {n.split(".")[1] for n in _imports(path) if n.startswith("ember.") and n.split(".")[1] in _BELOW}
            if inner - allowed - {name}:
                upward[str(path.relative_to(package.parent))] = sorted(inner - allowed - {name})
    assert not upward


def test_serving_calls_the_keepalive_policies_through_their_interface_alone() -> None:
    """A new policy needs no change in serving: it never names a policy class (`ember.keepalive.policies`)."""
    package = Path(ember.__file__).parent
    naming = {str(path.relative_to(package.parent)) for path in (package / "serving").rglob("*.py")
              if any(n.startswith("ember.keepalive.policies") for n in _imports(path))}
    assert not naming


def test_the_settings_load_no_serving_module() -> None:
    assert not {m for m in _loaded_after("ember.config") if m.startswith("ember.serving")}


@pytest.mark.parametrize("module", ["ember.server", "ember.cluster.service", "ember.cluster.state",
                                    "ember.gateway.cluster_api"])
def test_only_the_cluster_actors_import_ray(module: str) -> None:
    code = f"import sys, {module}; print(any(m == 'ray' or m.startswith('ray.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_grpc_messages_load_nothing_of_ember_but_their_package() -> None:
    """Generated wire models (ember/wire/grpc): protobuf only, their descriptors in the package's own pool."""
    loaded = _loaded_after("ember.wire.grpc.grpc_service_pb2")
    assert loaded == {"ember", "ember.wire", "ember.wire.grpc", "ember.wire.grpc.grpc_service_pb2",
                      "ember.wire.grpc.model_config_pb2"}


def test_the_http_gateway_does_not_load_grpc() -> None:
    """The gRPC binding is the server's to start (ember/gateway/grpc_server.py); the app alone never imports grpc."""
    code = "import sys, ember.gateway.app; print(any(m == 'grpc' or m.startswith('grpc.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


def test_production_code_never_imports_the_test_harnesses() -> None:
    """Anywhere in a module, a function's late import included (a fresh interpreter would miss those)."""
    package = Path(ember.__file__).parent
    found = {str(path.relative_to(package.parent)): sorted(n for n in _imports(path) if n.startswith("ember.testing"))
             for path in package.rglob("*.py") if "testing" not in path.relative_to(package).parts}
    assert not {path: names for path, names in found.items() if names}


NO_OTEL = """
import json, sys
from pathlib import Path
sys.modules["opentelemetry"] = None   # as if the otel extra were not installed: importing it fails
from ember.config import ServeConfig
from ember.errors import InvalidInput
from ember.server import build_app
tmp = Path(sys.argv[1])
app = build_app(ServeConfig(state_dir=tmp / "state", models=(tmp / "models",), otel=False))
tracer = type(app.state.gateway.tracer).__name__
try:
    build_app(ServeConfig(state_dir=tmp / "state2", models=(tmp / "models",), otel=True))
    refused = ""
except InvalidInput as err:
    refused = str(err)
print(json.dumps({"tracer": tracer, "refused": refused}))
"""


def test_without_the_otel_packages_the_server_builds_untraced(tmp_path: Path) -> None:
    write(tmp_path, "m")
    out = subprocess.run([sys.executable, "-c", NO_OTEL, str(tmp_path)], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["tracer"] == "NoRequestTracer"
    assert "ember[otel]" in result["refused"]
