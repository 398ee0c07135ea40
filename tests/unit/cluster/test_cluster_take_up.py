"""A model the controller gives this node to take up is deployed once: not again while the deploy `--models` began
at startup is still loading it (a second deploy would replace the first one's record mid-load)."""

from __future__ import annotations

import asyncio
from typing import cast

from ember.cluster.forward import Forwarder
from ember.cluster.service import ClusterService, ClusterSettings
from ember.serving.controller import Controller
from ember.wire.contract import example_contracts_dir, load_contract


class LoadingController:
    """A node whose startup deploy of `loading` is under way (not yet in its pool)."""

    def __init__(self, loading: str) -> None:
        self.loading, self.deploys = loading, []

    def has_deployment(self, key: str) -> bool:
        return key == self.loading

    def snapshot(self) -> object:
        return type("Snapshot", (), {"models": {}})()

    async def deploy(self, contract: object) -> None:
        self.deploys.append(contract)


def test_a_model_loading_since_startup_is_not_deployed_again_and_another_is() -> None:
    async def main() -> None:
        iris, minilm = (load_contract(example_contracts_dir() / f"{n}.yaml") for n in ("iris", "minilm"))
        local = LoadingController(iris.key)
        svc = ClusterService(cast(Controller, local), cast(object, None), Forwarder(1.0),   # type: ignore[arg-type]
                             ClusterSettings(node_id="a", url="http://a"))
        svc._registry = {iris.key: iris, minilm.key: minilm}
        svc._take_up((iris.key, minilm.key))
        await asyncio.sleep(0)
        assert local.deploys == [minilm]

    asyncio.run(main())
