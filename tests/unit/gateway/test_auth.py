"""API keys, tenants, roles, rate limits and cross-site refusal, over a FakeService."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from ember.core.ratelimit import RateLimit, RateLimiter
from ember.errors import InvalidInput
from ember.gateway.app import create_app
from ember.gateway.auth import Auth, HostCheck
from ember.jobs.store import JobStore
from ember.keys.store import KeyFile, KeyRing
from ember.metrics import Metrics
from ember.testing.clock import FakeClock
from ember.testing.service import FakeService, fake_contracts

X = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}
TEXT = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def service(jobs: JobStore) -> FakeService:
    """`affine` belongs to tenant acme, `echo` to globex; the rest are public."""
    owners = {"affine": "acme", "echo": "globex"}
    models = [c.model_copy(update={"tenant": owners.get(c.name)}) for c in fake_contracts()]
    return FakeService(models=models, jobs=jobs)


@pytest.fixture
def keyfile(tmp_path: Path) -> KeyFile:
    return KeyFile(tmp_path / "keys.json")


@pytest.fixture
def keys(keyfile: KeyFile) -> dict[str, dict[str, str]]:
    made = {"acme": keyfile.create("acme", "user"), "globex": keyfile.create("globex", "user"),
            "admin": keyfile.create("ops", "admin")}
    return {name: bearer(key) for name, (_, key) in made.items()}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def client(service: FakeService, keyfile: KeyFile, clock: FakeClock) -> Iterator[TestClient]:
    with TestClient(create_app(service, Metrics(), auth=Auth(KeyRing(keyfile.path)))) as c:
        yield c


def test_no_key_is_401_with_www_authenticate_in_each_apis_shape(client: TestClient) -> None:
    r = client.get("/v2/models/embedder")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization: Bearer" in r.json()["error"]
    r = client.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("header", ["Bearer ember_0123456789ab_" + "x" * 43, "Basic dXNlcjpwYXNz", "Bearer", "x"])
def test_a_wrong_or_malformed_key_is_401(client: TestClient, header: str) -> None:
    r = client.get("/v1/models", headers={"Authorization": header})
    assert r.status_code == 401 and "www-authenticate" in r.headers


def test_health_and_server_metadata_need_no_key(client: TestClient) -> None:
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/ui"):
        assert client.get(path).status_code == 200, path


def test_model_lists_show_only_what_the_caller_may_see(client: TestClient, keys: dict[str, dict[str, str]]) -> None:
    def listed(who: str) -> tuple[set[str], set[str]]:
        openai = {m["id"] for m in client.get("/v1/models", headers=keys[who]).json()["data"]}
        index = {e["name"] for e in client.post("/v2/repository/index", headers=keys[who]).json()}
        return openai, index

    public = {"embedder", "chatter"}
    assert listed("acme") == (public | {"affine"},) * 2
    assert listed("globex") == (public | {"echo"},) * 2
    assert listed("admin") == (public | {"affine", "echo"},) * 2


def test_another_tenants_model_reads_exactly_like_a_missing_one(
        client: TestClient, keys: dict[str, dict[str, str]], service: FakeService) -> None:
    for path in ("/v2/models/{}", "/v2/models/{}/ready", "/v2/models/{}/versions/1"):
        hidden = client.get(path.format("echo"), headers=keys["acme"])
        missing = client.get(path.format("nope"), headers=keys["acme"])
        assert hidden.status_code == missing.status_code == 404
        assert hidden.json()["error"] == missing.json()["error"].replace("nope", "echo")
    r = client.post("/v2/models/echo/infer", json=TEXT, headers=keys["acme"])
    assert r.status_code == 404 and not service.calls
    assert client.post("/v2/models/echo/infer", json=TEXT, headers=keys["globex"]).status_code == 200
    assert client.post("/v2/models/echo/infer", json=TEXT, headers=keys["admin"]).status_code == 200


def test_load_unload_and_operator_routes_are_admin_only(
        client: TestClient, keys: dict[str, dict[str, str]], service: FakeService) -> None:
    r = client.post("/v2/repository/models/embedder/unload", headers=keys["acme"])
    assert r.status_code == 403 and "admin" in r.json()["error"] and not service.unloaded
    for path in ("/metrics", "/ember/status", "/ui/data"):
        assert client.get(path, headers=keys["acme"]).status_code == 403, path
        assert client.get(path, headers=keys["admin"]).status_code == 200, path
    assert client.post("/v2/repository/models/embedder/unload", headers=keys["admin"]).status_code == 200
    assert service.unloaded == {"embedder"}


def test_a_job_is_readable_only_by_its_tenant(
        client: TestClient, keys: dict[str, dict[str, str]], service: FakeService) -> None:
    service.no_capacity = True
    r = client.post("/v2/models/embedder/infer", json=TEXT, headers=keys["acme"])
    assert r.status_code == 202
    location = r.headers["location"]
    service.run_jobs()
    assert client.get(location, headers=keys["acme"]).json()["status"] == "succeeded"
    for other in ("globex", "admin"):
        theirs = client.get(location, headers=keys[other])
        unknown = client.get("/v2/jobs/" + "0" * 32, headers=keys[other])
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.json()["error"].split(":")[1] == unknown.json()["error"].split(":")[1]


def test_idempotency_keys_are_scoped_by_tenant(
        client: TestClient, keys: dict[str, dict[str, str]], service: FakeService) -> None:
    """globex reusing acme's key on a shared model gets a job of its own (not acme's id, then a 404), and a
    conflict names globex's own job only."""
    service.no_capacity = True
    key = {"Idempotency-Key": "order-1"}
    a = client.post("/v2/models/embedder/infer", json=TEXT, headers=keys["acme"] | key)
    b = client.post("/v2/models/embedder/infer", json=TEXT, headers=keys["globex"] | key)
    assert a.status_code == b.status_code == 202 and a.json()["id"] != b.json()["id"]
    assert client.get(b.headers["location"], headers=keys["globex"]).status_code == 200
    other = {"inputs": [{**TEXT["inputs"][0], "data": ["other"]}]}
    conflict = client.post("/v2/models/embedder/infer", json=other, headers=keys["globex"] | key)
    assert conflict.status_code == 422 and a.json()["id"] not in conflict.text and b.json()["id"] in conflict.text
    again = client.post("/v2/models/embedder/infer", json=TEXT, headers=keys["acme"] | key)
    assert again.json()["id"] == a.json()["id"]


def test_a_revoked_key_stops_working_on_the_next_request(
        client: TestClient, keyfile: KeyFile, keys: dict[str, dict[str, str]]) -> None:
    assert client.get("/v1/models", headers=keys["acme"]).status_code == 200
    acme = next(r for r in keyfile.records() if r.tenant == "acme")
    keyfile.revoke(acme.id)
    assert client.get("/v1/models", headers=keys["acme"]).status_code == 401


def test_each_tenant_has_its_own_rate_limit(
        service: FakeService, keyfile: KeyFile, keys: dict[str, dict[str, str]], clock: FakeClock) -> None:
    auth = Auth(KeyRing(keyfile.path), RateLimiter(RateLimit(rate=1.0, burst=5)), clock)
    client = TestClient(create_app(service, Metrics(), auth=auth))
    for _ in range(5):
        assert client.get("/v1/models", headers=keys["acme"]).status_code == 200
    r = client.get("/v1/models", headers=keys["acme"])
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["type"] == \
        "rate_limit_exceeded"
    assert client.get("/v1/models", headers=keys["globex"]).status_code == 200
    assert client.get("/v2/health/ready").status_code == 200  # health checks are never limited
    clock.advance(1.0)
    assert client.get("/v1/models", headers=keys["acme"]).status_code == 200


def test_the_text_plain_csrf_is_refused_with_keys_off(service: FakeService) -> None:
    """A page on another site cannot unload a model from a loopback server without keys."""
    with TestClient(create_app(service, Metrics()), base_url="http://127.0.0.1:8000") as client:
        evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
        r = client.post("/v2/repository/models/embedder/unload", content=b"{}", headers=evil)
        assert r.status_code == 403 and "Origin" in r.json()["error"]
        r = client.post("/v2/repository/models/embedder/unload", content=b"{}", headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and "application/json" in r.json()["error"]
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        assert client.post("/v1/embeddings", content=b"a=b", headers=form).status_code == 415
        assert not service.unloaded
        # The server's own page, a same-host Origin, JSON and tritonclient's bodies without a type all pass.
        mine = {"Origin": "http://127.0.0.1:8000", "Content-Type": "application/json"}
        assert client.post("/v2/repository/models/embedder/unload", content=b"{}", headers=mine).status_code == 200
        assert client.post("/v2/repository/models/embedder/load").status_code == 200
        binary = {"Content-Type": "application/octet-stream"}
        assert client.post("/v2/models/affine/infer", json=X, headers=binary).status_code == 200


@pytest.mark.parametrize("origin", ["null", "http://127.0.0.1:9999", "http://localhost:8000", "127.0.0.1:8000",
                                    "http://127.0.0.1.evil.example:8000"])
def test_other_origins_are_refused(service: FakeService, origin: str) -> None:
    with TestClient(create_app(service, Metrics()), base_url="http://127.0.0.1:8000") as client:
        r = client.post("/v2/models/affine/infer", json=X, headers={"Origin": origin})
        assert r.status_code == 403 and not service.calls


def test_a_dns_rebinding_page_is_refused_by_its_host(service: FakeService) -> None:
    """An attacker's name resolved to a loopback server with keys off: Host and Origin both name the attacker,
    so the Origin check alone would pass it (it did: the model was unloaded, 200)."""
    auth = Auth(hosts=HostCheck.of(["localhost", ".localhost", "ember.internal", ".svc.example"]))
    app = create_app(service, Metrics(), auth=auth)
    with TestClient(app, base_url="http://evil.example:8000") as evil:
        r = evil.post("/v2/repository/models/embedder/unload", json={},
                      headers={"Origin": "http://evil.example:8000"})
        assert r.status_code == 403 and "Host: 'evil.example:8000' is not a name this server answers to" in \
            r.json()["error"] and "--allowed-hosts" in r.json()["error"]
        assert evil.get("/v2/models/embedder").status_code == 403       # reads too (job results, the UI's data)
        r = evil.post("/v1/embeddings", json={"input": "a", "model": "embedder"})
        assert r.status_code == 403 and "Host" in r.json()["error"]["message"]
        assert not service.unloaded and not service.calls
    for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST.:8000", "[::1]:8000", "10.1.2.3:8000",
                 "ember.internal", "a.svc.example:8000", "app.localhost:8000"):
        with TestClient(app, base_url=f"http://{host}") as client:
            r = client.post("/v2/repository/models/embedder/unload", json={}, headers={"Origin": f"http://{host}"})
            assert r.status_code == 200, host
    for host in ("svc.example.evil.example", "ember.internal.evil.example", "localhost.evil.example"):
        with TestClient(app, base_url=f"http://{host}:8000") as client:
            assert client.get("/v2/models/embedder").status_code == 403, host


def test_the_host_check_is_on_by_default_while_keys_are_off() -> None:
    from ember.config import load_serve_config
    from ember.server import host_check

    default = host_check(load_serve_config())
    assert default is not None and default.allows("127.0.0.1:8000") and default.allows("localhost:8000")
    assert not default.allows("evil.example:8000")
    assert host_check(load_serve_config(host="0.0.0.0")) is None            # keys on: the keys guard
    assert host_check(load_serve_config(allowed_hosts=("*",))) is None
    mine = host_check(load_serve_config(host="0.0.0.0", allowed_hosts=("ember.lan",), advertise_url="http://n1:8000"))
    assert mine is not None and mine.allows("ember.lan:8000") and mine.allows("n1:8000")
    assert not mine.allows("evil.example")
    with pytest.raises(InvalidInput, match="allowed_hosts"):
        load_serve_config(allowed_hosts=("evil example",))


def test_a_request_is_served_for_its_keys_tenant_streamed_or_not(client: TestClient, service: FakeService,
                                                                  keys: dict[str, dict[str, str]]) -> None:
    """The service is told the tenant of each request (a model keeping state per tenant keeps them apart): a public
    model's callers included, a stream as much as a collected reply."""
    chat = {"model": "chatter", "messages": [{"role": "user", "content": "a secret system prompt"}]}
    for who, stream in (("acme", False), ("globex", True), ("admin", True)):
        r = client.post("/v1/chat/completions", json={**chat, "stream": stream}, headers=keys[who])
        assert r.status_code == 200, r.text
    assert client.post("/v2/models/affine/infer", json=X, headers=keys["acme"]).status_code == 200
    assert [(c.model, c.tenant) for c in service.calls] == [("chatter", "acme"), ("chatter", "globex"),
                                                           ("chatter", "ops"), ("affine", "acme")]
