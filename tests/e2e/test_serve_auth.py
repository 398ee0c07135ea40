"""`ember serve --auth on` with keys made by `ember keys`, driven by the real openai client."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from ember.testing.server import EmberServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"



def make_key(state: Path, tenant: str, role: str) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "ember", "keys", "--state-dir", str(state), "create",
                          "--tenant", tenant, "--role", role, "--json"], capture_output=True, text=True, check=True)
    created: dict[str, str] = json.loads(out.stdout)
    return created


def client(server: EmberServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_keys_tenants_and_revocation_with_the_real_openai_client(tmp_path: Path) -> None:
    models, state = tmp_path / "models", tmp_path / "state"
    models.mkdir()
    # slow-embedder belongs to tenant acme; wordy is public.
    (models / "slow_embedder.yaml").write_text((FIXTURES / "slow_embedder.yaml").read_text()
                                               .replace("delay_s: 0.2", "delay_s: 0.0") + "tenant: acme\n")
    (models / "slow_embedder").symlink_to(FIXTURES / "slow_embedder")
    (models / "wordy.yaml").write_text((FIXTURES / "wordy.yaml").read_text().replace("delay_s: 0.05", "delay_s: 0"))
    (models / "wordy").symlink_to(FIXTURES / "wordy")
    acme = make_key(state, "acme", "user")
    with EmberServer(state, "--models", str(models), "--cpu-slots", "1", "--auth", "on") as server:
        assert "authentication: on (--auth on): 1 active API keys" in server.log.read_text()
        with pytest.raises(openai.AuthenticationError):
            client(server, "not-a-key").models.list()

        mine = client(server, acme["key"])
        assert {m.id for m in mine.models.list()} == {"slow-embedder", "wordy"}
        out = mine.embeddings.create(model="slow-embedder", input="hello there")
        assert len(out.data) == 1 and out.data[0].embedding[0] == len("hello there")
        reply = mine.chat.completions.create(model="wordy", messages=[{"role": "user", "content": "one two"}])
        assert reply.choices[0].message.content == "one two "

        # A key made while the server runs works at once; it sees the public model only.
        globex = make_key(state, "globex", "user")
        theirs = client(server, globex["key"])
        assert {m.id for m in theirs.models.list()} == {"wordy"}
        with pytest.raises(openai.NotFoundError):
            theirs.embeddings.create(model="slow-embedder", input="hello")
        unload = server.url + "/v2/repository/models/wordy/unload"
        denied = httpx.post(unload, json={}, headers={"Authorization": f"Bearer {globex['key']}"})
        assert denied.status_code == 403  # a user key may not unload

        # The text/plain CSRF from another site: refused, the model stays.
        evil = httpx.post(unload, content=b"{}",
                          headers={"Origin": "http://evil.example", "Content-Type": "text/plain"})
        assert evil.status_code == 403

        subprocess.run([sys.executable, "-m", "ember", "keys", "--state-dir", str(state), "revoke", globex["id"]],
                       check=True, capture_output=True)
        with pytest.raises(openai.AuthenticationError):
            theirs.models.list()
        assert mine.chat.completions.create(model="wordy", messages=[{"role": "user", "content": "still"}]) \
            .choices[0].message.content == "still "
    log = server.log.read_text()
    assert acme["key"] not in log and globex["key"] not in log
