"""The decoder machinery InternLM2 and Qwen2 share: RMSNorm, RoPE, attention, SwiGLU, and the one
layer forward every backend runs. The two families differ only in how q/k/v are projected and what
the parameters are called (see internlm2.py, qwen2.py).

The layer forward is the export form (what ONNX Runtime, TensorRT and CUDA graphs run): the KV
cache is an input that is only read, and the layer returns the K/V rows of this call's tokens; the
caller stores them at their cache slots (engines/). Attention covers the old cache under
`mask_cache` [T, L] and this call's own rows under `mask_new` [T, T] in one softmax. Slots, RoPE
positions and masks are independent on purpose: token selection keeps original position ids in
compacted slots, EAGLE-2 verifies a tree in scratch slots under an ancestor mask, and training
packs several prefix trees into one sequence under a block mask (no cache at all).

The KV cache is two plain tensors, k and v, each [layers, kv_heads, max_len, head_dim], owned by
the memory arena; a call may pass a prefix view [:, :, :L] (eager torch reads only the live
columns) or the whole static cache (graphs, with the dead columns masked). With `arena.kv_dtype`
int8 or fp8 each is a QuantizedKV (kv_cache.py: 8-bit codes and a scale per head and row), which
indexes the same way and which attention reads dequantized.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import lowbit_kernels
from .config import LLMConfig
from .kv_cache import read as read_kv
from .rope import RotaryTable, apply_rope  # the rest of the code imports them from here


class Embedding(nn.Embedding):
    """The token embedding E [V, D]. A tied LM head (InternVL3/3.5) multiplies by the same table
    (`logits`); the low-bit forms of it (weights/lowbit.py, LowBitEmbedding) offer the same calls
    over one quantized copy, so every reader goes through these, never through `.weight`."""

    def lookup(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, D] = E[ids [T]], written in place (the arena's prompt buffer)."""
        torch.index_select(self.weight, 0, ids, out=out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> [..., V]: the tied head."""
        return hidden @ self.weight.T


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Upstream's order: normalise in float32, back to x's dtype, then the weight (F.rms_norm is
        # the same normalisation as one operator; its own weight product would round differently
        # in bf16/fp16). Eager float32 on the CPU kernels: one operator for all of it (layer_ops.cpp;
        # torch's composite ran seven, 35 us a call of a decode step).
        """x [..., D] -> normalised x [..., D]"""
        if on_layer_ops(x) and self.weight.dtype == torch.float32:
            return lowbit_kernels.rms_norm(x, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def on_layer_ops(x: torch.Tensor) -> bool:
    """Whether the layer's small operators on x run as the kernels' single calls (layer_ops.cpp:
    RMSNorm, RoPE in place, SwiGLU): eager, float32 on the CPU, kernels loaded, no gradient."""
    return not in_graph() and lowbit_kernels.takes_layer_ops(x)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rope to q [T, Hq, D] and k [T, Hkv, D]; on the kernels one call rotating both in place
    (bit-identical), which the layer may do: its q and k are views of its own fresh projection."""
    if on_layer_ops(q) and q.shape[-1] <= 1024:
        lowbit_kernels.rope_(q, k, cos, sin)
        return q, k
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [T, F]: one kernel call where it runs (no silu tensor in between)."""
    if on_layer_ops(gate) and gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1:
        return lowbit_kernels.silu_mul(gate, up)
    return F.silu(gate) * up


# Rows up to which a call whose rows are in the cache (LayerCall.rows_in_cache) attends by
# attend_few_rows (the kernels' attention_rows, else two matmuls): decode steps and EAGLE-2 trees of up
# to this many nodes; more rows take SDPA over the cache.
FEW_ROWS = 16


def grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [T, Hq, D] -> [Hkv, group*T, D], scaled by 1/sqrt(D): the query heads that share a KV head
    side by side, so grouped-query attention is plain matmuls (no K/V head is repeated; SDPA's
    enable_gqa does the same internally but does not export)."""
    t, hq, d = q.shape
    return (q * (1.0 / math.sqrt(d))).view(t, num_kv_heads, hq // num_kv_heads, d).permute(1, 2, 0, 3) \
        .reshape(num_kv_heads, -1, d)


def attention_probs(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Attention probabilities [Hq, Tq, Tk] of q [Tq, Hq, D] over k [Tk, Hkv, D] (post-RoPE) under
    `allowed` [Tq, Tk], in float32: the scores the token selector, FastV and the token selector's
    teacher rank visual tokens by (fp16 products over thousands of keys lose the ranking's low
    bits). The same numbers the layer's attention computes."""
    hkv = k.shape[1]
    t, hq, _ = q.shape
    scores = grouped(q.float(), hkv) @ k.float().permute(1, 2, 0)                 # [Hkv, group*Tq, Tk]
    scores = scores.view(hq, t, -1).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def in_graph() -> bool:
    """Whether this forward is being traced into a graph (torch.compile, torch.export under the ONNX
    export, a TorchScript trace) rather than run eagerly: a graph takes the exportable kernels and
    no data-dependent Python branch (attention here, the linears' oneDNN path in weights/gemm.py)."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()


CAUSAL_CHUNK_ROWS = (
    64  # rows per attention call of a causal prompt on the CPU (measured: 64 rows 1.28x, 128 rows 1.21x at 450 rows)
)


def in_chunks(mask_new: torch.Tensor) -> bool:
    """Whether `attend` may run this call's rows CAUSAL_CHUNK_ROWS at a time on the CPU: more rows
    than one chunk, and no row allowed to see a row of a later chunk (a prompt; an EAGLE-2 tree or a
    training pack may). Exactly the condition under which a chunk over the columns up to its own
    last row computes what one call over every column does. It reads about half the [T, T] mask
    (0.07 ms at 500 rows), so run_layers decides once per forward, not once per layer."""
    t, c = mask_new.shape[0], CAUSAL_CHUNK_ROWS
    if mask_new.device.type != "cpu" or t <= c or in_graph():
        return False
    return not any(bool(mask_new[s:s + c, s + c:].any()) for s in range(0, t - c, c))


def causal_prompt(mask_new: torch.Tensor, mask_cache) -> bool:
    """Whether a call's rows are a prompt the bfloat16 attention kernel takes (`attend`'s bf16): more than
    CAUSAL_CHUNK_ROWS rows, exactly causal among themselves (mask_new the lower triangle), every cached
    column visible to every row, eager on the CPU. Reads the masks once (run_layers decides per forward)."""
    t = mask_new.shape[0]
    if (mask_new.device.type != "cpu" or t <= CAUSAL_CHUNK_ROWS or in_graph() or isinstance(mask_cache, list)
            or mask_new.dim() != 2 or mask_new.shape[1] != t):
        return False
    if mask_cache is not None and not bool(mask_cache.all()):
        return False
    return bool(torch.equal(mask_new, torch.ones_like(mask_new).tril()))


class LayerCall(NamedTuple):
    """What run_layers decides once per forward for every layer it runs (the masks are the same in
    each): `chunks` in_chunks(mask_new) (None: attend decides); `bf16` the rows are a causal prompt over
    a cache they see whole (causal_prompt), so a layer with bf16_attention may run the kernels' bfloat16
    attention (a layer without it clears the flag); `probe(q, k)` reads a layer's post-RoPE q, k (the
    token selector's teacher); `rows_in_cache` the cache given ends with as many free rows as the call
    has, where `attend` writes the call's k, v and then reads the cache as it is (torch_engine.step_eager
    decides); `allowed` [T, L + T] the cache's and the call's masks side by side where every layer has the
    same (rows_in_cache: made once, not once a layer). A NamedTuple, not a dataclass: dynamo and
    torch.export trace it as the tuple it is."""
    chunks: bool | None = None
    bf16: bool = False
    probe: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    rows_in_cache: bool = False
    allowed: torch.Tensor | None = None


def allowed_columns(call: LayerCall, mask_cache, mask_new) -> torch.Tensor:
    """[T, L + T]: the cache's and the call's masks side by side, as run_layers made them once (call.allowed) or now."""
    return call.allowed if call.allowed is not None else torch.cat([mask_cache, mask_new], -1)


def attend(q, k, v, mask_new, k_cache=None, v_cache=None, mask_cache=None, call: LayerCall = LayerCall()
           ) -> torch.Tensor:
    """q [T, Hq, D] over this call's rows k, v [T, Hkv, D] (mask_new [T, T]) and, when given, this
    layer's old cache [Hkv, L, D] (mask_cache [T, L]): one softmax over both. Returns [T, Hq*D].
    A row must be allowed at least one column (its own, in every caller). `call.chunks`: in_chunks(mask_new),
    when the caller has it (None: decided here). `call.bf16`: the caller found the rows a causal prompt over
    a cache they see whole (causal_prompt) in a layer whose many-row GEMMs run bfloat16 or int8: the
    kernels' bfloat16 attention (kernels/lowbit_kernels.cpp: q, k, v rounded to bfloat16 as a bfloat16
    model holds them, float32 scores, softmax and sums; key blocks past a row's own never computed).

    Two kernels for the same attention: eager PyTorch (and CUDA-graph capture) call the fused
    scaled_dot_product_attention over [old cache | new rows] (measured 1.4x faster than the
    matmuls on the CPU, where small kernels dominate); an export (ONNX for ONNX Runtime and
    TensorRT) traces the grouped matmuls, since SDPA's enable_gqa does not export, and so does
    torch.compile: inductor fuses the mask and softmax around the two matmuls, while SDPA would
    first copy the whole static cache into the concatenation (a compiled decode step of the
    bundled model: 1.6x faster per step with the matmuls, 1.04x with SDPA, against eager in the
    same run; docs/performance.md). The numerics tests compare them (ONNX Runtime against
    torch, 1e-4; torch-compile against torch, 1e-5). A quantized cache (`arena.kv_dtype`,
    kv_cache.py) is read dequantized to q's dtype; this call's own rows are attended to in float."""
    if call.rows_in_cache:
        # The cache ends with this call's rows: written there, it is read as it is. Concatenating
        # [cache | new rows] instead copied the layer's whole cache every step (at a 2B model's
        # 1,780-row prompt, 3.6 MB a layer, ~100 MB a token).
        t, s = q.shape[0], k_cache.shape[1]
        k_cache.narrow(1, s - t, t).copy_(k.transpose(0, 1))
        v_cache.narrow(1, s - t, t).copy_(v.transpose(0, 1))
        allowed = allowed_columns(call, mask_cache, mask_new)
        if t <= FEW_ROWS:
            return attend_few_rows(q, k_cache, v_cache, allowed)
        return attend_over(q, k_cache, v_cache, allowed, call)
    if k_cache is not None:
        k_cache, v_cache = read_kv(k_cache, q.dtype), read_kv(v_cache, q.dtype)
    if k_cache is not None and k_cache.dim() == 4:
        return attend_batched(q, k, v, mask_new, k_cache, v_cache, mask_cache)
    if in_graph():
        return attend_grouped(q, k, v, mask_new, k_cache, v_cache, mask_cache)
    keys, values, allowed = k.transpose(0, 1), v.transpose(0, 1), mask_new
    if k_cache is not None:
        keys, values = torch.cat([k_cache, keys], 1), torch.cat([v_cache, values], 1)
        allowed = torch.cat([mask_cache, mask_new], -1)
    return attend_over(q, keys, values, allowed, call)


def attend_few_rows(q, keys, values, allowed) -> torch.Tensor:
    """A few rows (a decode step, a small draft tree) over the cache that holds them too: q [T, Hq, D],
    keys, values [Hkv, S, D], allowed [T, S] -> [T, Hq*D]: the kernels' float32 attention_rows where they
    run (lowbit_kernels.cpp), else two grouped matmuls and one softmax in float32. Why not SDPA, as every
    other eager call: torch's CPU flash kernel spends most of a decode step's attention on its blocking
    for one query row: at InternVL3-2B's heads (12 query, 2 KV, 128 wide), one thread, 963 against 460
    us a layer over 1,780 cached rows, 176 against 160 over 256."""
    if lowbit_kernels.takes_rows_attention(q):
        return lowbit_kernels.attention_rows(q, keys, values, allowed)
    t, hq, d = q.shape
    hkv = keys.shape[0]
    scores = (grouped(q, hkv) @ keys.transpose(1, 2)).view(hkv, hq // hkv, t, -1)
    probs = F.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min).float(), dim=-1).to(q.dtype)
    out = probs.view(hkv, -1, probs.shape[-1]) @ values                         # [Hkv, group*T, D]
    return out.view(hkv, hq // hkv, t, d).permute(2, 0, 1, 3).reshape(t, hq * d)


def attend_over(q, keys, values, allowed, call: LayerCall) -> torch.Tensor:
    """`attend`'s eager kernels: q [T, Hq, D] over keys, values [Hkv, L + T, D] (the old cache and this
    call's rows, in that order) under allowed [T, L + T] -> [T, Hq*D]."""
    queries = q.transpose(0, 1)[None]                                           # [1, Hq, T, D]
    t = q.shape[0]
    if call.bf16 and q.dtype == torch.float32 and lowbit_kernels.takes_attention(q.shape[-1]):
        old = allowed.shape[-1] - t
        return lowbit_kernels.attention_bf16(queries, keys[None], values[None], old)[0].transpose(0, 1).reshape(t, -1)
    if allowed.dim() == 2 and (in_chunks(allowed[:, -t:]) if call.chunks is None else call.chunks):
        # A prompt's rows see only earlier rows: CAUSAL_CHUNK_ROWS rows at a time, each over the
        # old cache and the new rows up to its own last, so the columns every row of a chunk has
        # masked are never computed (the CPU's flash kernel computes every column it is given and
        # masks after: a 450-row prompt's attention took 4.6 ms a layer whole, 3.3 ms in chunks).
        old = allowed.shape[1] - t
        out = queries.new_empty(queries.shape)
        for start in range(0, t, CAUSAL_CHUNK_ROWS):
            end = min(t, start + CAUSAL_CHUNK_ROWS)
            out[:, :, start:end] = F.scaled_dot_product_attention(
                queries[:, :, start:end], keys[None, :, :old + end], values[None, :, :old + end],
                attn_mask=allowed[start:end, :old + end], enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(queries, keys[None], values[None], attn_mask=allowed, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(t, -1)


def attend_batched(q, k, v, mask_new, k_cache, v_cache, mask_cache) -> torch.Tensor:
    """A batched decode step (batching.py): row b is one query's next token, q [B, Hq, D], k, v
    [B, Hkv, D], over its own KV region k_cache[b], v_cache[b] [Hkv, L, D] under mask_cache[b]
    [L] and its own new row (mask_new [B, B] is the identity: queries never see each other).
    Returns [B, Hq*D]. The same attention `attend` computes for one query, B of them in one
    kernel, each over L columns (a packed [B, B*L] mask would cost B times more). As in
    `attend`, eager PyTorch runs SDPA and an export or torch.compile the grouped matmuls
    (`attend_batched_grouped`), which never copy the region into a concatenation."""
    if in_graph():
        return attend_batched_grouped(q, k, v, mask_new, k_cache, v_cache, mask_cache)
    b = q.shape[0]
    keys = torch.cat([k_cache, k[:, :, None]], 2)                              # [B, Hkv, L + 1, D]
    values = torch.cat([v_cache, v[:, :, None]], 2)
    allowed = torch.cat([mask_cache, mask_new.diagonal()[:, None]], -1)[:, None, None, :]   # [B, 1, 1, L + 1]
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=allowed, enable_gqa=True)
    return out.reshape(b, -1)


def attend_batched_grouped(q, k, v, mask_new, k_cache, v_cache, mask_cache) -> torch.Tensor:
    """`attend_batched` written as grouped matmuls and one explicit softmax (the exported and
    compiled batched step): q [B, Hq, D], k, v [B, Hkv, D], k_cache, v_cache [B, Hkv, L, D],
    mask_cache [B, L], mask_new [B, B] (its diagonal: each row's own new key) -> [B, Hq*D].
    Query head h reads KV head h // group, as `grouped` lays them out."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k_cache.shape[2]
    qg = (q * (1.0 / math.sqrt(d))).view(b, hkv, hq // hkv, d)                 # [B, Hkv, group, D]
    own = (qg * k[:, :, None]).sum(-1, keepdim=True)                            # [B, Hkv, group, 1]
    scores = torch.cat([qg @ k_cache.transpose(-1, -2), own], dim=-1)          # [B, Hkv, group, L + 1]
    allowed = torch.cat([mask_cache, mask_new.diagonal()[:, None]], -1)[:, None, None, :]
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
    out = probs[..., :s] @ v_cache + probs[..., s:] * v[:, :, None]            # [B, Hkv, group, D]
    return out.reshape(b, hq * d)


def attend_grouped(q, k, v, mask_new, k_cache=None, v_cache=None, mask_cache=None) -> torch.Tensor:
    """`attend` written as grouped matmuls and one explicit softmax (what the exported graphs run)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qg = grouped(q, hkv)                                                        # [Hkv, group*T, D]
    k_new, v_new = k.transpose(0, 1), v.transpose(0, 1)                         # [Hkv, T, D]
    scores = qg @ k_new.transpose(1, 2)
    allowed = mask_new
    if k_cache is not None:
        scores = torch.cat([qg @ k_cache.transpose(1, 2), scores], dim=-1)
        allowed = torch.cat([mask_cache, mask_new], dim=-1)                     # [T, L + T]
    scores = scores.view(hkv, group, t, -1).masked_fill(~allowed, torch.finfo(scores.dtype).min)
    # Softmax in at least float32 (bf16/fp16 logits over thousands of keys), float64 stays float64.
    probs = F.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
    probs = probs.view(hkv, group * t, -1)
    if k_cache is None:
        out = probs @ v_new
    else:
        s = k_cache.shape[1]
        out = probs[..., :s] @ v_cache + probs[..., s:] @ v_new                 # [Hkv, group*T, D]
    return out.view(hkv, group, t, d).permute(2, 0, 1, 3).reshape(t, hq * d)


def project(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    """x [T, D] through each of `linears`, projections of that one input: their outputs [T, N_i]. Where
    weights/lowbit.fuse_projections stacked them into one low-bit form (`fused` on the first, naming
    exactly these modules), one call and a split: the same rows of the same weights, one kernel call."""
    fused = getattr(linears[0], "fused", None)
    if fused is not None and fused.sources == linears:
        return fused.module(x).split(fused.sizes, -1)
    return tuple(m(x) for m in linears)


def stacked(linears: tuple[nn.Module, ...]) -> nn.Module | None:
    """The one low-bit form `project` runs for `linears` (weights/lowbit.fuse_projections), None where they run
    apart."""
    fused = getattr(linears[0], "fused", None)
    return fused.module if fused is not None and fused.sources == linears else None


# decode_layer.cpp's layouts of a stacked q, k, v projection's output
QKV_SIDE_BY_SIDE = 0     # [q | k | v]: Qwen2, Qwen3 (weights/lowbit.fuse_projections)
QKV_GROUPED = 1          # per KV head [q_(g*h) .. q_(g*h+g-1), k_h, v_h]: InternLM2's wqkv


# Rows of a prompt the MLP takes per call at most in eager CPU runs (in_row_chunks): at InternVL3-2B
# widths a chunk's stacked gate/up output is then at most 27.5 MB, under glibc's largest mmap threshold.
MLP_CHUNK_ROWS = 384


def in_row_chunks(fn: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """fn over h [T, D] row by row (an MLP), in equal chunks of at most MLP_CHUNK_ROWS rows in eager CPU
    runs. Why: a 1,550-row prompt's stacked gate/up output is 111 MB at InternVL3-2B widths, above glibc
    malloc's mmap threshold (at most 32 MB): a fresh mapping in every layer, its pages faulted in and
    zeroed (torch's CPU allocator keeps no cache), where a chunk's ~22 MB is reused from the heap
    (prefill of 1,550 rows, int4, 2 threads, Zen 4: 8.47 -> 7.50 s). Equal chunks, so that none is small
    enough for the low-bit kernels' few-row path (GEMV_MAX_ROWS): every row then takes the GEMM it takes
    unchunked, and the int8 GEMM's rows are independent (the same numbers to the bit; tested)."""
    t = h.shape[0]
    if t <= MLP_CHUNK_ROWS or h.device.type != "cpu" or in_graph() or torch.is_grad_enabled():
        return fn(h)
    chunks = -(-t // MLP_CHUNK_ROWS)
    return torch.cat([fn(chunk) for chunk in h.split(-(-t // chunks))])


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU block. Subclasses define `qkv(x)`, `out_proj`, `mlp_gate_up_down`
    and the two norms under their upstream names, exposed through `attn_norm`/`ffn_norm`."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    bf16_attention = False      # a causal prompt's attention on the bfloat16 kernel (set with the prompt's GEMM)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] (normed) -> q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd]"""
        raise NotImplementedError

    def same_input(self) -> list[tuple[nn.Module, ...]]:
        """Groups of projections that read the same input (the low-bit forms may stack each into one
        call: weights/lowbit.fuse_projections); a layer with separate q, k, v adds them."""
        gate, up, _ = self.mlp_gate_up_down()
        return [(gate, up)]

    def query_key(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE q [T, Hq, D], k [T, Hkv, D] of the layer's attention (what selectors score)."""
        q, k, _ = self.qkv(self.attn_norm(x))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def forward(self, x, cos, sin, mask_new, k_cache=None, v_cache=None, mask_cache=None,
                call: LayerCall = LayerCall()):
        """x [T, D] -> (x [T, D], this call's k, v rows [Hkv, T, D]; None, None where call.rows_in_cache:
        attend stored them). `call`: what the caller decided for every layer (LayerCall; its bf16 holds
        here only where this layer's bf16_attention is set)."""
        if call.rows_in_cache and call.probe is None and x.shape[0] <= FEW_ROWS and on_layer_ops(x):
            step = self.step_args()
            if step is not None:                            # the layer as one kernel call (decode_layer.cpp)
                allowed = allowed_columns(call, mask_cache, mask_new)
                return lowbit_kernels.decode_layer(x, *step, k_cache, v_cache, allowed, cos, sin), None, None
        q, k, v = self.qkv(self.attn_norm(x))
        q, k = rotate(q, k, cos, sin)
        if call.probe is not None:
            call.probe(q, k)                                # the token selector's teacher reads q, k here
        if call.bf16 and not self.bf16_attention:
            call = call._replace(bf16=False)
        x = x + self.out_proj(attend(q, k, v, mask_new, k_cache, v_cache, mask_cache, call))
        x = x + in_row_chunks(self.mlp_forward, self.ffn_norm(x))
        if call.rows_in_cache:
            return x, None, None                            # attend wrote them into the cache
        return x, k.transpose(0, 1), v.transpose(0, 1)

    def qkv_stacked(self) -> tuple[nn.Module | None, int]:
        """The one projection giving q, k, v side by side and its layout for decode_layer.cpp (QKV_SIDE_BY_SIDE
        [q | k | v], QKV_GROUPED per KV head); (None, 0) where there is none (separate, unstacked projections)."""
        return None, QKV_SIDE_BY_SIDE

    def qk_norms(self) -> tuple[RMSNorm | None, RMSNorm | None]:
        """The per-head RMSNorms of q and k before RoPE (Qwen3), None where the layer has none."""
        return None, None

    def step_linears(self) -> tuple:
        """The projections decode_layer.cpp runs (qkv, out, gate_up, down; None where not stacked), the qkv layout."""
        qkv, layout = self.qkv_stacked()
        gate, up, down = self.mlp_gate_up_down()
        return qkv, self.out_proj, stacked((gate, up)), down, layout

    def step_args(self) -> tuple[list, list[int], float] | None:
        """The layer as decode_layer.cpp takes it (its tensors, integers and eps), or None where a part does not
        run on the kernels: a projection not a low-bit form on them (weights/lowbit.py: kernel_args), q, k, v or
        gate, up not stacked into one call, a norm not float32, a head size attention_rows does not take.
        Kept until the projections change (LinearForms.use swaps the forms as modules, fuse_projections
        restacks): building the lists took 23 of a layer's ~50 us of Python (2 threads, Zen 4)."""
        linears = self.step_linears()
        kept = self.__dict__.get("_step_args")
        if kept is None or kept[0] != linears:        # (modules compare by identity)
            kept = (linears, self.build_step_args(*linears))
            self.__dict__["_step_args"] = kept        # (past nn.Module's __setattr__: not a parameter or module)
        return kept[1]

    def build_step_args(self, qkv, out, gate_up, down, layout: int) -> tuple[list, list[int], float] | None:
        parts = [getattr(m, "kernel_args", lambda: None)() for m in (qkv, out, gate_up, down)]
        norms = [n for n in (self.attn_norm, self.ffn_norm, *self.qk_norms()) if n is not None]
        if (any(p is None for p in parts) or self.head_dim % 16
                or any(n.weight.dtype != torch.float32 or n.eps != self.attn_norm.eps for n in norms)):
            return None
        tensors = [n.weight for n in norms] + [None] * (4 - len(norms)) + [t for ts, _ in parts for t in ts]
        ints = [self.num_heads, self.num_kv_heads, self.head_dim, layout] + [i for _, form in parts for i in form]
        return tensors, ints, self.attn_norm.eps

    def mlp_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP: h [T, D] (normed) -> [T, D]."""
        gate, up, down = self.mlp_gate_up_down()
        g, u = project(h, (gate, up))
        return down(swiglu(g, u))


class CausalLM(nn.Module):
    """Shared stack forward. Subclasses build `embed`, `layers`, `norm`, `head` (upstream names);
    `rope` is the pipeline's one RotaryTable (set by whoever sizes it: runtime.py, training)."""

    cfg: LLMConfig
    rope: RotaryTable

    def init_rope(self, max_len: int) -> None:
        """The decoder's RotaryTable for positions < max_len (the arena's max_len in a pipeline),
        on the decoder's device; the token selector and the EAGLE-2 head share it."""
        device = self.norm.weight.device          # (the embedding may be a low-bit form: weights/lowbit.py)
        self.rope = RotaryTable(self.cfg, max_len).to(device)

    def run_layers(self, x, positions, mask_new, k_cache=None, v_cache=None, mask_cache=None, *,  # noqa: PLR0913
                   layers: range | None = None, probe=None, rows_in_cache: bool = False):
        """Layers `layers` (default all) over hidden states x [T, D]: (raw output [T, D], their new
        k, v rows [len(layers), Hkv, T, D]). `mask_cache` may be a list (one per layer, None = the
        shared one): FastV hides its dropped visual slots from layers >= K that way. `rows_in_cache`: the
        caches end with T free rows, where each layer writes its k, v (LayerCall); the rows are not
        returned then (None, None)."""
        cos, sin = self.rope(positions, x.dtype)
        layers = layers if layers is not None else range(len(self.layers))
        # The same mask in every layer: whether to chunk, and whether the rows are a causal prompt, decided once.
        prompt = any(self.layers[i].bf16_attention for i in layers) and causal_prompt(mask_new, mask_cache)
        shared_mask = rows_in_cache and isinstance(mask_cache, torch.Tensor)
        call = LayerCall(chunks=in_chunks(mask_new), bf16=prompt, rows_in_cache=rows_in_cache,
                         allowed=torch.cat([mask_cache, mask_new], -1) if shared_mask else None)
        ks, vs = [], []
        for i in layers:
            layer_mask = mask_cache[i] if isinstance(mask_cache, list) else mask_cache
            layer_call = call if probe is None else call._replace(probe=lambda q, k, i=i: probe(i, q, k))
            x, k, v = self.layers[i](x, cos, sin, mask_new,
                                     None if k_cache is None else k_cache[i],
                                     None if v_cache is None else v_cache[i], layer_mask, layer_call)
            ks.append(k)
            vs.append(v)
        if rows_in_cache:
            return x, None, None            # the layers wrote their rows into the cache
        return x, torch.stack(ks), torch.stack(vs)

    def forward(self, embeds, positions, mask_new, k_cache=None, v_cache=None, mask_cache=None, *,
                rows_in_cache: bool = False):
        """embeds [T, D] -> (final-norm hidden states [T, D] (the EAGLE-2 feature), new k, v rows
        [layers, Hkv, T, D]). No cache: a prompt (or a packed training sequence) on its own.
        `rows_in_cache`: see run_layers."""
        x, k, v = self.run_layers(embeds, positions, mask_new, k_cache, v_cache, mask_cache,
                                  rows_in_cache=rows_in_cache)
        return self.norm(x), k, v
