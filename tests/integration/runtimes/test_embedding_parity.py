"""The embedding runtime against the real sentence_transformers package, both reading the same directory."""

from __future__ import annotations

import numpy as np
import pytest

from ember.runtimes.embedding import EmbeddingRuntime
from ember.wire.contract import example_contracts_dir, load_contract

SENTENCES = [
    "The cat sits outside.",
    "A man is playing guitar.",
    "I love pasta.",
    "The new movie is awesome!",
    "Do you like pizza?",
    "",
    "   leading and trailing spaces   ",
    "UPPER CASE AND lower case",
    "Numbers 3.14159, dates 2024-01-31 and e-mail test@example.com.",
    "naïve café, Straße, 東京は日本の首都です。 Ελληνικά, русский, emoji 🚀🔥",
    "tabs\tand\nnewlines\r\nmixed in",
    "a",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "Serverless inference keeps a ladder of warm instances: hot, paused, template, zygote. " * 2,
    # Longer than max_seq_length: both sides must truncate the same way.
    " ".join(f"word{i} is followed by another token" for i in range(120)),
]


@pytest.mark.slow
def test_vectors_match_sentence_transformers() -> None:
    from sentence_transformers import SentenceTransformer

    contract = load_contract(example_contracts_dir() / "minilm.yaml")
    directory = contract.weights_path()
    assert directory is not None
    reference = SentenceTransformer(str(directory), device="cpu", local_files_only=True)
    want = reference.encode(SENTENCES, batch_size=4, convert_to_numpy=True)
    encoded = reference.tokenizer(SENTENCES, truncation=True, max_length=reference.max_seq_length)
    want_counts = [len(ids) for ids in encoded["input_ids"]]

    model = EmbeddingRuntime().load(contract)
    batch = np.empty(len(SENTENCES), dtype=object)
    batch[:] = [s.encode() for s in SENTENCES]
    out = model.infer({"text": batch})
    got = out["embedding"]

    assert got.shape == want.shape == (len(SENTENCES), model.dimension)
    cosines = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.9999, dict(zip(SENTENCES, cosines.round(6), strict=True))
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1), rtol=1e-4)
    assert out["token_count"].tolist() == want_counts
    assert max(want_counts) == reference.max_seq_length  # the long sentence was truncated on both sides
