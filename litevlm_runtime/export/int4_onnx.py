"""INT4 AWQ ONNX as TensorRT 10 consumes it, from the project's one quantizer: one quantizer, two
executors.

`litevlm quantize --weights int4 --symmetric` (export/awq.py, weights/quantize.py) stores the
decoder's weights as group-wise INT4 with AWQ input scales; the PyTorch engines run them
(`backend.weights int4`, weights/lowbit.py). This module writes the *same* tensors into an export
bundle's graphs, in the form ModelOpt's INT4 AWQ ONNX has and TensorRT 10 builds weight-only INT4
engines from: every decoder product y = x @ W.T becomes

    Mul(x, pre_quant_scale [K])  ->  MatMul(., DequantizeLinear(codes [K, N] int4, scales [K/G, N],
                                                                axis=0, block_size=G))

(symmetric: signed int4 = stored code - 8, no zero point, float32 scales holding the stored float16
values exactly; asymmetric weights get uint4 codes with uint4 zero points, which ONNX Runtime runs
but TensorRT 10's block quantization does not: `build-engines` refuses them). Graph inputs,
outputs and everything else are unchanged, so the bundle binds like the float one.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import numpy as np

from ..engines.bundle import read_manifest, write_manifest
from ..engines.stages import DecoderStage, HeadStage
from ..errors import LiteVLMError
from ..weights.integrity import sha256_file
from ..weights.quantize import SYMMETRIC_ZERO, Int4Weight, load_quantized, unpack_nibbles
from .exporter import SharedWeights

# onnx is imported inside the functions that read or write graphs: it is heavy, and pack_int4 and the
# name mapping run without it.

INT4_STAGES = ("prefill", "decoder", "decoder_batch", "head")     # the graphs whose products the quantizer covers
STAGE_ROOT = {"prefill": "lm.", "decoder": "lm.", "decoder_batch": "lm.", "head": "head."}


def pack_int4(values: np.ndarray) -> bytes:
    """ONNX's 4-bit packing of values [..] in 0..15 (row-major, first element in the low nibble)."""
    flat = (np.asarray(values).reshape(-1) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()


def int4_tensor(name: str, values: np.ndarray, signed: bool):
    """An INT4 (signed: values -8..7) or UINT4 (0..15) initializer of values' shape."""
    from onnx import TensorProto

    t = TensorProto(name=name, data_type=TensorProto.INT4 if signed else TensorProto.UINT4, dims=list(values.shape))
    t.raw_data = pack_int4(values & 0x0F)            # two's complement nibbles for the signed type
    return t


def int4_initializers(name: str, w: Int4Weight) -> tuple[list, bool]:
    """(codes, scales[, zeros]) initializers of one weight in ModelOpt's [K, N] axis-0 layout, and
    whether it is symmetric."""
    from onnx import numpy_helper

    codes = unpack_nibbles(w.codes.cpu()).numpy().T.astype(np.int16)     # [K, N] stored codes 0..15
    scales = w.scales.cpu().float().numpy().T                              # [K/G, N], float16 values held exactly
    zeros = w.zeros.cpu().numpy().T.astype(np.int16)
    symmetric = bool((zeros == SYMMETRIC_ZERO).all())
    out = [int4_tensor(f"{name}_int4", codes - SYMMETRIC_ZERO if symmetric else codes, symmetric),
           numpy_helper.from_array(np.ascontiguousarray(scales), f"{name}_int4_scale")]
    if not symmetric:
        out.append(int4_tensor(f"{name}_int4_zero", zeros, False))
    return out, symmetric


def rewrite_graph(model, weights: dict[str, Int4Weight]) -> tuple[int, bool]:
    """Every Gemm (transB) / MatMul of the graph whose weight initializer is in `weights` (graph
    names) replaced by Mul -> MatMul(DequantizeLinear) in place; (count, all symmetric)."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name for t in graph.initializer}
    nodes, added, count, symmetric = [], [], 0, True
    for node in graph.node:
        weight = node.input[1] if len(node.input) > 1 else ""
        if node.op_type not in ("Gemm", "MatMul") or weight not in weights or weight not in inits:
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and (attrs.get("transA", 0) or not attrs.get("transB", 0)
                                       or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            raise LiteVLMError(f"{node.name}: a Gemm other than x @ W.T (+ b): {attrs}")
        if node.op_type == "MatMul":
            raise LiteVLMError(f"{node.name}: a MatMul on a [K, N] weight; the writer knows the exporter's Gemm form")
        w = weights[weight]
        tensors, sym = int4_initializers(weight, w)
        symmetric &= sym
        added += tensors
        x = node.input[0]
        if w.pre_quant_scale is not None:
            added.append(numpy_helper.from_array(w.pre_quant_scale.cpu().float().numpy(), f"{weight}_pre_quant_scale"))
            nodes.append(helper.make_node("Mul", [x, f"{weight}_pre_quant_scale"], [f"{weight}_scaled_input"],
                                          name=f"{node.name}_pre_quant_scale"))
            x = f"{weight}_scaled_input"
        dq_inputs = [t.name for t in tensors[:2]] + ([tensors[2].name] if len(tensors) > 2 else [])
        nodes.append(helper.make_node("DequantizeLinear", dq_inputs, [f"{weight}_dequantized"], name=f"{node.name}_dq",
                                      axis=0, block_size=w.group_size))
        out = node.output[0] if len(node.input) < 3 else f"{node.name}_product"
        nodes.append(helper.make_node("MatMul", [x, f"{weight}_dequantized"], [out], name=node.name))
        if len(node.input) >= 3 and node.input[2]:
            nodes.append(helper.make_node("Add", [out, node.input[2]], [node.output[0]], name=f"{node.name}_bias"))
        count += 1
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept + added)
    opset = next(o for o in model.opset_import if o.domain in ("", "ai.onnx"))
    opset.version = max(opset.version, 21)           # DequantizeLinear's block_size and int4 types
    return count, symmetric


def graph_weight_names(rt) -> dict[str, str]:
    """Stage graph initializer name -> module name under rt.model, for the INT4 stages (the stage
    modules' parameter names, as the exporter writes them, matched by identity)."""
    by_id = {id(m.weight): name for name, m in rt.model.named_modules() if hasattr(m, "weight")}
    out = {}
    for stage in (DecoderStage(rt.lm), HeadStage(rt.lm)):
        for pname, p in stage.named_parameters():
            if id(p) in by_id and pname.endswith(".weight"):
                out[pname] = by_id[id(p)]
    return out


def write_int4_bundle(rt, src_bundle: Path, quantized: Path, out: Path, progress=print,
                      keep_float: str = "") -> dict:
    """A new bundle in `out`: the fp32/fp16 export `src_bundle` with every decoder product (prompt,
    decode steps, batched step, LM head) replaced by the INT4 weights stored in `quantized`
    (`litevlm quantize` / modelopt_int4_weights); other graphs copied. `keep_float`: a regular
    expression on the graphs' weight names (re.search, as `calibrate --keep-float` for int8/fp8):
    the products it matches keep their float weights (a mixed configuration). Returns the manifest."""

    import onnx

    src_bundle, out = Path(src_bundle), Path(out)
    manifest = read_manifest(src_bundle)
    if manifest.get("precision"):
        raise LiteVLMError(f"{src_bundle}: already quantized ({manifest['precision']}); start from a float export")
    qmanifest, stored = load_quantized(quantized)
    if qmanifest.get("weights") not in ("int4", "int4-rtn"):
        raise LiteVLMError(f"{quantized}: holds {qmanifest.get('weights')} weights; the INT4 bundle needs int4")
    names = graph_weight_names(rt)
    skip = re.compile(keep_float) if keep_float else None
    by_graph_name = {g: stored[m] for g, m in names.items() if m in stored and isinstance(stored[m], Int4Weight)
                     and not (skip and skip.search(g))}
    if not by_graph_name:
        raise LiteVLMError(f"{quantized}: none of its modules is a product of {src_bundle}'s decoder graphs"
                           + (f" outside --keep-float {keep_float!r}" if keep_float else ""))
    out.mkdir(parents=True, exist_ok=True)
    shared: dict[str, SharedWeights] = {}
    graphs, symmetric_all = [], True
    for i, g in enumerate(manifest["graphs"]):
        t0 = time.perf_counter()
        if g["stage"] not in INT4_STAGES:
            shutil.copy2(src_bundle / g["file"], out / g["file"])
            if not (out / g["weights"]).is_file():
                shutil.copy2(src_bundle / g["weights"], out / g["weights"])
            graphs.append(dict(g, precision=manifest["dtype"]))
            continue
        model = onnx.load(str(src_bundle / g["file"]), load_external_data=True)
        count, symmetric = rewrite_graph(model, by_graph_name)
        symmetric_all &= symmetric
        group = g["weights"].removesuffix(".weights")
        if group not in shared:
            shared[group] = SharedWeights(out, group)
        shared[group].externalize(model)
        onnx.save(model, str(out / g["file"]))
        graphs.append(dict(g, precision="int4", sha256=sha256_file(out / g["file"]), int4_products=count))
        progress(f"[int4 {i + 1}/{len(manifest['graphs'])}] {g['file']:<22} {count} products INT4  "
                 f"{time.perf_counter() - t0:.1f} s")
    weights = {name: sha256_file(out / name) for name in {g["weights"] for g in graphs}}
    for g in graphs:
        if g["precision"] != "int4":
            g["sha256"] = sha256_file(out / g["file"])
    manifest.update(graphs=graphs, weights=weights, precision="int4", engines={},
                    quantization={"weights": str(quantized), "format": qmanifest["format"],
                                  "method": qmanifest.get("method"), "group_size": qmanifest.get("group_size"),
                                  "symmetric": symmetric_all, "source_bundle": str(src_bundle),
                                  "modules": len(by_graph_name), "keep_float": keep_float})
    write_manifest(out, manifest)
    return manifest
