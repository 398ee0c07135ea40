"""A GGUF's head as a GGUF of its own: the metadata read from the file's first pieces only, no tensors, the
key-values byte for byte; what is not such a file is refused by name."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest

from ember.errors import ModelNotReady
from ember.runtimes.gguf_head import vocabulary_gguf


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small GGUF with a value of every kind a vocabulary has (strings, arrays of strings and numbers), an
    alignment of 64 and two tensors (the loader's own reading of a real head is tests/integration/gateway/
    test_prompt_check_store.py's)."""
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path_factory.mktemp("head") / "small.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 64)
    w.add_token_list([f"token-{i}" for i in range(3000)])
    w.add_token_scores([float(i) for i in range(3000)])
    w.add_token_types([1] * 3000)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    w.add_array("nested.arrays", [[1, 2], [3]])
    w.add_tensor("a.weight", np.ones((256, 64), np.float32))
    w.add_tensor("b.weight", np.zeros(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def pieces(data: bytes, size: int, taken: list[int]) -> Iterator[bytes]:
    for start in range(0, len(data), size):
        taken.append(start)
        yield data[start:start + size]


def test_the_head_is_the_files_key_values_with_no_tensor(gguf: bytes) -> None:
    head = vocabulary_gguf(pieces(gguf, 4096, []))
    version, tensors, count = struct.unpack_from("<IQQ", gguf, 4)
    assert head[:4] == b"GGUF" and struct.unpack_from("<IQQ", head, 4) == (version, 0, count) and tensors == 2
    infos = gguf.index(struct.pack("<Q", len(b"a.weight")) + b"a.weight")   # the first tensor's info
    kvs = gguf[24:infos]
    assert head == head[:24] + kvs + b"\0" * (-(24 + len(kvs)) % 64)   # byte for byte, padded to the alignment
    assert b"token-2999" in kvs and b"a.weight" not in head


def test_it_reads_no_piece_past_the_metadata(gguf: bytes) -> None:
    taken: list[int] = []
    head = vocabulary_gguf(pieces(gguf, 1024, taken))
    assert taken[-1] < len(head) and len(taken) < len(gguf) // 1024   # stopped before the tensors
    assert vocabulary_gguf(pieces(gguf, 7, [])) == head   # piece boundaries anywhere, even inside a number


@pytest.mark.parametrize(("data", "says"), [
    (b"GGML" + b"\0" * 40, "not a GGUF file"),
    (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "GGUF version 1"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99),
     "unknown type 99"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + struct.pack("<Q", 1) + b"k", "ends inside its metadata"),
])
def test_what_is_not_a_gguf_head_is_refused_by_name(data: bytes, says: str) -> None:
    with pytest.raises(ModelNotReady, match=f"model 'x:1': .*{says}"):
        vocabulary_gguf(iter([data]), "model 'x:1'")
