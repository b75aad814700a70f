"""What a Q/DQ graph quantizes, and the proof that ONNX Runtime executes exactly that.

A Q/DQ graph (ModelOpt's FP8/INT8/INT4 ONNX, what TensorRT builds its low-precision engines from)
fixes where every tensor is rounded and how: `QuantizeLinear(x, scale, zero_point)` rounds x / scale
to the zero point's type (float8 e4m3fn: round to nearest even, saturating at +-448; int8: round
half to even, clamp to [-128, 127]; blocked int4 weights: DequantizeLinear with `block_size`) and
`DequantizeLinear` multiplies back. TensorRT fuses each pair into its low-precision kernels; ONNX
Runtime's CPU kernels execute the same nodes one by one. Three checks, `check_graph`:

1. Every pair, elementwise: the graph is run in ONNX Runtime with every QuantizeLinear's input and
   every DequantizeLinear's output added as graph outputs, and each DequantizeLinear output is
   compared with the rounding recomputed here in numpy with ml_dtypes' float8 e4m3fn (its own
   round-to-nearest-even implementation, independent of ONNX Runtime's): `mismatches` counts the
   elements that differ at all (exact comparison), out of `elements`.
2. The graph as the engine runs it (no outputs added, ORT_ENABLE_ALL, the backend's session
   options): its outputs against the run of check 1 (whose every pair was verified), against
   onnx's ReferenceEvaluator (pure numpy, its own float8 casts) and against the unquantized graph.
   An FP8 graph does not agree with another implementation to float precision: a 1e-7 difference
   in a matmul's summation order moves an activation across an FP8 rounding boundary, which changes
   that element by one FP8 step (1/16 relative), and the change propagates. So the report also
   counts the activation codes that differ between ONNX Runtime's run and the reference's (their
   share is the measure of that noise), beside the same comparison of the unquantized graphs.
3. What ONNX Runtime's optimizer leaves of the pairs: the optimized graph is saved and its pairs
   counted by kind (its QDQ propagation copies pairs across Transpose/Reshape, which is exact;
   an activation pair must remain, or the graph is not what was checked).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..engines.onnxruntime_engine import session_options
from ..errors import LiteVLMError

# onnx, onnxruntime and ml_dtypes are imported inside the functions that use them: each is heavy, and the
# check's tables (CHECK_HEADER, check_rows), which the command imports, need none of them.

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
# ONNX element type -> (name, qmin, qmax); float8 e4m3fn saturates at +-448
FP8_MAX = 448.0


def element_kinds() -> dict[int, tuple[str, float, float]]:
    from onnx import TensorProto as T

    return {T.FLOAT8E4M3FN: ("fp8", -FP8_MAX, FP8_MAX), T.INT8: ("int8", -128, 127), T.UINT8: ("uint8", 0, 255),
            T.INT4: ("int4", -8, 7), T.UINT4: ("uint4", 0, 15)}


@dataclass
class QdqPair:
    dq: object                     # the DequantizeLinear node
    q: object | None               # its QuantizeLinear (None: a weight stored already quantized)
    kind: str                      # "weight" (an initializer's) or "activation"
    dtype: str                     # fp8 | int8 | uint8 | int4 | uint4
    axis: int = 1
    block_size: int = 0

    @property
    def name(self) -> str:
        return self.dq.name or self.dq.output[0]


def _attr(node, name: str, default):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def qdq_pairs(model) -> list[QdqPair]:
    """Every DequantizeLinear of the graph with the QuantizeLinear that feeds it (if any), its
    element type and whether it quantizes a weight or an activation."""
    graph = model.graph
    made_by = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    # a weight: an initializer or Constant, or one reshaped/transposed/cast (ModelOpt quantizes the
    # Transpose of a Linear's weight that the exporter writes)
    consts = {o for n in graph.node if n.op_type == "Constant" for o in n.output} | set(inits)
    for n in graph.node:
        if n.op_type in ("Transpose", "Cast", "Identity", "Reshape") and n.input and n.input[0] in consts:
            consts.update(n.output)
    kinds = element_kinds()
    pairs = []
    for n in graph.node:
        if n.op_type != "DequantizeLinear":
            continue
        src = made_by.get(n.input[0])
        q = src if src is not None and src.op_type == "QuantizeLinear" else None
        typed = q.input[2] if q is not None and len(q.input) > 2 and q.input[2] else \
            (n.input[2] if len(n.input) > 2 and n.input[2] else n.input[0])
        if typed in inits:
            elem = inits[typed].data_type
        elif q is not None and _attr(q, "output_dtype", 0):
            elem = _attr(q, "output_dtype", 0)
        else:
            raise LiteVLMError(f"{n.name}: cannot tell the quantized element type (no zero point initializer)")
        origin = q.input[0] if q is not None else n.input[0]
        weight = origin in consts
        pairs.append(QdqPair(n, q, "weight" if weight else "activation", kinds[elem][0],
                             _attr(n, "axis", 1), _attr(n, "block_size", 0)))
    return pairs


def count_pairs(pairs: list[QdqPair]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in pairs:
        key = f"{p.dtype} {p.kind}" + (f" (block {p.block_size})" if p.block_size else "")
        out[key] = out.get(key, 0) + 1
    return out


def _broadcast(scale: np.ndarray, x: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """A DequantizeLinear scale (or zero point) shaped to x: per tensor, per axis, or per block."""
    if scale.ndim == 0 or scale.size == 1:
        return scale.reshape(())
    axis = axis % x.ndim
    if block_size:
        return np.repeat(scale, block_size, axis=axis)[tuple(slice(0, s) for s in x.shape)]
    shape = [1] * x.ndim
    shape[axis] = -1
    return scale.reshape(shape)


def fake_quantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, dtype: str, axis: int = 1,
                  block_size: int = 0) -> np.ndarray:
    """QuantizeLinear then DequantizeLinear of float32 x, as ONNX defines them, in numpy: x / scale
    in float32 (the kernels' own arithmetic), rounded to the element type, times scale."""
    import ml_dtypes

    s = _broadcast(np.asarray(scale, np.float32), x, axis, block_size)
    scaled = x.astype(np.float32) / s
    if dtype == "fp8":
        # ml_dtypes rounds to nearest even; e4m3fn has no infinity (out of range is NaN): saturate first
        codes = np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        return (codes * s).astype(np.float32)
    lo, hi = {"int8": (-128, 127), "uint8": (0, 255), "int4": (-8, 7), "uint4": (0, 15)}[dtype]
    zp = 0 if zero_point is None else _broadcast(np.asarray(zero_point, np.float32), x, axis, block_size)
    codes = np.clip(np.rint(scaled) + zp, lo, hi)           # np.rint: half to even
    return ((codes - zp) * s).astype(np.float32)


def dequantize(codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, axis: int, block_size: int):
    s = _broadcast(np.asarray(scale, np.float32), codes, axis, block_size)
    zp = 0 if zero_point is None else _broadcast(np.asarray(zero_point, np.float32), codes, axis, block_size)
    return ((codes.astype(np.float32) - zp) * s).astype(np.float32)


def _value(model, name: str) -> np.ndarray | None:
    from onnx import numpy_helper

    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            from onnx import helper

            return numpy_helper.to_array(helper.get_attribute_value(n.attribute[0]))
    return None


@dataclass
class GraphCheck:
    graph: str
    pairs: dict[str, int] = field(default_factory=dict)          # kind -> count in the graph
    checked: int = 0                                             # pairs compared elementwise
    elements: int = 0
    mismatches: int = 0
    worst_pair: str = ""
    worst_quanta: float = 0.0          # largest |ORT - recomputed| in units of that element's scale
    vs_checked: float = float("nan")    # the engine's outputs against the run whose pairs were checked
    vs_reference: float = float("nan")  # max |ORT - ReferenceEvaluator| / max |ReferenceEvaluator|
    float_vs_reference: float = float("nan")    # the same for the unquantized graph
    code_flips: int = 0                 # activation FP8 codes that differ between ORT's and the reference's run
    codes: int = 0
    vs_float: float = float("nan")      # max |quantized - unquantized| / max |unquantized|
    remaining: dict[str, int] = field(default_factory=dict)      # Q/DQ pairs in ORT's optimized graph


def _session(model_or_path, optimized: Path | None = None, threads: int = 1):
    import onnxruntime as ort

    opts = session_options(threads)
    if optimized is not None:
        opts.optimized_model_filepath = str(optimized)
    src = model_or_path if isinstance(model_or_path, (str, Path)) else model_or_path.SerializeToString()
    return ort.InferenceSession(str(src) if isinstance(src, Path) else src, opts, providers=["CPUExecutionProvider"])


def _with_pairs_as_outputs(model, pairs: list[QdqPair]):
    """A copy of `model` with every QuantizeLinear's input and DequantizeLinear's output added as
    graph outputs (check 1 reads both sides of each pair)."""
    import onnx

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    for p in pairs:
        for name in ([p.q.input[0]] if p.q is not None else []) + [p.dq.output[0]]:
            if name not in have:
                probe.graph.output.append(onnx.ValueInfoProto(name=name))
                have.add(name)
    return probe


def _check_pair(report: GraphCheck, model, p: QdqPair, got: dict[str, np.ndarray]) -> None:
    """One pair in one run `got` (every output by name): its DequantizeLinear output against the
    rounding recomputed here, counted into `report` (elements, mismatches, the worst in quanta)."""
    y = got[p.dq.output[0]]
    scale = _value(model, p.dq.input[1])
    zp = _value(model, p.dq.input[2]) if len(p.dq.input) > 2 and p.dq.input[2] else None
    if p.q is None:           # a stored weight: dequantized exactly
        want = dequantize(_value(model, p.dq.input[0]).astype(np.float32), scale, zp, p.axis, p.block_size)
    else:
        x = got[p.q.input[0]] if p.q.input[0] in got else _value(model, p.q.input[0])
        want = fake_quantize(x, scale, None if p.dtype == "fp8" else zp, p.dtype, p.axis, p.block_size)
    diff = np.abs(y.astype(np.float64) - want.astype(np.float64))
    report.checked += 1
    report.elements += diff.size
    report.mismatches += int((diff > 0).sum())
    quanta = float((diff / np.abs(_broadcast(np.asarray(scale, np.float32), y, p.axis, p.block_size))).max())
    if quanta > report.worst_quanta:
        report.worst_quanta, report.worst_pair = quanta, p.name


def _check_every_pair(model, pairs: list[QdqPair], feeds: list[dict[str, np.ndarray]], report: GraphCheck,
                      threads: int) -> list[dict[str, np.ndarray]]:
    """Check 1 over every feed, into `report`; returns each feed's run (every output by name), the
    run whose every pair was verified, which check 2 compares the engine's outputs with."""
    sess = _session(_with_pairs_as_outputs(model, pairs), threads=threads)
    names = [o.name for o in sess.get_outputs()]
    runs = []
    for feed in feeds:
        got = dict(zip(names, sess.run(None, feed)))
        runs.append(got)
        for p in pairs:
            _check_pair(report, model, p, got)
    report.checked //= len(feeds)
    return runs


def check_graph(path: Path, feeds: list[dict[str, np.ndarray]], float_path: Path | None = None,
                reference: bool = True, threads: int = 1) -> GraphCheck:
    """The three checks of the module docstring on a quantized graph `path` (external data next to
    it), over recorded inputs `feeds`; `float_path`: the same graph unquantized."""
    import onnx

    model = onnx.load(str(path), load_external_data=True)
    pairs = qdq_pairs(model)
    report = GraphCheck(path.name, count_pairs(pairs))
    if not pairs:
        return report
    # 1. every pair elementwise: Q inputs and DQ outputs exposed as outputs
    runs = _check_every_pair(model, pairs, feeds, report, threads)
    # 2. the graph as the engine runs it, against the reference evaluator and the float graph
    with tempfile.TemporaryDirectory() as tmp:
        optimized = Path(tmp) / "optimized.onnx"
        engine = _session(path, optimized=optimized, threads=threads)
        try:
            report.remaining = count_pairs(qdq_pairs(onnx.load(str(optimized), load_external_data=False)))
        except LiteVLMError as exc:       # a pair ORT rewrote beyond recognition: say so in the table
            report.remaining = {f"unreadable ({exc})": 1}
    outs = [o.name for o in engine.get_outputs()]
    quantized = [engine.run(None, f) for f in feeds]
    rel = lambda a, b: float(np.abs(a.astype(np.float64) - b).max() / max(1e-30, float(np.abs(b).max())))  # noqa: E731
    floats = lambda values: [v for v in values if v.dtype.kind == "f"]  # noqa: E731
    report.vs_checked = max(rel(q, got[o].astype(np.float64)) for qs, got in zip(quantized, runs)
                            for o, q in zip(outs, qs) if q.dtype.kind == "f")
    if reference:
        from onnx.reference import ReferenceEvaluator

        acts = [p for p in pairs if p.kind == "activation" and p.q is not None]
        ref = ReferenceEvaluator(model)
        for f, qs, got in zip(feeds, quantized, runs):
            values = ref.run(outs + [p.q.input[0] for p in acts], f)
            report.vs_reference = max(
                report.vs_reference if report.vs_reference == report.vs_reference else 0.0,
                *(rel(q, r.astype(np.float64)) for q, r in zip(floats(qs), floats(values[: len(outs)]))),
            )
            for p, x_ref in zip(acts, values[len(outs):]):
                scale = _value(model, p.q.input[1])
                a = fake_quantize(got[p.q.input[0]], scale, None, p.dtype) if p.dtype == "fp8" else None
                b = fake_quantize(np.asarray(x_ref, np.float32), scale, None, p.dtype) if p.dtype == "fp8" else None
                if a is not None:
                    report.code_flips += int((a != b).sum())
                    report.codes += a.size
        if float_path is not None:
            plain_model = onnx.load(str(float_path), load_external_data=True)
            plain_ref = ReferenceEvaluator(plain_model)
            plain = _session(float_path, threads=threads)
            report.float_vs_reference = max(rel(p, r.astype(np.float64)) for f in feeds for p, r in
                                            zip(floats(plain.run(outs, f)), floats(plain_ref.run(outs, f))))
    if float_path is not None:
        plain = _session(float_path, threads=threads)
        report.vs_float = max(rel(q, p.astype(np.float64)) for f, qs in zip(feeds, quantized)
                              for q, p in zip(floats(qs), floats(plain.run(outs, f))))
    return report


CHECK_HEADER = ["graph", "Q/DQ pairs", "elements checked", "differ", "engine vs checked run", "ORT vs reference",
                "(float graph)", "activation codes flipped", "quantized vs float", "pairs after ORT's optimizer"]


def check_rows(reports: list[GraphCheck]) -> list[list]:
    fmt = lambda d: ", ".join(f"{v} {k}" for k, v in sorted(d.items())) or "none"  # noqa: E731
    return [[r.graph, fmt(r.pairs), r.elements, r.mismatches, f"{r.vs_checked:.1e}", f"{r.vs_reference:.1e}",
             f"{r.float_vs_reference:.1e}", f"{r.code_flips}/{r.codes}", f"{r.vs_float:.1e}", fmt(r.remaining)]
            for r in reports if r.pairs]
