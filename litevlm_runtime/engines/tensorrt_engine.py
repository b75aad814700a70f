"""TensorRT: engines built from the bundle's ONNX graphs, and the runtime that runs them.

Build (`litevlm build-engines BUNDLE --precision fp16|fp8`): one serialized engine per graph
(stage x bucket), built with the TensorRT Python API as a strongly typed network: every tensor
keeps the type the ONNX graph gives it, so fp16 engines come from a float16 export and FP8
engines from a calibration bundle whose graphs carry ModelOpt's FP8 Q/DQ nodes. The manifest
records, per precision, the TensorRT version, the GPU (name and compute capability) and each
engine's sha256.

Load: an engine is refused, with a clear error, when its file hash, the TensorRT version or the
GPU differs from what the manifest recorded (a serialized engine is only valid for the exact
TensorRT version and GPU it was built with). That check is plain Python (`check_engines`).

Run: each bucket's execution context has its tensor addresses set once to the bound buffers
(arena buffers where possible, see bound_stages.py), is launched with execute_async_v3 on the
current CUDA stream once to initialise, then captured once in a CUDA graph; every later run is a
graph replay.

TensorRT is imported lazily: nothing here needs it until an engine is built or loaded. Every
TensorRT call is type-checked against the `tensorrt-stubs` package in CI
(tests/test_tensorrt_types.py, pyrightconfig.json), so a misspelt or removed API fails there
even though TensorRT itself cannot be installed on the CI machines.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import LiteVLMError
from ..export.exporter import read_manifest, sha256_file, write_manifest
from .base import Engines
from .bound_stages import bound_engines

if TYPE_CHECKING:
    import tensorrt as trt
    from torch.cuda import _POOL_HANDLE      # torch's own type for graph_pool_handle()

    from ..pipeline.runtime import Runtime

PRECISIONS = ("fp16", "fp8")
WORKSPACE_BYTES = 8 << 30


def import_tensorrt():  # no return annotation: inferred as the tensorrt module, so callers' uses are checked
    try:
        import tensorrt
    except ImportError:
        tensorrt = None
    # `pip install tensorrt-stubs` leaves a tensorrt/ folder of .pyi files only, which Python
    # imports as an empty namespace package (no __file__): that is not TensorRT either.
    if tensorrt is None or getattr(tensorrt, "__file__", None) is None:
        raise LiteVLMError("TensorRT is not installed (the tensorrt Python package with its libraries is needed to "
                           "build or run engines; on the car it comes with JetPack/DriveOS). The same graphs run on "
                           "the CPU with --backend onnxruntime.")
    return tensorrt


def gpu_identity() -> dict[str, str]:
    if not torch.cuda.is_available():
        raise LiteVLMError("TensorRT engines need an NVIDIA GPU: torch.cuda.is_available() is False on this machine")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"name": props.name, "compute_capability": f"{props.major}.{props.minor}"}


def engine_file(graph_file: str, precision: str) -> str:
    return graph_file.removesuffix(".onnx") + f".{precision}.engine"


# ------------------------------------------------------------------------------------- build
def build_engine(onnx_path: Path, precision: str, logger: trt.ILogger) -> bytes:
    trt = import_tensorrt()
    builder = trt.Builder(logger)
    # Strongly typed: TensorRT 10.12 deprecated the weakly typed precision flags
    # (BuilderFlag.FP16/FP8, which let it pick its own types) and 11.0 removed them. The types
    # come from the graph; 11.x ignores this flag because every network is strongly typed there.
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise LiteVLMError(f"{onnx_path.name}: TensorRT could not parse the graph: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise LiteVLMError(f"{onnx_path.name}: TensorRT failed to build a {precision} engine (see its log above)")
    return bytes(serialized)


def build_engines(bundle: Path, precision: str, progress: Callable[[str], None] = print) -> dict[str, Any]:
    if precision not in PRECISIONS:
        raise LiteVLMError(f"--precision {precision!r}: one of {', '.join(PRECISIONS)}")
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    if precision == "fp8" and manifest.get("precision") != "fp8":
        raise LiteVLMError(f"{bundle}: FP8 engines are built from FP8-quantized graphs; run "
                           f"`litevlm calibrate --precision fp8 --out DIR` and build from DIR")
    if precision == "fp16" and manifest.get("dtype") != "float16":
        raise LiteVLMError(f"{bundle}: exported in {manifest.get('dtype')}; a strongly typed engine keeps the graph's "
                           f"types, so fp16 engines are built from a float16 export "
                           f"(`litevlm export --model DIR --out BUNDLE --dtype float16`)")
    trt = import_tensorrt()
    gpu = gpu_identity()
    logger = trt.Logger(trt.Logger.WARNING)
    files = {}
    graphs = [g for g in manifest["graphs"] if g["stage"] in ("vision", "prefill", "decoder", "head", "eagle_draft")]
    for i, g in enumerate(graphs):
        t0 = time.perf_counter()
        name = engine_file(g["file"], precision)
        (bundle / name).write_bytes(build_engine(bundle / g["file"], precision, logger))
        files[g["file"]] = {"engine": name, "sha256": sha256_file(bundle / name)}
        progress(f"[{i + 1}/{len(graphs)}] {name:<28} {time.perf_counter() - t0:6.1f} s")
    manifest.setdefault("engines", {})[precision] = {
        "tensorrt": trt.__version__, "gpu": gpu, "precision": precision, "files": files,
    }
    write_manifest(bundle, manifest)
    return manifest


# ------------------------------------------------------------------------------------- check
def check_engines(manifest: dict[str, Any], bundle: Path, precision: str, tensorrt_version: str,
                  gpu: dict[str, str]) -> dict[str, Any]:
    """The recorded engines for `precision`, if they were built by this TensorRT for this GPU and
    are unmodified; otherwise a LiteVLMError that says what differs and what to do."""
    record = manifest.get("engines", {}).get(precision)
    if not record:
        built = ", ".join(manifest.get("engines", {})) or "none"
        raise LiteVLMError(f"{bundle}: no {precision} TensorRT engines (built: {built}); "
                           f"run `litevlm build-engines {bundle} --precision {precision}`")
    rebuild = f"rebuild them here with `litevlm build-engines {bundle} --precision {precision}`"
    if record["tensorrt"] != tensorrt_version:
        raise LiteVLMError(f"{bundle}: {precision} engines were built with TensorRT {record['tensorrt']}, "
                           f"this machine has TensorRT {tensorrt_version}; {rebuild}")
    if record["gpu"]["name"] != gpu["name"] or record["gpu"].get("compute_capability") != gpu.get("compute_capability"):
        raise LiteVLMError(f"{bundle}: {precision} engines were built for {record['gpu']['name']} "
                           f"(sm {record['gpu'].get('compute_capability')}), this GPU is {gpu['name']} "
                           f"(sm {gpu.get('compute_capability')}); {rebuild}")
    for graph, entry in record["files"].items():
        path = Path(bundle) / entry["engine"]
        if not path.is_file():
            raise LiteVLMError(f"{bundle}: missing engine {entry['engine']} (for {graph}); {rebuild}")
        if sha256_file(path) != entry["sha256"]:
            raise LiteVLMError(f"{bundle}: engine {entry['engine']} does not match its sha256 in the manifest "
                               f"(modified or corrupt); {rebuild}")
    return record


# ------------------------------------------------------------------------------------- run
def torch_dtypes() -> dict[trt.DataType, torch.dtype]:
    trt = import_tensorrt()
    return {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.BF16: torch.bfloat16,
            trt.DataType.INT64: torch.int64, trt.DataType.INT32: torch.int32, trt.DataType.BOOL: torch.bool}


class CapturedEngine:
    """One bucket's engine: addresses bound once, launched once, then captured and replayed."""

    def __init__(self, runtime: trt.Runtime, path: Path, inputs: dict[str, torch.Tensor],
                 outputs: dict[str, torch.Tensor], pool: _POOL_HANDLE):
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise LiteVLMError(f"{path.name}: TensorRT could not deserialize the engine")
        self.engine = engine
        self.context = engine.create_execution_context()
        self.tensors = {**inputs, **outputs}
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        if names != set(self.tensors):
            raise LiteVLMError(f"{path.name}: engine tensors {sorted(names)}, bound {sorted(self.tensors)}")
        dtypes = torch_dtypes()
        for name, t in self.tensors.items():
            dims = engine.get_tensor_shape(name)     # Dims: indexable, not iterable
            shape = tuple(dims[i] for i in range(len(dims)))
            dtype = dtypes.get(engine.get_tensor_dtype(name))
            if shape != tuple(t.shape) or dtype != t.dtype:
                raise LiteVLMError(f"{path.name}: {name} is {shape} {dtype} in the engine, bound {tuple(t.shape)} {t.dtype}")
            if not self.context.set_tensor_address(name, t.data_ptr()):
                raise LiteVLMError(f"{path.name}: TensorRT refused the address of {name} (see its log above)")
        stream = torch.cuda.current_stream()
        # The first launch does TensorRT's lazy initialisation, which must not happen under capture.
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise LiteVLMError(f"{path.name}: execute_async_v3 failed")
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream)

    def run(self) -> None:
        self.graph.replay()


def tensorrt_engines(rt: Runtime) -> Engines:
    from .onnxruntime_engine import Bundle, bundle_path

    trt = import_tensorrt()
    if rt.device.type != "cuda":
        raise LiteVLMError(f"backend tensorrt runs on a CUDA device, the pipeline is on {rt.device}")
    precision = rt.options.backend.precision
    bundle = Bundle(rt, bundle_path(rt))
    record = check_engines(bundle.manifest, bundle.dir, precision, trt.__version__, gpu_identity())
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    pool = torch.cuda.graph_pool_handle()

    def bind(stage: str, bucket: int, inputs: dict[str, torch.Tensor],
             outputs: dict[str, torch.Tensor]) -> CapturedEngine:
        graph = bundle.graphs(stage)[bucket]["file"]
        return CapturedEngine(runtime, bundle.dir / record["files"][graph]["engine"], inputs, outputs, pool)

    sizes = bundle.sizes()
    sizes["eagle_draft"] = tuple(t for t in sizes["eagle_draft"] if any(
        g == bundle.graphs("eagle_draft")[t]["file"] for g in record["files"]))   # only draft graphs with engines
    return bound_engines(rt, sizes, bind, "tensorrt")
