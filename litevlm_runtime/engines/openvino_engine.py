"""OpenVINO engines: the export bundle's ONNX stage graphs (the same files ONNX Runtime runs, see
export.py), read by OpenVINO's ONNX front end and compiled for its CPU plugin, each input and
output bound once, at start-up, to the fixed torch buffers of bound_stages.py.

Binding: an ov.Tensor over each torch tensor's memory (shared, no copy) set on an InferRequest,
so OpenVINO reads and writes the same addresses on every call, as ONNX Runtime's io_binding
does. A graph file is read and compiled once and shared by its bindings: the step graphs bound
again over each KV region of a batch get one InferRequest each on the same CompiledModel, and
the batched step's graph (a dynamic batch dimension) one per batch bucket.

Weight compression (`backend.compress`): NNCF's weight-only compression of the read model before
it is compiled (nncf.compress_weights): int8 per output channel (asymmetric), or int4
group-wise (asymmetric, groups of GROUP_SIZE input channels, or the largest power of two that
divides a narrower layer's width). Activations stay float; OpenVINO's CPU plugin runs the
compressed MatMuls with its own low-bit kernels: its dynamic quantization of their activations
(int8 in groups of 32, on by default in OpenVINO 2026.4.1's CPU plugin) is turned off, because it
put the test checkpoint's prefill 1.5% off the compressed weights' own result (3-6e-4 without it),
so that what `compress` says is the only rounding an answer sees. It is done at load, on every start (a few
seconds for the bundled model, minutes for a 2B decoder: NNCF's own figure on this machine).

Precision: a float32 pipeline is compiled with INFERENCE_PRECISION_HINT f32, because OpenVINO's
CPU plugin would otherwise run bfloat16 on a CPU with bfloat16 units and the answers would no
longer be torch's.
"""

from __future__ import annotations

import logging

import torch

from ..errors import LiteVLMError
from .base import Engines
from .bound_stages import bound_engines
from .onnxruntime_engine import Bundle, bundle_path

log = logging.getLogger("litevlm.runtime")
COMPRESS_MODES = ("none", "int8", "int4")
# NNCF's default group size for int4 weights (nncf.compress_weights); Qwen2.5/InternLM2 widths
# (896, 1536, 2048, 4864, 8960) are multiples of it.
GROUP_SIZE = 128
ELEMENT_TYPES = (torch.float32, torch.float16, torch.int64, torch.bool)


def import_openvino():
    """OpenVINO (and NNCF below), an optional backend: imported where a backend asks for it, so that
    its absence is a clear error naming the package, not an import failure of the engines."""
    try:
        import openvino
    except ImportError:
        raise LiteVLMError("backend openvino: openvino is not installed (pip install openvino nncf)") from None
    return openvino


def compress_weights(model, mode: str, name: str):
    """The ov.Model with its MatMul weights compressed by NNCF (`mode` int8 | int4); NNCF's
    progress bar stays, its per-graph INFO tables go (one per graph file)."""
    try:
        import nncf
    except ImportError:
        raise LiteVLMError(f"backend.compress {mode}: nncf is not installed (pip install nncf)") from None
    log.info("backend.compress %s: NNCF compressing %s", mode, name)
    nncf.set_log_level(logging.WARNING)
    if mode == "int8":
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    if mode == "int4":
        from nncf.quantization.advanced_parameters import AdvancedCompressionParameters, GroupSizeFallbackMode

        # all_layers: a graph's first and last MatMul too (NNCF keeps them int8 by default; a
        # stage graph's "last" is arbitrary, the head graph's only one); a weight whose input width
        # is no multiple of the group gets the largest power-of-two group that divides it (ADJUST).
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_ASYM, group_size=GROUP_SIZE,
                                     ratio=1.0, all_layers=True, advanced_parameters=AdvancedCompressionParameters(
                                         group_size_fallback_mode=GroupSizeFallbackMode.ADJUST))
    raise LiteVLMError(f"{name}: backend.compress {mode!r} is not one of {', '.join(COMPRESS_MODES)}")


def compile_config(dtype: torch.dtype, threads: int | None) -> dict:
    """The CPU plugin's settings: one stream (the pipeline runs one call at a time), latency
    hint, no thread pinning (a shared CPU: pinned threads stall when another process takes the
    core), no dynamic quantization of activations (above), and float32 inference for a float32 pipeline."""
    config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "ENABLE_CPU_PINNING": "NO",
              "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    if dtype == torch.float32:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    return config


class OpenVinoGraph:
    """One bucket of a graph: an InferRequest of its compiled model with every input and
    output set to an ov.Tensor over a fixed torch tensor's memory."""

    def __init__(self, compiled, name: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]):
        ov = import_openvino()
        self.compiled = compiled
        # A port may carry several tensor names (the ONNX front end adds its own to an output):
        # each bound name must be one of its port's, every port bound.
        by_name = {}
        for ports, wanted in ((compiled.inputs, inputs), (compiled.outputs, outputs)):
            for port in ports:
                by_name.update({n: port for n in wanted if n in port.get_names()})
        if sorted(by_name) != sorted([*inputs, *outputs]) or len(compiled.inputs) + len(compiled.outputs) != len(
            by_name
        ):
            have = [sorted(p.get_names()) for p in [*compiled.inputs, *compiled.outputs]]
            raise LiteVLMError(f"{name}: graph has ports {have}, engine binds {list(inputs)} -> {list(outputs)}")
        self.request = compiled.create_infer_request()
        self.tensors = {**inputs, **outputs}        # keep the bound memory alive with the request
        for tensor_name, t in self.tensors.items():
            if not t.is_contiguous():
                raise LiteVLMError(f"{name}: {tensor_name} must be bound to contiguous memory")
            if t.dtype not in ELEMENT_TYPES or t.device.type != "cpu":
                raise LiteVLMError(f"backend openvino: {tensor_name} is {t.dtype} on {t.device} "
                                   f"(float32 or float16 on the CPU)")
            self.request.set_tensor(by_name[tensor_name], ov.Tensor(t.numpy(), shared_memory=True))

    def run(self) -> None:
        self.request.infer()


def openvino_engines(rt) -> Engines:
    ov = import_openvino()
    if rt.device.type != "cpu":
        raise LiteVLMError(f"backend openvino runs on the CPU here; device is {rt.options.device!r}")
    if rt.dtype not in (torch.float32, torch.float16):
        raise LiteVLMError(f"backend openvino: dtype {rt.options.dtype} is not supported (float32 or float16)")
    bundle = Bundle(rt, bundle_path(rt))
    mode = rt.options.backend.compress
    core = ov.Core()
    config = compile_config(rt.dtype, rt.options.threads())
    compiled: dict[str, object] = {}

    def bind(stage, bucket, inputs, outputs):
        file = bundle.graph_file(stage, bucket)
        if file not in compiled:
            model = core.read_model(str(bundle.dir / file))
            if mode != "none":
                model = compress_weights(model, mode, file)
            compiled[file] = core.compile_model(model, "CPU", config)
        return OpenVinoGraph(compiled[file], file, inputs, outputs)

    sizes = bundle.sizes()
    sizes["decoder_batch"] = bundle.batch_sizes(rt.arena.limits.batch)
    backend = "openvino" if mode == "none" else f"openvino[{mode}]"
    return bound_engines(rt, sizes, bind, backend)
