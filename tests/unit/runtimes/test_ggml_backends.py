"""Which of llama.cpp's CPU backend variants a host loads (ember.runtimes.ggml_backends.choose), and where they lie."""

from pathlib import Path

import pytest

from ember.runtimes.ggml_backends import choose, variant_files

# Scores as ggml's variants report them on an AMX CPU (Sapphire Rapids): higher is a larger instruction set.
AMX_HOST = {"x64": 1, "sse42": 3, "haswell": 55, "skylakex": 183, "icelake": 1847, "zen4": 3895,
            "sapphirerapids": 16311}


def test_an_amx_host_runs_the_best_variant_without_amx_and_says_why() -> None:
    best, why = choose(AMX_HOST, allow_amx=False, forced=None)
    assert best == "zen4"
    assert "sapphirerapids skipped" in why and "EMBER_GGML_AMX=1" in why


def test_amx_is_used_when_allowed() -> None:
    assert choose(AMX_HOST, allow_amx=True, forced=None)[0] == "sapphirerapids"


def test_a_host_without_amx_runs_its_best_and_names_no_skip() -> None:
    scores = {**AMX_HOST, "sapphirerapids": 0, "zen4": 0, "icelake": 0}
    best, why = choose(scores, allow_amx=False, forced=None)
    assert best == "skylakex" and "skipped" not in why


def test_a_forced_variant_must_run_here() -> None:
    assert choose(AMX_HOST, allow_amx=False, forced="haswell") == ("haswell", "EMBER_GGML_CPU=haswell")
    with pytest.raises(RuntimeError, match="EMBER_GGML_CPU='armv9'.*it runs: haswell"):
        choose(AMX_HOST, allow_amx=False, forced="armv9")


def test_no_runnable_variant_is_said() -> None:
    assert choose({"zen4": 0}, allow_amx=False, forced=None) == (None, "no CPU backend variant runs on this CPU")


def test_variants_are_found_beside_the_package_and_under_the_platform_bin(tmp_path: Path) -> None:
    lib = tmp_path / "site-packages" / "llama_cpp" / "lib"
    bin_ = tmp_path / "site-packages" / "bin"
    lib.mkdir(parents=True)
    bin_.mkdir()
    for path in (lib / "libggml-cpu-haswell.so", bin_ / "libggml-cpu-zen4.so", bin_ / "libggml-cpu-haswell.so",
                 bin_ / "libggml-base.so", lib / "libggml.so"):
        path.write_bytes(b"")
    found = variant_files(lib)
    assert found == {"haswell": lib / "libggml-cpu-haswell.so", "zen4": bin_ / "libggml-cpu-zen4.so"}
