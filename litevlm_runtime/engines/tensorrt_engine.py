"""TensorRT: engines built from the bundle's ONNX graphs, and the runtime that runs them.

Build (`litevlm build-engines BUNDLE --precision fp16|fp8|int8|int4`): one serialized engine per
graph (stage x bucket), built with the TensorRT Python API as a strongly typed network: every
tensor keeps the type the ONNX graph gives it, so fp16 engines come from a float16 export, FP8 and
INT8 engines from a calibration bundle whose graphs carry ModelOpt's Q/DQ nodes, and INT4 engines
(weight-only) from a bundle whose decoder weights are blocked INT4 DequantizeLinear nodes
(`calibrate --precision int4`, export/int4_onnx.py). The bundle's Q/DQ are checked against what
TensorRT 10 builds before anything is parsed (`tensorrt_qdq_problems`: symmetric only). The manifest
records, per precision, the TensorRT version, the GPU (name and compute capability) and each
engine's sha256.

Load: an engine is refused, with a clear error, when its file hash, the TensorRT version or the
GPU differs from what the manifest recorded (a serialized engine is only valid for the exact
TensorRT version and GPU it was built with). That check is plain Python (`check_engines`).

Run: each bucket's execution context has its tensor addresses set once to the bound buffers
(arena buffers where possible, see bound_stages.py), is launched with execute_async_v3 on the
current CUDA stream once to initialise, then captured once in a CUDA graph; every later run is a
graph replay. An engine file is deserialized once and shared by its contexts (the step engines
bound again over each KV region of a batch, the batched step's per-bucket contexts).

The batched decode step (one ONNX graph with a dynamic batch dimension, exporter.py) becomes one
engine with one optimization profile per batch bucket b_i: min = b_(i-1) + 1 (2 for the first),
opt = max = b_i. The engine always runs padded to a bucket (bound_stages.py), so opt is exactly
the shape it runs and its tactics are tuned for that; min below it lets a runtime with fewer KV
regions than the bucket (serving.max_batch 3 against buckets 2, 4) run 3 in the 4-profile without
a rebuild. Each bucket's context selects its profile and sets its input shapes once, before the
capture. Additional profiles get `extra_memory_target = 0`: every profile reads the same weights,
and a per-profile weight copy would hold a 2B decoder's weights once per bucket in GPU memory.

TensorRT is imported lazily: nothing here needs it until an engine is built or loaded. Every
TensorRT call is type-checked against the `tensorrt-stubs` package in CI
(tests/engines/test_tensorrt_types.py, pyrightconfig.json), so a misspelt or removed API fails there
even though TensorRT itself cannot be installed on the CI machines.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import LiteVLMError
from ..weights.integrity import sha256_file
from .base import Engines
from .bound_stages import bound_engines
from .bundle import read_manifest, write_manifest
from .onnxruntime_engine import Bundle, bundle_path

if TYPE_CHECKING:
    import tensorrt as trt
    from torch.cuda import _POOL_HANDLE  # torch's own type for graph_pool_handle()

PRECISIONS = ("fp16", "fp8", "int8", "int4")
WORKSPACE_BYTES = 8 << 30


def import_tensorrt():  # no return annotation: inferred as the tensorrt module, so callers' uses are checked
    # TensorRT (and onnx, for check_bundle's graph reading) are optional: imported where used, so that
    # their absence is a clear error naming the package, not an import failure of the engines.
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
def batch_profiles(buckets: list[int]) -> list[tuple[int, int, int]]:
    """(min, opt, max) batch sizes of the batched step engine's profile per bucket."""
    sizes = sorted(buckets)
    return [(prev + 1 if i else 2, b, b) for i, (prev, b) in enumerate(zip([1] + sizes, sizes))]


def profile_of(buckets: list[int], size: int) -> int:
    """The profile (index) a batch bucket of `size` rows runs in: the first whose range holds it."""
    for i, (lo, _, hi) in enumerate(batch_profiles(buckets)):
        if lo <= size <= hi:
            return i
    raise LiteVLMError(f"batched step: {size} rows is outside every profile {batch_profiles(buckets)}")


def profile_shapes(graph: dict[str, Any]) -> list[dict[str, tuple[list[int], list[int], list[int]]]]:
    """Per profile, each dynamic input's (min, opt, max) shape: the manifest's shape with the
    `batch` axis set to the profile's sizes. [] for a graph with static shapes."""
    if "buckets" not in graph:
        return []
    profiles = []
    for sizes in batch_profiles(graph["buckets"]):
        shapes = {}
        for i in graph["inputs"]:
            if "batch" in i["shape"]:
                lo, opt, hi = ([n if d == "batch" else d for d in i["shape"]] for n in sizes)
                shapes[i["name"]] = (lo, opt, hi)
        profiles.append(shapes)
    return profiles


def build_engine(onnx_path: Path, precision: str, logger: trt.ILogger,
                 profiles: list[dict[str, tuple[list[int], list[int], list[int]]]] | None = None) -> bytes:
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
    for i, shapes in enumerate(profiles or []):
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, trt.Dims(lo), trt.Dims(opt), trt.Dims(hi))
        if i:
            profile.extra_memory_target = 0.0          # the weights once, whatever the profile
        if config.add_optimization_profile(profile) < 0:
            raise LiteVLMError(f"{onnx_path.name}: TensorRT refused optimization profile {i} ({shapes})")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise LiteVLMError(f"{onnx_path.name}: TensorRT failed to build a {precision} engine (see its log above)")
    return bytes(serialized)


def tensorrt_qdq_problems(path: Path) -> list[str]:
    """What in a graph's Q/DQ nodes TensorRT 10's strongly typed build refuses, checked from the ONNX
    alone (no TensorRT needed): FP8 and INT4 with a nonzero zero point (its IDequantizeLayer takes
    symmetric scales only; an asymmetric INT4 bundle runs in ONNX Runtime, not there); INT4 other
    than a weight's blocked DequantizeLinear (weight-only) on a 2-D weight."""
    import onnx
    from onnx import TensorProto, numpy_helper

    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    problems = []
    for n in graph.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        typed = n.input[2] if len(n.input) > 2 and n.input[2] else n.input[0]
        kind = inits[typed].data_type if typed in inits else None
        if kind in (TensorProto.UINT4, TensorProto.FLOAT8E4M3FN, TensorProto.INT4) and len(n.input) > 2 and n.input[2]:
            zero = inits.get(n.input[2])
            if kind == TensorProto.UINT4 or (zero is not None and zero.data_type != TensorProto.FLOAT8E4M3FN
                                             and numpy_helper.to_array(zero).any()):
                problems.append(f"{n.name}: a nonzero zero point (TensorRT's dequantization is symmetric)")
        if kind in (TensorProto.INT4, TensorProto.UINT4):
            if n.op_type == "QuantizeLinear" or n.input[0] not in inits:
                problems.append(f"{n.name}: INT4 only as a stored weight's DequantizeLinear (weight-only)")
            elif len(inits[n.input[0]].dims) != 2:
                problems.append(f"{n.name}: an INT4 weight of rank {len(inits[n.input[0]].dims)} (TensorRT: 2-D)")
    return problems


def build_engines(bundle: Path, precision: str, progress: Callable[[str], None] = print) -> dict[str, Any]:
    if precision not in PRECISIONS:
        raise LiteVLMError(f"--precision {precision!r}: one of {', '.join(PRECISIONS)}")
    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    made = str(manifest.get("precision") or "").split("+")       # a mixed bundle: "float32+fp8"
    if precision in ("fp8", "int8", "int4") and precision not in made:
        raise LiteVLMError(f"{bundle}: {precision.upper()} engines are built from {precision.upper()}-quantized graphs "
                           f"(this bundle: {manifest.get('precision') or manifest.get('dtype')}); run `litevlm "
                           f"calibrate --precision {precision} --out DIR` and build from DIR")
    problems = [f"{g['file']}: {why}" for g in manifest["graphs"] for why in tensorrt_qdq_problems(bundle / g["file"])]
    if problems:
        raise LiteVLMError(f"{bundle}: Q/DQ that TensorRT 10 cannot build: " + "; ".join(problems[:4]))
    if precision == "fp16" and manifest.get("dtype") != "float16":
        raise LiteVLMError(f"{bundle}: exported in {manifest.get('dtype')}; a strongly typed engine keeps the graph's "
                           f"types, so fp16 engines are built from a float16 export "
                           f"(`litevlm export --model DIR --out BUNDLE --dtype float16`)")
    trt = import_tensorrt()
    gpu = gpu_identity()
    logger = trt.Logger(trt.Logger.WARNING)
    files = {}
    graphs = [g for g in manifest["graphs"]
              if g["stage"] in ("vision", "prefill", "decoder", "head", "eagle_draft", "decoder_batch")]
    for i, g in enumerate(graphs):
        t0 = time.perf_counter()
        name = engine_file(g["file"], precision)
        (bundle / name).write_bytes(build_engine(bundle / g["file"], precision, logger, profile_shapes(g)))
        files[g["file"]] = {"engine": name, "sha256": sha256_file(bundle / name)}
        if "buckets" in g:
            files[g["file"]]["profiles"] = [list(p) for p in batch_profiles(g["buckets"])]
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
    # (INT8 / UINT8: a quantized KV cache's codes, arena.kv_dtype int8 / fp8: models/kv_cache.py)
    return {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.BF16: torch.bfloat16,
            trt.DataType.INT64: torch.int64, trt.DataType.INT32: torch.int32, trt.DataType.BOOL: torch.bool,
            trt.DataType.INT8: torch.int8, trt.DataType.UINT8: torch.uint8}


class CapturedEngine:
    """One bucket's context: addresses bound once, launched once, then captured and replayed.
    `profile`: the optimization profile of a dynamic engine (the batched step), whose input
    shapes are set to the bound tensors' before anything runs."""

    def __init__(self, engine: trt.ICudaEngine, name: str, inputs: dict[str, torch.Tensor],
                 outputs: dict[str, torch.Tensor], pool: _POOL_HANDLE, profile: int | None = None):
        self.engine = engine
        self.context = engine.create_execution_context()
        self.tensors = {**inputs, **outputs}
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        if names != set(self.tensors):
            raise LiteVLMError(f"{name}: engine tensors {sorted(names)}, bound {sorted(self.tensors)}")
        stream = torch.cuda.current_stream()
        if profile is not None:
            if not self.context.set_optimization_profile_async(profile, stream.cuda_stream):
                raise LiteVLMError(f"{name}: TensorRT refused optimization profile {profile}")
            for tensor_name, t in inputs.items():
                if not self.context.set_input_shape(tensor_name, tuple(t.shape)):
                    raise LiteVLMError(f"{name}: {tensor_name} {tuple(t.shape)} is outside profile {profile}")
        dtypes = torch_dtypes()
        for tensor_name, t in self.tensors.items():
            dims = self.context.get_tensor_shape(tensor_name)     # Dims: indexable, not iterable; resolved
            shape = tuple(dims[i] for i in range(len(dims)))
            dtype = dtypes.get(engine.get_tensor_dtype(tensor_name))
            if shape != tuple(t.shape) or dtype != t.dtype:
                raise LiteVLMError(f"{name}: {tensor_name} is {shape} {dtype} in the engine, bound "
                                   f"{tuple(t.shape)} {t.dtype}")
            if not self.context.set_tensor_address(tensor_name, t.data_ptr()):
                raise LiteVLMError(f"{name}: TensorRT refused the address of {tensor_name} (see its log above)")
        # The first launch does TensorRT's lazy initialisation, which must not happen under capture.
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise LiteVLMError(f"{name}: execute_async_v3 failed")
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream)

    def run(self) -> None:
        self.graph.replay()


def tensorrt_engines(rt: Any) -> Engines:
    """rt: the pipeline's Runtime (pipeline/runtime.py), as every backend's factory takes it;
    not imported here, since engines sit below the pipeline."""

    trt = import_tensorrt()
    if rt.device.type != "cuda":
        raise LiteVLMError(f"backend tensorrt runs on a CUDA device, the pipeline is on {rt.device}")
    precision = rt.options.backend.precision
    bundle = Bundle(rt, bundle_path(rt))
    record = check_engines(bundle.manifest, bundle.dir, precision, trt.__version__, gpu_identity())
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    pool = torch.cuda.graph_pool_handle()
    engines: dict[str, trt.ICudaEngine] = {}       # one deserialized engine per file, shared by its contexts

    def bind(stage: str, bucket: int, inputs: dict[str, torch.Tensor],
             outputs: dict[str, torch.Tensor]) -> CapturedEngine:
        graph = bundle.graph_file(stage, bucket)
        path = bundle.dir / record["files"][graph]["engine"]
        if graph not in engines:
            engine = runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is None:
                raise LiteVLMError(f"{path.name}: TensorRT could not deserialize the engine")
            engines[graph] = engine
        batch = bundle.batch_graph() if stage == "decoder_batch" else None
        profile = profile_of(batch["buckets"], bucket) if batch is not None else None
        return CapturedEngine(engines[graph], path.name, inputs, outputs, pool, profile)

    sizes = bundle.sizes()
    sizes["eagle_draft"] = tuple(t for t in sizes["eagle_draft"] if any(
        g == bundle.graphs("eagle_draft")[t]["file"] for g in record["files"]))   # only draft graphs with engines
    batch = bundle.batch_graph()
    sizes["decoder_batch"] = (
        bundle.batch_sizes(rt.arena.limits.batch) if batch and batch["file"] in record["files"] else ()
    )
    return bound_engines(rt, sizes, bind, "tensorrt")
