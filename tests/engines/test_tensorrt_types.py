"""The TensorRT code type-checked against TensorRT's Python API, so that a misspelt or removed
call fails CI on machines where TensorRT cannot be installed.

The API comes from the `tensorrt-stubs` package (10.13, generated from the real bindings), which
scripts/setup.sh puts in $VENV/typings (see requirements-stubs.txt for why not site-packages);
the checker is pyright (basedpyright, which ships its own Node.js), configured in
pyrightconfig.json.
Not mypy: five signatures in the 10.13 stubs are not valid Python (four plugin methods name a
parameter `in`; `add_scale_nd` puts a required parameter after defaulted ones), which stops
mypy before it checks anything, while pyright's parser recovers and checks against the stubs
unmodified.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from litevlm_runtime.errors import LiteVLMError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = json.loads((ROOT / "pyrightconfig.json").read_text())
ENGINE = "litevlm_runtime/engines/tensorrt_engine.py"
COMMAND = "litevlm_runtime/commands/build_engines.py"
# The stubs of the venv running the tests: pyrightconfig.json names .venv/typings, the default
# venv's, for a plain `basedpyright` in the repository.
STUBS = Path(sys.prefix) / "typings"


def pyright(project: Path, include: list[str]) -> list[dict]:
    """Error diagnostics of pyright over `include`, with the repository's settings, run in `project`."""
    (project / "pyrightconfig.json").write_text(json.dumps({**CONFIG, "include": include, "stubPath": str(STUBS)}))
    r = subprocess.run([sys.executable, "-m", "basedpyright", "--outputjson", "--project", str(project),
                        "--pythonpath", sys.executable], capture_output=True, text=True, timeout=300, cwd=project)
    try:
        report = json.loads(r.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"basedpyright did not run (rc {r.returncode}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
    return [d for d in report["generalDiagnostics"] if d["severity"] == "error"]


def describe(diagnostics: list[dict]) -> str:
    return "\n".join(f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}" for d in diagnostics)


def test_checked_files_are_the_tensorrt_code():
    assert sorted(CONFIG["include"]) == sorted([ENGINE, COMMAND])


def test_tensorrt_code_type_checks_against_the_stubs(tmp_path):
    assert (STUBS / "tensorrt" / "__init__.pyi").is_file(), f"no TensorRT stubs in {STUBS}: run scripts/setup.sh"
    version = next(importlib.metadata.distributions(name="tensorrt-stubs", path=[str(STUBS)])).version
    errors = pyright(tmp_path, [str(ROOT / ENGINE), str(ROOT / COMMAND)])
    assert not errors, f"pyright errors against tensorrt-stubs {version}:\n{describe(errors)}"


# (file, what the code says, a wrong spelling, what pyright's error must name). Several wrong
# spellings are the TensorRT 8 names that 10.0 removed.
MUTATIONS = [
    (ENGINE, "trt.Builder(", "trt.Buildr(", "Buildr"),
    (ENGINE, ".create_network(", ".create_network_v2(", "create_network_v2"),
    (ENGINE, "CreationFlag.STRONGLY_TYPED", "CreationFlag.STRONG_TYPED", "STRONG_TYPED"),
    (ENGINE, "trt.OnnxParser(", "trt.OnnxParse(", "OnnxParse"),
    (ENGINE, ".parse_from_file(", ".parse_file(", "parse_file"),
    (ENGINE, ".num_errors", ".num_error", "num_error"),
    (ENGINE, ".get_error(", ".get_errors(", "get_errors"),
    (ENGINE, ".create_builder_config(", ".create_config(", "create_config"),
    (ENGINE, ".set_memory_pool_limit(", ".set_memory_pool_limt(", "set_memory_pool_limt"),
    (ENGINE, "MemoryPoolType.WORKSPACE", "MemoryPoolType.WORK_SPACE", "WORK_SPACE"),
    (ENGINE, "WORKSPACE_BYTES)", "str(WORKSPACE_BYTES))", "pool_size"),             # wrong argument type
    (ENGINE, ".build_serialized_network(", ".build_engine(", "build_engine"),        # removed in 10.0
    (ENGINE, "trt.Logger", "trt.Loger", "Loger"),
    (ENGINE, "Logger.WARNING", "Logger.WARN", "WARN"),
    (ENGINE, "trt.__version__", "trt.version", "version"),
    (ENGINE, "trt.Runtime(", "trt.Runtim(", "Runtim"),
    (ENGINE, ".deserialize_cuda_engine(", ".deserialize_engine(", "deserialize_engine"),
    (ENGINE, ".create_execution_context(", ".create_context(", "create_context"),
    (ENGINE, ".num_io_tensors", ".num_bindings", "num_bindings"),                   # removed in 10.0
    (ENGINE, ".get_tensor_name(", ".get_binding_name(", "get_binding_name"),        # removed in 10.0
    (ENGINE, ".get_tensor_shape(", ".get_binding_shape(", "get_binding_shape"),     # removed in 10.0
    (ENGINE, ".get_tensor_dtype(", ".get_binding_dtype(", "get_binding_dtype"),     # removed in 10.0
    (ENGINE, "DataType.HALF", "DataType.FP16", "FP16"),
    (ENGINE, ".set_tensor_address(", ".set_tensor_adress(", "set_tensor_adress"),
    (ENGINE, ".execute_async_v3(", ".execute_async_v2(", "execute_async_v2"),       # removed in 10.0
    # optimization profiles of the batched step engine, and a context selecting one
    (ENGINE, ".create_optimization_profile(", ".create_profile(", "create_profile"),
    (ENGINE, ".set_shape(", ".set_shapes(", "set_shapes"),
    (ENGINE, "trt.Dims(lo)", "trt.Dim(lo)", "Dim"),
    (ENGINE, ".extra_memory_target", ".extra_memory", "extra_memory"),
    (ENGINE, ".add_optimization_profile(", ".add_profile(", "add_profile"),
    (ENGINE, ".set_optimization_profile_async(", ".set_optimization_profile(", "set_optimization_profile"),
    (ENGINE, ".set_input_shape(", ".set_binding_shape(", "set_binding_shape"),       # removed in 10.0
    (COMMAND, "progress=", "progres=", "progres"),             # the command's call into build_engines
]


def python_sources(folder: str, names: list[str]) -> list[str]:
    """shutil.copytree's ignore: everything but .py files and their folders."""
    return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or (Path(folder) / n).is_dir())]


@pytest.fixture(scope="module")
def mutated(tmp_path_factory) -> tuple[Path, list[list[dict]], list[dict]]:
    """The package copied, each mutation in its own module next to the original (so that its
    relative imports resolve), all checked in one pyright run: the errors of each mutated module,
    and any others."""
    tmp = tmp_path_factory.mktemp("pyright")
    shutil.copytree(ROOT / "litevlm_runtime", tmp / "litevlm_runtime", ignore=python_sources)
    files = []
    for i, (file, old, new, _) in enumerate(MUTATIONS):
        source = (ROOT / file).read_text()
        assert old in source, f"{file} no longer says {old!r}: update MUTATIONS"
        copy = str(Path(file).with_name(f"{Path(file).stem}_mutation{i}.py"))
        (tmp / copy).write_text(source.replace(old, new))
        files.append(copy)
    by_file: dict[str, list[dict]] = {}
    for d in pyright(tmp, files):
        by_file.setdefault(str(Path(d["file"]).relative_to(tmp)), []).append(d)
    per_mutation = [by_file.pop(f, []) for f in files]
    return tmp, per_mutation, [d for ds in by_file.values() for d in ds]


@pytest.mark.parametrize("i", range(len(MUTATIONS)), ids=[m[3] for m in MUTATIONS])
def test_a_wrong_tensorrt_call_fails_the_check(mutated, i):
    tmp, errors, _ = mutated
    file, old, new, named = MUTATIONS[i]
    text = (tmp / Path(file).with_name(f"{Path(file).stem}_mutation{i}.py")).read_text()
    mutated_lines = {n for n, line in enumerate(text.splitlines()) if new in line}
    assert errors[i], f"pyright accepted {new!r} in place of {old!r}"
    assert {d["range"]["start"]["line"] for d in errors[i]} == mutated_lines, describe(errors[i])
    assert all(f'"{named}"' in d["message"] for d in errors[i]), describe(errors[i])


def test_mutations_break_nothing_else(mutated):
    _, _, others = mutated
    assert not others, f"errors outside the mutated modules:\n{describe(others)}"


def test_the_stubs_are_not_importable():
    """Stubs on the import path make `import tensorrt` succeed with an empty namespace package,
    which breaks ModelOpt (it uses TensorRT where the import succeeds)."""
    spec = importlib.util.find_spec("tensorrt")
    assert spec is None or spec.origin is not None, \
        f"tensorrt imports as a namespace package from {list(spec.submodule_search_locations or [])}: " \
        f"the stubs belong in {STUBS} (requirements-stubs.txt)"


def test_type_stubs_alone_are_not_tensorrt(tmp_path, monkeypatch):
    """`pip install tensorrt-stubs` leaves an importable tensorrt/ folder of .pyi files (a
    namespace package): engines still need the real TensorRT and say so."""
    from litevlm_runtime.engines.tensorrt_engine import import_tensorrt

    (tmp_path / "tensorrt").mkdir()
    (tmp_path / "tensorrt" / "__init__.pyi").write_text("__version__: str\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    importlib.invalidate_caches()
    try:
        module = importlib.import_module("tensorrt")
        if getattr(module, "__file__", None) is not None:
            pytest.skip(f"the real TensorRT is installed here ({module.__file__})")
        with pytest.raises(LiteVLMError, match="TensorRT is not installed"):
            import_tensorrt()
    finally:
        sys.modules.pop("tensorrt", None)      # not the namespace package of tmp_path for later tests
