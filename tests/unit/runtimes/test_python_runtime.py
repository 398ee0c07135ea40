from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ember.errors import InvalidInput, ModelFailed, ModelNotReady
from ember.runtimes import get_runtime
from ember.runtimes.python import PythonModel, PythonRuntime
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract, parse_contract

GOOD_MODULE = """
import numpy as np

class Model:
    def load(self, weights, options):
        self.weights = weights
        self.scale = float(options.get("scale", 1.0))
        self.offset = float(np.load(weights)[0]) if weights is not None else 0.0

    def infer(self, inputs):
        return {"y": (inputs["x"].sum(axis=1) * self.scale + self.offset).astype(np.float32)}
"""


def contract_in(directory: Path, module_src: str, module: str = "usermodel", **extra: object) -> ModelContract:
    """Write `module_src` as <module>.py beside a contract in `directory` and return that contract."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{module}.py").write_text(textwrap.dedent(module_src))
    data: dict[str, object] = {
        "name": "user",
        "runtime": "python",
        "entrypoint": f"{module}:Model",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
        **extra,
    }
    return parse_contract(data, source=str(directory / "model.yaml"))


def load(contract: ModelContract) -> PythonModel:
    return PythonRuntime().load(contract)


X = {"x": np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)}


def test_get_runtime_returns_the_python_runtime() -> None:
    assert isinstance(get_runtime("python"), PythonRuntime)


def test_weights_relative_to_the_contract_and_options_reach_the_class(tmp_path: Path) -> None:
    np.save(tmp_path / "offset.npy", np.array([10.0]))
    model = load(contract_in(tmp_path, GOOD_MODULE, weights="offset.npy", options={"scale": 2}))
    out = model.infer(X)
    np.testing.assert_allclose(out["y"], [16.0, 24.0])
    assert out["y"].dtype == np.float32


def test_two_directories_with_the_same_module_name_each_get_their_own(tmp_path: Path) -> None:
    first = load(contract_in(tmp_path / "a", GOOD_MODULE, options={"scale": 1}))
    other = GOOD_MODULE.replace("* self.scale", "* self.scale * 100")
    second = load(contract_in(tmp_path / "b", other, options={"scale": 1}))
    np.testing.assert_allclose(first.infer(X)["y"], [3.0, 7.0])
    np.testing.assert_allclose(second.infer(X)["y"], [300.0, 700.0])


@pytest.mark.parametrize(
    ("source", "entry", "expected"),
    [
        ("import not_a_module_anywhere\n", None, "cannot import module 'usermodel': ModuleNotFoundError"),
        ("def broken(:\n", None, "cannot import module 'usermodel': SyntaxError"),
        ("class Other: pass\n", None, "has no class 'Model'"),
        (GOOD_MODULE, "missing_module:Model", "cannot import module 'missing_module'"),
        ("class Model:\n    def infer(self, inputs): return {}\n", None, "has no load() method"),
        ("class Model:\n    def load(self, w, o): pass\n", None, "has neither an infer() nor a stream() method"),
        ("class Model:\n    def __init__(self): raise RuntimeError('no gpu')\n", None, "RuntimeError: no gpu"),
        (
            "class Model:\n    def load(self, w, o): raise ValueError('bad header')\n"
            "    def infer(self, i): return {}\n",
            None,
            "load() failed: ValueError: bad header",
        ),
    ],
)
def test_load_failures_raise_model_not_ready_naming_the_entrypoint(
    tmp_path: Path, source: str, entry: str | None, expected: str
) -> None:
    extra = {"entrypoint": entry} if entry else {}
    contract = contract_in(tmp_path, source, **extra)
    with pytest.raises(ModelNotReady) as info:
        load(contract)
    message = str(info.value)
    assert f"model 'user:1' entrypoint '{contract.entrypoint}'" in message
    assert expected in message


def test_missing_weights_file_names_the_model_and_the_path(tmp_path: Path) -> None:
    contract = contract_in(tmp_path, GOOD_MODULE, weights="nowhere.npy")
    with pytest.raises(ModelNotReady, match=r"model 'user:1': weights file .*nowhere\.npy' does not exist"):
        load(contract)


def test_weights_from_a_package_that_is_not_installed(tmp_path: Path) -> None:
    contract = contract_in(tmp_path, GOOD_MODULE, weights="pkg:no_such_pkg_xyz/w.npy")
    with pytest.raises(ModelNotReady) as info:
        load(contract)
    assert info.value.message == "model 'user:1': weights: package 'no_such_pkg_xyz' is not installed"


def test_an_exception_in_infer_is_model_failed_with_its_text_and_no_traceback(tmp_path: Path) -> None:
    source = GOOD_MODULE.replace("return {", "raise ZeroDivisionError('division by zero in layer 3')\n        return {")
    model = load(contract_in(tmp_path, source))
    with pytest.raises(ModelFailed) as info:
        model.infer(X)
    assert str(info.value) == "model 'user:1': infer() failed: ZeroDivisionError: division by zero in layer 3"
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_an_ember_error_from_infer_passes_through(tmp_path: Path) -> None:
    source = "from ember.errors import InvalidInput\nclass Model:\n    def load(self, w, o): pass\n" \
        "    def infer(self, i): raise InvalidInput(\"input 'x': must be positive\")\n"
    with pytest.raises(InvalidInput, match="input 'x': must be positive"):
        load(contract_in(tmp_path, source)).infer(X)


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        ("[1, 2]", "infer() returned list, not a dict of outputs"),
        ("{}", "output 'y' is missing"),
        ("{'y': [1.0, 2.0]}", "output 'y': expected a numpy array, got list"),
        ("{'y': np.zeros(2)}", "output 'y': datatype FP64 does not match the contract's FP32"),
        ("{'y': np.zeros((2, 1), np.float32)}", "output 'y': shape [2, 1] does not match the contract's [-1]"),
        ("{'y': np.zeros(2, np.float32), 'z': np.zeros(2)}", "output 'z' is not in the contract"),
        ("{'y': np.zeros(2, np.complex64)}", "output 'y': datatype complex64 does not match"),
    ],
)
def test_wrong_outputs_are_model_failed_naming_the_output(tmp_path: Path, returned: str, expected: str) -> None:
    source = "import numpy as np\nclass Model:\n    def load(self, w, o): pass\n"
    source += f"    def infer(self, i): return {returned}\n"
    with pytest.raises(ModelFailed) as info:
        load(contract_in(tmp_path, source)).infer(X)
    assert expected in str(info.value)
    assert "model 'user:1'" in str(info.value)


def test_preload_imports_numpy_and_not_torch() -> None:
    code = (
        "import sys; from ember.runtimes import get_runtime; get_runtime('python').preload(); "
        "print('numpy' in sys.modules, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["True", "False"]


# --- the bundled Iris example ---------------------------------------------------------------

IRIS_DIR = example_contracts_dir() / "iris_softmax"


def iris_data() -> tuple[np.ndarray, list[str]]:
    rows = [line.split(",") for line in (IRIS_DIR / "iris.csv").read_text().splitlines()[1:]]
    return np.array([[float(v) for v in r[:4]] for r in rows], dtype=np.float32), [r[4] for r in rows]


def test_iris_example_classifies_the_iris_data() -> None:
    contract = load_contract(example_contracts_dir() / "iris.yaml")
    model = PythonRuntime().load(contract)
    features, species = iris_data()
    out = model.infer({"features": features})
    assert out["probabilities"].dtype == np.float32 and out["probabilities"].shape == (150, 3)
    np.testing.assert_allclose(out["probabilities"].sum(axis=1), 1.0, rtol=1e-5)
    assert out["label"].dtype == np.int64
    predicted = [s.decode() for s in out["species"]]
    accuracy = np.mean([p == t for p, t in zip(predicted, species, strict=True)])
    assert accuracy >= 0.95
    assert {p for p in predicted} == {"setosa", "versicolor", "virginica"}


def test_iris_example_rejects_non_finite_features() -> None:
    model = PythonRuntime().load(load_contract(example_contracts_dir() / "iris.yaml"))
    with pytest.raises(InvalidInput, match="input 'features'"):
        model.infer({"features": np.array([[5.0, np.nan, 1.0, 0.2]], dtype=np.float32)})


def test_iris_weights_are_reproduced_by_train_py(tmp_path: Path) -> None:
    # Run a copy of train.py elsewhere so the shipped iris.npz is untouched.
    for name in ("train.py", "iris.csv"):
        (tmp_path / name).write_bytes((IRIS_DIR / name).read_bytes())
    subprocess.run([sys.executable, str(tmp_path / "train.py")], check=True, capture_output=True, timeout=120)
    with np.load(tmp_path / "iris.npz") as fresh, np.load(IRIS_DIR / "iris.npz") as shipped:
        assert sorted(fresh.files) == sorted(shipped.files)
        for key in ("mean", "scale", "weight", "bias"):
            np.testing.assert_allclose(fresh[key], shipped[key], rtol=1e-4, atol=1e-5)
        assert list(fresh["classes"]) == list(shipped["classes"])
