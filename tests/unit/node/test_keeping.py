"""What a retiring instance hands its node (ember/node/keeping.py): kept in a store the node gave it, checked field
by field, anything else refused with the field named."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.errors import InvalidInput
from ember.node import keeping
from ember.runtimes import llm_snapshot as snap
from ember.testing.service import fake_contracts
from ember.wire.contract import example_contracts_dir, load_contract

STATE = bytes(range(256)) * 4
MODEL_ID = "smollm2-0123456789abcdef0123"
SMOLLM2 = load_contract(example_contracts_dir() / "smollm2.yaml")
PYTHON = next(c for c in fake_contracts() if c.name == "affine")
KEEPS = keeping.learned_limit(SMOLLM2)   # its options.learned_snapshots: the default


def keep(header: dict[str, Any], tensors: dict[str, np.ndarray], root: Path, *, runtime: str = "llm",
         model_id: str | None = MODEL_ID, limit: int = KEEPS) -> int:
    """What the node does with a drained frame's `keep` for an instance of a SmolLM2-like model (its store `root`)."""
    return keeping.keep(header, tensors, runtime=runtime, roots={root}, model_id=model_id, limit=limit)


def learned(root: Path, **fields: Any) -> snap.Learned:
    values: dict[str, Any] = {"model_id": MODEL_ID, "kv_type": "f16", "limit": 2,
                              "root": root, "prefixes": (((1, 2, 3, 4), STATE), ((5, 6, 7), STATE[:100]))}
    return snap.Learned(**{**values, **fields})


def test_the_node_keeps_them_first_in_the_models_list_and_the_store_holds_each(tmp_path: Path) -> None:
    header, tensors = learned(tmp_path).frame()
    assert keep(header, tensors, tmp_path) == 2
    names = snap.read_learned(tmp_path, "smollm2-0123456789abcdef0123")
    assert names == [snap.snapshot_name("smollm2-0123456789abcdef0123", [1, 2, 3, 4], "f16"),
                     snap.snapshot_name("smollm2-0123456789abcdef0123", [5, 6, 7], "f16")]
    with snap.opened(tmp_path) as store:
        assert snap.restore(store, names[0]) == ([1, 2, 3, 4], STATE)
    # A later instance's one prefix goes first; the list keeps `limit` names.
    header, tensors = learned(tmp_path, prefixes=(((9, 9, 9), STATE),)).frame()
    assert keep(header, tensors, tmp_path) == 1
    assert snap.read_learned(tmp_path, "smollm2-0123456789abcdef0123")[1:] == names[:1]


@pytest.mark.parametrize(("change", "field"), [
    ({"model_id": "../../etc"}, "keep.model_id"), ({"model_id": "a/b"}, "keep.model_id"),
    ({"model_id": ".."}, "keep.model_id"), ({"model_id": 7}, "keep.model_id"),
    ({"kv_type": "f32"}, "keep.kv_type"), ({"limit": 65}, "keep.limit"), ({"limit": "2"}, "keep.limit"),
    ({"count": 3}, "keep.count"), ({"count": -1}, "keep.count"), ({"kind": "python-files"}, "keep.kind"),
    ({"root": "/etc"}, "keep.root"),
])
def test_anything_else_is_refused_naming_the_field(tmp_path: Path, change: dict[str, Any], field: str) -> None:
    header, tensors = learned(tmp_path).frame()
    with pytest.raises(InvalidInput, match=field):
        keep({**header, **change}, tensors, tmp_path)
    assert not (tmp_path / "prefixes").exists()


def test_only_an_llm_models_instance_hands_prefixes_over(tmp_path: Path) -> None:
    header, tensors = learned(tmp_path).frame()
    with pytest.raises(InvalidInput, match="keep.kind"):
        keep(header, tensors, tmp_path, runtime="python")
    assert keeping.keep_logged(PYTHON, header, lambda: tensors, roots={tmp_path}, store=None) == 0   # logged


def test_a_frame_whose_tensors_do_not_decode_is_logged_and_dropped(tmp_path: Path) -> None:
    header, _ = learned(tmp_path).frame()

    def malformed() -> dict[str, np.ndarray]:
        raise InvalidInput("frame: tensor bytes cut short")

    assert keeping.keep_logged(SMOLLM2, header, malformed, roots={tmp_path}, store=None) == 0


def test_a_prefix_past_the_bounds_is_refused_before_its_tokens_are_read(tmp_path: Path) -> None:
    header, tensors = learned(tmp_path).frame()
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.int64), shape=(snap.MAX_PREFIX_TOKENS + 1,), strides=(0,))
    with pytest.raises(InvalidInput, match="tokens.0 at most"):
        keep(header, {**tensors, "tokens.0": huge}, tmp_path)


def test_tensors_of_the_wrong_shape_or_type_are_refused(tmp_path: Path) -> None:
    header, tensors = learned(tmp_path).frame()
    for name, bad in [("tokens.0", np.zeros((2, 2), np.int64)), ("tokens.1", np.zeros(3, np.int32)),
                      ("state.0", np.zeros(3, np.float32))]:
        with pytest.raises(InvalidInput, match="keep: tokens"):
            keep(header, {**tensors, name: bad}, tmp_path)
    with pytest.raises(InvalidInput, match="keep.count"):
        keep(header, {"tokens.0": tensors["tokens.0"]}, tmp_path)


_VALUES = st.one_of(st.none(), st.integers(-3, 70), st.text(max_size=12), st.booleans(), st.lists(st.integers()))


@settings(max_examples=200, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(["kind", "model_id", "kv_type", "limit", "root", "count"]), _VALUES))
def test_any_header_is_kept_or_refused_with_invalid_input(tmp_path_factory: pytest.TempPathFactory,
                                                          fields: dict[str, Any]) -> None:
    root = tmp_path_factory.mktemp("keep")
    header, tensors = learned(root).frame()
    with contextlib.suppress(InvalidInput):
        keep({**header, **fields}, tensors, root)


def test_only_the_instances_own_model_id_is_kept(tmp_path: Path) -> None:
    """An instance naming another model's id would put its state into that model's loads: refused, as is any id
    when the node cannot find its model's (a store-backed model whose GGUF is not on this node)."""
    header, tensors = learned(tmp_path).frame()
    for own in ("other-model-0123456789abcdef0123", None):
        with pytest.raises(InvalidInput, match="keep.model_id: 'smollm2-0123456789abcdef0123' is not the instance"):
            keep(header, tensors, tmp_path, model_id=own)
    assert not (tmp_path / "prefixes").exists()


def test_the_node_finds_the_id_the_runtime_gives_the_model(tmp_path: Path) -> None:
    own = keeping.own_model_id(SMOLLM2, store=None)
    gguf = SMOLLM2.weights_path()
    assert gguf is not None and own == snap.learned_id(snap.model_id(gguf), SMOLLM2)
    assert own.startswith(snap.model_id(gguf) + "-") and snap.Learned.from_frame(*learned(tmp_path, model_id=own)
                                                                                 .frame()).model_id == own
    header, tensors = learned(tmp_path, model_id=own).frame()
    assert keeping.keep_logged(SMOLLM2, header, lambda: tensors, roots={tmp_path}, store=None) == 2
    assert keeping.own_model_id(PYTHON, store=None) is None   # no GGUF: nothing of an llm's to keep


@pytest.mark.parametrize("change", [{"tenant": "acme"}, {"tenant": "beta"}, {"name": "smollm2-other"},
                                    {"version": "2"}])
def test_learned_prefixes_are_kept_per_tenant_and_model_not_per_gguf(tmp_path: Path, change: dict[str, str]) -> None:
    """The same GGUF under another tenant, name or version is another model: what one kept, the other neither finds
    in its list nor may write into it (servers sharing a store included: the id is the same on each)."""
    other = SMOLLM2.model_copy(update=change)
    own, theirs = keeping.own_model_id(SMOLLM2, store=None), keeping.own_model_id(other, store=None)
    assert own is not None and theirs is not None and own != theirs
    assert theirs == keeping.own_model_id(other.model_copy(), store=None)   # stable: a second server finds it too
    header, tensors = learned(tmp_path, model_id=own).frame()
    assert keeping.keep_logged(SMOLLM2, header, lambda: tensors, roots={tmp_path}, store=None) == 2
    assert len(snap.read_learned(tmp_path, own)) == 2 and snap.read_learned(tmp_path, theirs) == []
    assert keeping.keep_logged(other, header, lambda: tensors, roots={tmp_path}, store=None) == 0   # refused
    assert snap.read_learned(tmp_path, theirs) == []
    names = {snap.snapshot_name(own, [1, 2, 3, 4], "f16"), snap.snapshot_name(theirs, [1, 2, 3, 4], "f16")}
    assert len(names) == 2   # nor do they share a snapshot's name


def test_the_keep_limit_is_bounded_by_the_contracts_learned_snapshots(tmp_path: Path) -> None:
    """An instance asking for a longer list than its contract keeps (up to the frame's 64) is refused."""
    two = SMOLLM2.model_copy(update={"options": {**SMOLLM2.options, "learned_snapshots": 2}})
    assert keeping.learned_limit(two) == 2 and keeping.learned_limit(PYTHON) == 0
    own = keeping.own_model_id(two, store=None)
    assert own is not None
    for limit in (3, 64):
        header, tensors = learned(tmp_path, model_id=own, limit=limit).frame()
        with pytest.raises(InvalidInput, match=rf"keep.limit: {limit} is more than the model's "
                                               r"options.learned_snapshots \(2\)"):
            keep(header, tensors, tmp_path, model_id=own, limit=2)
        assert keeping.keep_logged(two, header, lambda t=tensors: t, roots={tmp_path}, store=None) == 0   # logged
    assert not (tmp_path / "prefixes").exists()
    header, tensors = learned(tmp_path, model_id=own, limit=2).frame()
    assert keeping.keep_logged(two, header, lambda: tensors, roots={tmp_path}, store=None) == 2


def test_instances_retiring_together_each_get_their_prefix_into_the_list(tmp_path: Path) -> None:
    """Each keep reads the model's list and writes it back: without a lock around both, one update is lost."""
    import threading

    def one(i: int) -> None:
        header, tensors = learned(tmp_path, limit=64, prefixes=(((i, i + 1), STATE[:64]),)).frame()
        keep(header, tensors, tmp_path, limit=64)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(snap.read_learned(tmp_path, MODEL_ID)) == 16
