"""How a child gets its model (ember.node.loading): a template loads the contract its runtime adapts for it."""

from __future__ import annotations

from ember.node.loading import ModelLoader
from ember.runtimes.python import PythonRuntime
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract

IRIS = load_contract(example_contracts_dir() / "iris.yaml")


class TemplateAware(PythonRuntime):
    """A runtime that loads differently in a template (as the llm runtime's `repack: template` does)."""

    @staticmethod
    def template_contract(contract: ModelContract) -> ModelContract:
        return contract.model_copy(update={"options": {**contract.options, "shared": True}})


def test_a_template_loads_the_contract_its_runtime_adapts_for_it() -> None:
    assert ModelLoader(TemplateAware(), IRIS, None, template=True).contract.options["shared"] is True


def test_a_zygote_child_and_a_runtime_without_the_hook_load_the_contract_as_it_is() -> None:
    assert ModelLoader(TemplateAware(), IRIS, None).contract is IRIS
    assert ModelLoader(PythonRuntime(), IRIS, None, template=True).contract is IRIS
