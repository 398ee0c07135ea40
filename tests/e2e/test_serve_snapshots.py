"""`ember serve --snapshots on`: MiniLM's process image is made after deploy; once a keep-alive plan has let the
model's template and zygote go, the next request is answered by an instance restored from the image
(`Ember-Rung: restore`) with the embedding a fresh instance gives, and the metrics count the rung."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from ember.node import criu
from ember.testing.server import EmberServer, wait_for
from ember.wire.contract import example_contracts_dir

pytestmark = pytest.mark.slow
BODY = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["ember keeps models warm"]}]}


def test_a_model_whose_memory_rungs_were_let_go_is_restored_from_its_image(tmp_path: Path) -> None:
    found = criu.find()
    if not found.ok:
        pytest.skip(f"snapshots cannot run here: {found.reason}")
    state = tmp_path / "state"
    with EmberServer(state, "--no-examples", "--models", str(example_contracts_dir() / "minilm.yaml"),
                     "--cpu-slots", "1", "--snapshots", "on", "--keepalive", "fixed", "--keepalive-knob", "1",
                     "--log-level", "info", "--store-root", str(tmp_path / "store")) as server:
        wait_for(lambda: list((state / "images").glob("*/ember.json")), timeout=120)
        snapshots = wait_for(lambda: server.status()["node"]["snapshots"]["images"] and
                             server.status()["node"]["snapshots"], timeout=30)
        assert snapshots["state"].startswith("on (CRIU 4.")
        [image] = snapshots["images"]
        assert image["model"] == "minilm:1" and image["mb"] > 0 and image["dump_s"] > 0
        url = f"{server.url}/v2/models/minilm/infer"
        first = httpx.post(url, json=BODY, timeout=60)
        assert first.status_code == 200, first.text
        # Idle past the keep-alive: the instance, the template and the zygote are let go.
        wait_for(lambda: not server.instances("minilm") and not server.status()["node"]["zygotes"], timeout=30)
        restored = httpx.post(url, json=BODY, timeout=60)
        assert restored.status_code == 200, restored.text
        assert restored.headers["ember-rung"] == "restore"
        np.testing.assert_allclose(restored.json()["outputs"][0]["data"], first.json()["outputs"][0]["data"],
                                   atol=1e-5)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'ember_cold_starts_total{model="minilm",rung="restore",version="1"} 1.0' in metrics
        # Restored, not its template made again on the way: the start's only phase is the restore.
        phases = [line for line in metrics.splitlines()
                  if line.startswith("ember_cold_start_phase_seconds_count") and 'rung="restore"' in line]
        assert sorted(line.split('phase="')[1].split('"')[0] for line in phases) == ["first_response", "restore"]


CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}


def test_a_restarted_node_brings_its_templates_back_from_their_images_without_loading(tmp_path: Path) -> None:
    """Restarted on its state dir, the node restores each model's template from its image instead of loading it:
    the first requests are answered (by replicas of those templates) with what they were answered before, and no
    process on the new node ran a model's load()."""
    found = criu.find()
    if not found.ok:
        pytest.skip(f"snapshots cannot run here: {found.reason}")
    state, contracts = tmp_path / "state", example_contracts_dir()
    args = ("--no-examples", "--models", str(contracts / "minilm.yaml"), "--models", str(contracts / "smollm2.yaml"),
            "--snapshots", "on", "--log-level", "info", "--store-root", str(tmp_path / "store"))
    with EmberServer(state, *args) as server:
        images = wait_for(lambda: len(server.status()["node"]["snapshots"]["images"]) == 2 and
                          server.status()["node"]["snapshots"], timeout=240)
        assert images["loads"] >= 4   # two templates and two snapshot hosts
        before = httpx.post(f"{server.url}/v2/models/minilm/infer", json=BODY, timeout=60)
        chat_before = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "smollm2", **CHAT}, timeout=120)
        assert before.status_code == 200 and chat_before.status_code == 200, (before.text, chat_before.text)
    with EmberServer(state, *args) as server:
        after = httpx.post(f"{server.url}/v2/models/minilm/infer", json=BODY, timeout=60)
        chat_after = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "smollm2", **CHAT}, timeout=120)
        assert after.status_code == 200 and chat_after.status_code == 200, (after.text, chat_after.text)
        np.testing.assert_allclose(after.json()["outputs"][0]["data"], before.json()["outputs"][0]["data"], atol=1e-5)
        assert chat_after.json()["choices"][0]["message"] == chat_before.json()["choices"][0]["message"]
        assert after.headers["ember-rung"] == chat_after.headers["ember-rung"] == "template"
        snapshots = server.status()["node"]["snapshots"]
        assert snapshots["loads"] == 0, snapshots
        assert sorted(i["model"] for i in snapshots["images"] if i.get("restores", 0) >= 1) == ["minilm:1", "smollm2:1"]


def test_a_new_node_takes_the_image_another_node_made_from_its_store_and_loads_nothing(tmp_path: Path) -> None:
    """Node A makes MiniLM's image and keeps it in its weight store; node B (its own state dir and store, A as its
    store peer, the same cluster token) takes the image from A's store over HTTP (the manifest, then the chunks,
    each checked against its digest; the image signed with the token), restores the model's template from it, and
    answers as A does without loading the model; a node that is another host as far as images go loads it instead."""
    found = criu.find()
    if not found.ok:
        pytest.skip(f"snapshots cannot run here: {found.reason}")
    minilm = str(example_contracts_dir() / "minilm.yaml")
    token = ("--cluster-token", "cluster-token-0123456789")   # a peer's image is used only if signed with it
    with EmberServer(tmp_path / "a", "--models", minilm, "--snapshots", "on", *token,
                     "--store-root", str(tmp_path / "a-store")) as a:
        wait_for(lambda: a.status()["node"]["snapshots"]["images"], timeout=120)
        expected = httpx.post(f"{a.url}/v2/models/minilm/infer", json=BODY, timeout=60)
        assert expected.status_code == 200, expected.text
        with EmberServer(tmp_path / "b", "--models", minilm, "--snapshots", "on", "--log-level", "info", *token,
                         "--store-root", str(tmp_path / "b-store"), "--store-peers", a.url) as b:
            answer = httpx.post(f"{b.url}/v2/models/minilm/infer", json=BODY, timeout=60)
            assert answer.status_code == 200, answer.text
            np.testing.assert_allclose(answer.json()["outputs"][0]["data"], expected.json()["outputs"][0]["data"],
                                       atol=1e-5)
            snapshots = b.status()["node"]["snapshots"]
            assert snapshots["loads"] == 0, snapshots
            assert [i["model"] for i in snapshots["images"] if i.get("restores", 0) >= 1] == ["minilm:1"]
            assert "image taken from the weight store" in b.log.read_text()
        # A node whose llama.cpp CPU kernels differ (another host, as far as images go) finds no image of A's that
        # it could restore: it loads the model, and answers alike.
        with EmberServer(tmp_path / "c", "--models", minilm, "--snapshots", "on", "--store-peers", a.url, *token,
                         "--store-root", str(tmp_path / "c-store"), env={"EMBER_GGML_CPU": "x64"}) as c:
            answer = httpx.post(f"{c.url}/v2/models/minilm/infer", json=BODY, timeout=60)
            assert answer.status_code == 200, answer.text
            np.testing.assert_allclose(answer.json()["outputs"][0]["data"], expected.json()["outputs"][0]["data"],
                                       atol=1e-5)
            assert c.status()["node"]["snapshots"]["loads"] >= 1
