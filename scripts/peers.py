"""The engines a user would pick instead, side by side with this project on the same weights
(issue 35): random weights at InternVL3-2B's language-model widths (Qwen2.5-1.5B: 28 layers,
hidden 1536, intermediate 8960, 12 heads / 2 KV heads, vocabulary 151,674, tied embeddings),
written once as a transformers Qwen2 folder (safetensors), as GGUF and as OpenVINO IR, then
the same prompt ids (256 tokens) and a greedy decode of N tokens through every row, in
alternating rounds, each row in its own process (the float32 model is ~6.2 GB: only what a
round needs is alive; each row's peak RSS is in the table).

  rows   litevlm  this project's decoder and engines (engines/torch_engine.py) in each
                  `backend.weights` form named (--weights float,int8,int4: a form this checkout
                  does not have, or cannot build here, is skipped with the reason)
         transformers  Qwen2ForCausalLM over the same folder, float32 (the project's baseline)
         llama.cpp  llama-cpp-python over GGUF files written with the `gguf` package's GGUFWriter
                  (F32, F16, and Q8_0 / Q4_0 quantized by gguf's own quants module)
         openvino  an IR converted from the same weights, stateful KV cache, fp16 weights, and
                  NNCF int8 / int4 (group 128) weight compression
  table  decode ms/token per round (the mean over the N steps of that round), the best round,
         p50 / p99 of every step of every round (with --hog N each row runs beside N busy
         processes: the steadiness of each engine's threads on a shared CPU),
         prefill seconds (range over rounds), bytes a decode step reads (weights + KV cache at
         the mean context), the floor those bytes allow at the memory bandwidth measured in
         the same run (bench/roofline.py's STREAM-like kernels at the same thread count,
         between rounds), the best round's fraction of that floor, the greedy ids' agreement
         with this project's float32 row, and each row's peak RSS

Slow (minutes per round) and not in CI. The peers are optional extras of the set-up:
    bash scripts/setup.sh --peers      (requirements-peers.txt: gguf, llama-cpp-python built
                                        from source for this CPU, about 20 minutes on 2 cores)
    .venv/bin/python scripts/peers.py --work /tmp/peers --tokens 32 --rounds 3

Why hand-written pieces here: the GGUF metadata and tensor names of a Qwen2 model are what
llama.cpp's convert_hf_to_gguf.py writes (that script is in llama.cpp's repository, in no
wheel); the OpenVINO IR is converted from a plain export form of the same decoder (SDPA, KV
cache as concatenated state) and made stateful with OpenVINO's own transformation, as
optimum-intel does, because optimum-intel needs torchvision (a CUDA torch from the index) and
transformers < 5.6 (the project runs 5.x).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import litevlm_runtime  # noqa: F401  (before torch, imported in the steps: OMP_WAIT_POLICY=PASSIVE, threads.py)

HF_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
    "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
    "num_key_value_heads": 2, "vocab_size": 151674, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_sliding_window": False, "torch_dtype": "float32",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
GGUF_FORMS = ("f32", "f16", "q8_0", "q4_0")
OPENVINO_FORMS = ("fp16", "int8", "int4")
ENGINES = ("litevlm", "transformers", "llama.cpp", "openvino")


# ----------------------------------------------------------------------------- the weights
def read_config(work: Path) -> dict:
    return json.loads((work / "hf" / "config.json").read_text())


def llm_config(hf: dict):
    from litevlm_runtime.models.config import LLMConfig

    return LLMConfig(architecture="qwen2", hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
                     num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf["num_key_value_heads"],
                     num_hidden_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
                     rms_norm_eps=hf["rms_norm_eps"], rope_theta=hf["rope_theta"], tie_word_embeddings=True)


def write_weights(work: Path, seed: int, layers: int) -> None:
    """The random model as a transformers Qwen2 folder (config.json + model.safetensors, float32):
    the project's own initialisation (weights/random_init.py), plus small random biases so that
    the q/k/v bias path of every converter is exercised (zero biases would hide a dropped one)."""
    import torch
    from safetensors.torch import save_file

    from litevlm_runtime.models.qwen2 import Qwen2ForCausalLM
    from litevlm_runtime.weights.random_init import init_weights

    config = dict(HF_CONFIG, num_hidden_layers=layers)
    lm = Qwen2ForCausalLM(llm_config(config))
    init_weights(lm, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=g)
    folder = work / "hf"
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in lm.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def load_litevlm(work: Path, dtype=None):
    """The project's Qwen2 decoder over the folder's weights (built on the meta device, the
    tensors assigned: one copy in memory). dtype: cast each tensor as it is assigned."""
    import torch
    from safetensors import safe_open

    from litevlm_runtime.models.qwen2 import Qwen2ForCausalLM

    with torch.device("meta"):
        lm = Qwen2ForCausalLM(llm_config(read_config(work)))
    state = {}
    with safe_open(str(work / "hf" / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            state[name] = t.to(dtype) if dtype is not None and t.ndim == 2 else t
    lm.load_state_dict(state, assign=True, strict=True)
    return lm.eval()


# GGUF: llama.cpp's names for a Qwen2 decoder (convert_hf_to_gguf.py's tensor map, gguf.TENSOR_NAMES).
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, n, rest = hf_name.split(".", 3)          # model.layers.N.<rest>
    return f"blk.{n}.{GGUF_NAMES[rest]}"


def write_gguf(work: Path, form: str) -> Path:
    """The folder's weights as GGUF in `form` (f32 | f16 | q8_0 | q4_0: every 2-D weight, the tied
    embedding/head included; norms and biases stay F32, as llama.cpp needs), streamed tensor by
    tensor (GGUFWriter's header, then write_tensor_data): memory stays one tensor's."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from safetensors import safe_open

    qtype = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[form]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[form]
    out = work / f"model-{form}.gguf"
    c = read_config(work)
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name("random Qwen2.5-1.5B widths (litevlm scripts/peers.py)")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # A vocabulary of the model's size: the rows run on token ids, never on text, but llama.cpp
    # loads a BPE vocabulary (tokens, types, at least one merge) to size its checks by it.
    vocab = c["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges(["<t1> <t2>"])
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    with safe_open(str(work / "hf" / "model.safetensors"), framework="np") as f:
        names = list(f.keys())

        def converted(name):
            t = f.get_tensor(name).astype(np.float32)
            if t.ndim == 1 or qtype == Q.F32:
                return t, None
            if qtype == Q.F16:
                return t.astype(np.float16), None
            return gguf.quants.quantize(t, qtype), qtype

        for name in names:                      # header: every tensor's name, shape, type and size
            shape = f.get_slice(name).get_shape()
            kind = Q.F32 if len(shape) == 1 else qtype
            nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(shape, kind))) if kind not in (Q.F32, Q.F16) \
                else int(np.prod(shape)) * (4 if kind == Q.F32 else 2)
            if kind in (Q.F32, Q.F16):
                w.add_tensor_info(gguf_name(name), shape, np.dtype(np.float32 if kind == Q.F32 else np.float16), nbytes)
            else:
                w.add_tensor_info(gguf_name(name), gguf.quant_shape_to_byte_shape(shape, kind), np.dtype(np.uint8),
                                  nbytes, raw_dtype=kind)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, name in enumerate(names):
            data, _ = converted(name)
            w.write_tensor_data(data)
            if i % 40 == 0:
                print(f"  gguf {form}: {i + 1}/{len(names)} tensors", file=sys.stderr, flush=True)
    w.close()
    return out


def write_openvino(work: Path, form: str) -> Path:
    """The folder's weights as an OpenVINO IR (`form` fp16 | int8 | int4): the export form below
    converted by ov.convert_model, its KV cache made state (ReadValue/Assign) by OpenVINO's own
    make-stateful transformation, weights stored fp16; int8 / int4 from that fp16 IR (when
    written first) by NNCF weight compression: int8 per channel, asymmetric; int4 in groups of
    128, asymmetric, NNCF's defaults (its backup precision int8 for the embedding/head)."""
    import openvino as ov

    fp16 = work / "openvino-fp16" / "model.xml"
    model = ov.Core().read_model(str(fp16)) if form != "fp16" and fp16.is_file() else convert_to_openvino(work)
    if form != "fp16":
        import nncf

        mode = {"int8": nncf.CompressWeightsMode.INT8_ASYM, "int4": nncf.CompressWeightsMode.INT4_ASYM}[form]
        kwargs = {"group_size": 128, "ratio": 1.0} if form == "int4" else {}
        model = nncf.compress_weights(model, mode=mode, **kwargs)
    out = work / f"openvino-{form}" / "model.xml"
    out.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(out), compress_to_fp16=True)
    return out


def convert_to_openvino(work: Path):
    """The stateful ov.Model of the folder's weights (fp16 constants widened in the graph)."""
    import openvino as ov
    import torch
    from openvino._offline_transformations import apply_make_stateful_transformation

    lm = load_litevlm(work, dtype=torch.float16)
    export = stateful_export_form(lm)
    layers, kv, hd = lm.cfg.num_hidden_layers, lm.cfg.num_key_value_heads, lm.cfg.head_dim
    past = [torch.zeros(1, kv, 2, hd) for _ in range(2 * layers)]
    example = (torch.zeros(1, 3, dtype=torch.long), torch.arange(2, 5)[None], *past)
    shapes = [ov.PartialShape([1, -1]), ov.PartialShape([1, -1])] + [ov.PartialShape([1, kv, -1, hd])] * (2 * layers)
    with torch.no_grad():
        model = ov.convert_model(export, example_input=example, input=shapes)
    names_in = ["input_ids", "position_ids"] + [f"past_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    names_out = ["logits"] + [f"present_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
    for port, name in zip(model.inputs, names_in):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, names_out):
        port.get_tensor().set_names({name})
    apply_make_stateful_transformation(model, dict(zip(names_in[2:], names_out[1:])))
    return model


def stateful_export_form(lm):
    """The export form of `lm` for ov.convert_model (the class is defined here, where torch is
    imported: the parent process imports torch only after litevlm_runtime has set OpenMP's wait
    policy)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from litevlm_runtime.models.rope import RotaryTable, apply_rope

    def rms(x, norm):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()

    class StatefulExportForm(nn.Module):
        """input_ids [1, T], position_ids [1, T], past k/v per layer [1, Hkv, P, D] -> logits of
        the last row [1, V], present k/v [1, Hkv, P + T, D]. The project's Qwen2 weights (fp16,
        widened in the graph: the IR keeps them fp16) and its RoPE table; attention as SDPA over
        the concatenated cache, the pattern OpenVINO's CPU plugin fuses with its stateful KV."""

        def __init__(self, lm):
            super().__init__()
            self.lm = lm
            self.rope = RotaryTable(lm.cfg, 4096)

        def forward(self, input_ids, position_ids, *past):
            lm, cfg = self.lm, self.lm.cfg
            x = F.embedding(input_ids[0], lm.embed.weight).float()                  # [T, D]
            t, groups = x.shape[0], cfg.num_attention_heads // cfg.num_key_value_heads
            cos, sin = self.rope(position_ids[0], torch.float32)
            presents = []
            for i, layer in enumerate(lm.layers):
                a, m = layer.self_attn, layer.mlp
                h = rms(x, layer.input_layernorm)
                q, k, v = (F.linear(h, p.weight.float(), p.bias.float()).view(t, -1, cfg.head_dim)
                           for p in (a.q_proj, a.k_proj, a.v_proj))
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                k = torch.cat([past[2 * i], k.transpose(0, 1)[None]], 2)            # [1, Hkv, P + T, D]
                v = torch.cat([past[2 * i + 1], v.transpose(0, 1)[None]], 2)
                presents += [k, v]
                seen = k.shape[2]
                mask = torch.arange(seen)[None, :] <= (seen - t + torch.arange(t))[:, None]
                o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.repeat_interleave(groups, 1),
                                                   v.repeat_interleave(groups, 1), attn_mask=mask)
                x = x + F.linear(o[0].transpose(0, 1).reshape(t, -1), a.o_proj.weight.float())
                h = rms(x, layer.post_attention_layernorm)
                x = x + F.linear(
                    F.silu(F.linear(h, m.gate_proj.weight.float())) * F.linear(h, m.up_proj.weight.float()),
                    m.down_proj.weight.float(),
                )
            return (F.linear(rms(x[-1:], lm.norm), lm.embed.weight.float()), *presents)

    return StatefulExportForm(lm)


# ----------------------------------------------------------------------------- one row, one process
@dataclass
class RowResult:
    engine: str
    weights: str
    ids: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_ms: float = 0.0          # mean ms per greedy step over the round's N steps
    step_ms: list[float] = field(default_factory=list)     # each of those steps
    weight_bytes: int = 0           # bytes of weights one decode step reads
    kv_bytes_per_column: int = 0    # bytes of KV cache per cached position a step reads
    load_s: float = 0.0
    peak_rss_gb: float = 0.0
    skipped: str = ""
    forced: bool = False            # fed the reference row's tokens (teacher forcing)


def kv_per_column(c: dict, element_bytes: int) -> int:
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * (c["hidden_size"] // c["num_attention_heads"]) \
        * element_bytes


def drive(res: RowResult, start, step, prompt: list[int], tokens: int, forced: list[int] | None) -> RowResult:
    """The measured run of one row: `start(prompt)` (a fresh cache, the prompt in one call) ->
    the greedy id after it; `step(token, position)` (one row over the cache) -> the next greedy
    id. A warm-up of the same prompt and two steps first (first-call costs: an engine's kernels
    for a new shape, allocations), then the prompt timed (prefill_s) and `tokens` steps timed
    (decode_ms: their mean; step_ms: each)."""
    token = start(prompt)
    for position in range(len(prompt), len(prompt) + 2):
        token = step(token, position)
    t0 = time.perf_counter()
    res.ids.append(start(prompt))
    res.prefill_s = time.perf_counter() - t0
    for position in range(len(prompt), len(prompt) + tokens):
        t0 = time.perf_counter()
        res.ids.append(step(fed(res.ids, forced), position))
        res.step_ms.append((time.perf_counter() - t0) * 1000)
    res.decode_ms = sum(res.step_ms) / tokens
    return res


def fed(ids: list[int], forced: list[int] | None) -> int:
    """The token the next step is fed: the row's own greedy choice (ids[-1]), or with `forced`
    (the reference row's ids) the reference's, so that every step of every row is compared
    with the reference on the same inputs (teacher forcing; the cost of a step is the same)."""
    return forced[len(ids) - 1] if forced else ids[-1]


def run_litevlm(work: Path, weights: str, prompt: list[int], tokens: int, threads: int,
                forced: list[int] | None) -> RowResult:
    """This project's decoder through its torch engines (TorchDecoder/TorchHead: what `backend.name
    torch` runs) over a static KV cache, its linears in the `backend.weights` form `weights`."""
    import torch
    from torch import nn

    from litevlm_runtime.engines.torch_engine import TorchDecoder, TorchHead
    from litevlm_runtime.pipeline.runtime import set_threads
    from litevlm_runtime.weights import linear_forms
    from litevlm_runtime.weights.gemm import resolve_gemm, use_onednn

    res = RowResult("litevlm", weights)
    if weights not in linear_forms.WEIGHT_KINDS:
        res.skipped = f"backend.weights {weights} is not in this checkout ({', '.join(linear_forms.WEIGHT_KINDS)})"
        return res
    set_threads(threads)
    t0 = time.perf_counter()
    lm = load_litevlm(work)

    class Holder(nn.Module):            # what convert_linears reads: a model with .language_model
        def __init__(self, lm):
            super().__init__()
            self.language_model = lm

    if weights != "float":
        try:
            linear_forms.convert_linears(Holder(lm), weights)
        except Exception as exc:        # a form that needs what this bench has not (calibration data)
            res.skipped = f"backend.weights {weights}: {type(exc).__name__}: {exc}"
            return res
    if resolve_gemm("auto", "cpu", torch.float32) == "onednn":
        use_onednn([lm])
    max_len = len(prompt) + tokens + 8
    lm.init_rope(max_len)
    cfg = lm.cfg
    k_cache = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, max_len, cfg.head_dim)
    v_cache = torch.zeros_like(k_cache)
    decoder, head = TorchDecoder(lm, k_cache, v_cache), TorchHead(lm)
    res.load_s = time.perf_counter() - t0
    res.weight_bytes = step_weight_bytes(lm)
    res.kv_bytes_per_column = kv_per_column(read_config(work), 4)
    one = torch.ones(1, 1, dtype=torch.bool)

    def start(ids):
        t = len(ids)
        hidden = decoder.prefill(
            lm.embed(torch.tensor(ids)), torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril_()
        )
        return int(head.run(hidden[-1:]).argmax(-1))

    def step(token, position):
        hidden = decoder.step(lm.embed(torch.tensor([token])), torch.tensor([position]), torch.tensor([position]),
                              torch.ones(1, position, dtype=torch.bool), one)
        return int(head.run(hidden).argmax(-1))

    with torch.inference_mode():
        return drive(res, start, step, prompt, tokens, forced)


def step_weight_bytes(lm) -> int:
    """Bytes of the weights one decode step reads: every layer, the final norm and the LM head
    (a tied head reads the whole embedding table: the float nn.Embedding's, or under a low-bit
    `backend.weights` the one LowBitEmbedding copy the head and the lookup share; a head module
    its own weights)."""
    from torch import nn

    from litevlm_runtime.weights.linear_forms import weight_bytes

    modules = list(lm.layers) + [lm.norm]
    head = getattr(lm, "lm_head", None)
    return weight_bytes(modules + [head if isinstance(head, nn.Module) else lm.embed])


def run_transformers(work: Path, weights: str, prompt: list[int], tokens: int, threads: int,
                     forced: list[int] | None) -> RowResult:
    """transformers' Qwen2ForCausalLM on the same folder: its forward with its own KV cache,
    one token at a time (what generate runs, without its sampling machinery)."""
    import torch
    from transformers import Qwen2ForCausalLM

    res = RowResult("transformers", weights)
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = Qwen2ForCausalLM.from_pretrained(str(work / "hf"), dtype=torch.float32).eval()
    res.load_s = time.perf_counter() - t0
    res.weight_bytes = sum({p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}.values())
    res.kv_bytes_per_column = kv_per_column(read_config(work), 4)
    state = {}

    def start(ids):
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        state["name"] = "cache" if hasattr(out, "cache") else "past_key_values"    # transformers 5.25 renamed it
        state["cache"] = getattr(out, state["name"])
        return int(out.logits[0, -1].argmax())

    def step(token, position):
        out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{state["name"]: state["cache"]})
        state["cache"] = getattr(out, state["name"])
        return int(out.logits[0, -1].argmax())

    with torch.inference_mode():
        return drive(res, start, step, prompt, tokens, forced)


def run_llama_cpp(work: Path, weights: str, prompt: list[int], tokens: int, threads: int,
                  forced: list[int] | None) -> RowResult:
    """llama-cpp-python over the GGUF file: the prompt in one batch, then one token per decode,
    greedy over the logits llama.cpp returns (F16 KV cache, its default)."""
    import gguf
    import llama_cpp
    import numpy as np

    res = RowResult("llama.cpp", weights)
    path = work / f"model-{weights}.gguf"
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + tokens + 16, n_batch=len(prompt),
                          n_ubatch=len(prompt), n_threads=threads, n_threads_batch=threads, verbose=False)
    res.load_s = time.perf_counter() - t0
    res.weight_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    res.kv_bytes_per_column = kv_per_column(read_config(work), 2)
    vocab = llm.n_vocab()

    def greedy():
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).argmax())

    def start(ids):
        llm.reset()                          # n_tokens 0: eval drops the cache past it
        llm.eval(ids)
        return greedy()

    def step(token, position):
        llm.eval([token])
        return greedy()

    return drive(res, start, step, prompt, tokens, forced)


def run_openvino(work: Path, weights: str, prompt: list[int], tokens: int, threads: int,
                 forced: list[int] | None) -> RowResult:
    """OpenVINO's CPU plugin over the stateful IR: its own KV cache (state), reset per prompt."""
    import numpy as np
    import openvino as ov

    res = RowResult("openvino", weights)
    xml = work / f"openvino-{weights}" / "model.xml"
    t0 = time.perf_counter()
    compiled = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_NUM_THREADS": str(threads),
                                                         "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"})
    request = compiled.create_infer_request()
    res.load_s = time.perf_counter() - t0
    res.weight_bytes = xml.with_suffix(".bin").stat().st_size
    kv_type = str(compiled.get_property("KV_CACHE_PRECISION"))
    res.kv_bytes_per_column = kv_per_column(read_config(work), {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i8": 1}
                                            .get(kv_type, 2))

    def infer(ids, positions):
        request.infer({"input_ids": np.array([ids], dtype=np.int64),
                       "position_ids": np.array([positions], dtype=np.int64)})
        return int(request.get_tensor("logits").data[0].argmax())

    def start(ids):
        request.reset_state()
        return infer(ids, list(range(len(ids))))

    def step(token, position):
        return infer([token], [position])

    return drive(res, start, step, prompt, tokens, forced)


RUNNERS = {"litevlm": run_litevlm, "transformers": run_transformers, "llama.cpp": run_llama_cpp,
           "openvino": run_openvino}


# ----------------------------------------------------------------------------- orchestration
def peak_rss_gb() -> float:
    """This process's peak resident set (VmHWM: reset by exec, unlike getrusage's ru_maxrss,
    which a child started by fork + exec inherits from its parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2 ** 20
    return 0.0


def child(args: list[str], log: Path) -> dict:
    """Run this script's step in a fresh process; its last stdout line is its JSON result."""
    cmd = [sys.executable, __file__, *args]
    with open(log, "a") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (exit {proc.returncode}); see {log}:\n"
                           + "".join(log.read_text().splitlines(keepends=True)[-15:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def prepare(work: Path, seed: int, layers: int, gguf_forms, openvino_forms, log: Path,
            progress) -> list[tuple[str, float]]:
    """Every weight file the rows need, each written in its own process (skipped when present,
    from an earlier run with the same seed and widths)."""
    stamp = work / "made-with.json"
    wanted = {"seed": seed, "config": dict(HF_CONFIG, num_hidden_layers=layers)}
    if stamp.is_file() and json.loads(stamp.read_text()) != wanted:
        raise SystemExit(f"{work} holds weights of another --seed/--layers ({stamp}): give another --work or empty it")
    stamp.write_text(json.dumps(wanted))
    steps = [("weights", work / "hf" / "model.safetensors")]
    steps += [(f"gguf:{f}", work / f"model-{f}.gguf") for f in gguf_forms]
    steps += [(f"openvino:{f}", work / f"openvino-{f}" / "model.xml") for f in openvino_forms]
    peaks = []
    for step, path in steps:
        if path.is_file():
            continue
        progress(f"writing {step} -> {path}")
        t0 = time.perf_counter()
        out = child(["--step", step, "--work", str(work), "--seed", str(seed), "--layers", str(layers)], log)
        peaks.append((step, out["peak_rss_gb"]))
        size = sum(f.stat().st_size for f in path.parent.iterdir()) if path.suffix == ".xml" else path.stat().st_size
        progress(f"  {step}: {time.perf_counter() - t0:.0f} s, peak RSS {out['peak_rss_gb']:.1f} GB, "
                 f"{size / 1e9:.2f} GB on disk")
    return peaks


def measure_bandwidth_gbs(threads: int) -> tuple[float, float]:
    """(read, best of read/copy/triad) GB/s over a 2 GiB working set at `threads` threads:
    bench/roofline.py's kernels, so that the floors are the ones `litevlm bench --roofline` uses."""
    import torch

    from litevlm_runtime.bench.roofline import CAP_BYTES, measure_bandwidth

    torch.set_num_threads(threads)
    bw = measure_bandwidth(CAP_BYTES)
    return bw.read_gbs, bw.best_gbs


def cpu_line() -> str:
    from litevlm_runtime.weights.cpuinfo import read_cpuinfo

    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = (read_cpuinfo() or ("", []))[1]
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8"]
    return f"{model}; flags: " + " ".join(f for f in wanted if f in flags) + f"; {os.cpu_count()} CPUs"


def agreement(run: dict, ref: list[int]) -> str:
    """How many of a row's greedy choices equal the reference's: under teacher forcing (the row
    fed the reference's tokens) step by step, all equal = the same greedy answer; a row that ran
    free (before the reference existed) by its common prefix."""
    ids = run["ids"]
    if run.get("forced"):
        return f"{sum(a == b for a, b in zip(ids, ref))}/{len(ref)} steps"
    same = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
    return f"first {same}/{len(ref)} (free)"


def table(rows: list[list[str]], headers: list[str]) -> str:
    from litevlm_runtime.report import table as render

    return render(headers, rows)


def summarize(results: dict[tuple[str, str], list[dict]], bandwidth: list[tuple[float, float]], prompt_len: int,
              tokens: int) -> tuple[str, dict]:
    """The table of issue 35, plus each row's bytes per token, floor and fraction of it."""
    from litevlm_runtime.timing import percentile

    best_bw = max(b for _, b in bandwidth)
    ref_key = reference_row(list(results))
    ref_ids = results[ref_key][0]["ids"] if results[ref_key] and not results[ref_key][0]["skipped"] else []
    context = prompt_len + tokens / 2                  # the mean number of cached positions a step reads
    rows, summary = [], {}
    for (engine, weights), runs in results.items():
        done = [r for r in runs if not r["skipped"]]
        if not done:
            rows.append([engine, weights, f"skipped: {runs[0]['skipped']}"] + [""] * 9)
            continue
        per_round = [r["decode_ms"] for r in done]
        best = min(per_round)
        nbytes = done[0]["weight_bytes"] + done[0]["kv_bytes_per_column"] * context
        floor = nbytes / (best_bw * 1e9) * 1000
        prefill = [r["prefill_s"] for r in done]
        forced = [r for r in done if r.get("forced")] or done
        same = "(the reference)" if (engine, weights) == ref_key else agreement(forced[0], ref_ids) if ref_ids else "-"
        stable = all(r["ids"] == forced[0]["ids"] for r in forced)
        steps = [m for r in done for m in r.get("step_ms", [])]
        p50, p99 = (percentile(steps, 50), percentile(steps, 99)) if steps else (float("nan"),) * 2
        rows.append([engine, weights, ", ".join(f"{m:.0f}" for m in per_round), f"{best:.0f}",
                     f"{p50:.0f} / {p99:.0f}", f"{p99 / p50:.2f}",
                     f"{min(prefill):.1f}-{max(prefill):.1f}", f"{nbytes / 1e6:,.0f}", f"{floor:.0f}",
                     f"{floor / best:.2f}", same + ("" if stable else " (ids vary between rounds)"),
                     f"{max(r['peak_rss_gb'] for r in done):.1f}"])
        summary[f"{engine} {weights}"] = {"decode_ms": per_round, "best_ms": best, "prefill_s": prefill,
                                          "bytes_per_token": nbytes, "floor_ms": floor, "fraction": floor / best,
                                          "step_p50_ms": p50, "step_p99_ms": p99,
                                          "ids_equal_prefix": same, "peak_rss_gb": max(r["peak_rss_gb"] for r in done)}
    headers = ["engine", "weights", "decode ms/token (rounds)", "best", "step p50 / p99 ms", "p99/p50",
               f"prefill {prompt_len} tokens, s",
               "MB read per token", "floor ms", "fraction of floor (best)", f"argmax = {ref_key[0]} {ref_key[1]}'s",
               "peak RSS GB"]
    return table(rows, headers), summary


def reference_row(rows: list[tuple[str, str]]) -> tuple[str, str]:
    """The row every other is compared with: this project's float32, else the first."""
    return ("litevlm", "float") if ("litevlm", "float") in rows else rows[0]


def parse_rows(args) -> list[tuple[str, str]]:
    rows = []
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if engine not in ENGINES:
            raise SystemExit(f"--engines: {engine!r} is not one of {', '.join(ENGINES)}")
        forms = {"litevlm": args.weights, "transformers": "float32", "llama.cpp": args.gguf,
                 "openvino": args.openvino}[engine]
        allowed = {"llama.cpp": GGUF_FORMS, "openvino": OPENVINO_FORMS}.get(engine)
        for form in [f.strip() for f in forms.split(",") if f.strip()]:
            if allowed and form not in allowed:
                raise SystemExit(f"--{ {'llama.cpp': 'gguf'}.get(engine, engine)}: {form!r} is not one of "
                                 f"{', '.join(allowed)}")
            rows.append((engine, form))
    return rows


def run_all(args) -> int:
    """Prepare the weights, then `rounds` rounds over every row (the order reversed every other
    round, so that a load trend hits them alike), bandwidth measured before each round and after
    the last; the table at the end (and --json)."""
    import random

    from litevlm_runtime.bench.contention import Hog

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "peers.log"
    say = lambda m: print(m, file=sys.stderr, flush=True)       # noqa: E731
    rows = parse_rows(args)
    say(f"rows: {', '.join(f'{e} {w}' for e, w in rows)}; log: {log}")
    prep_peaks = prepare(work, args.seed, args.layers, sorted({w for e, w in rows if e == "llama.cpp"}),
                         sorted({w for e, w in rows if e == "openvino"}), log, say)
    prompt = random.Random(args.seed).choices(range(HF_CONFIG["vocab_size"]), k=args.prompt)
    if args.layers != HF_CONFIG["num_hidden_layers"]:
        say(f"--layers {args.layers}: a quick check of the set-up, not InternVL3-2B's {HF_CONFIG['num_hidden_layers']}")
    (work / "prompt.json").write_text(json.dumps(prompt))
    (work / "reference.json").unlink(missing_ok=True)         # this run's reference row writes it
    reference = reference_row(rows)
    results: dict[tuple[str, str], list[dict]] = {r: [] for r in rows}
    bandwidth, loads = [], []
    for rnd in range(args.rounds):
        bandwidth.append(measure_bandwidth_gbs(args.threads))
        loads.append(os.getloadavg()[0])
        say(f"[round {rnd + 1}/{args.rounds}] bandwidth read {bandwidth[-1][0]:.1f} GB/s, best {bandwidth[-1][1]:.1f}; "
            f"load {loads[-1]:.2f}")
        for engine, weights in (rows if rnd % 2 == 0 else rows[::-1]):
            if results[(engine, weights)] and results[(engine, weights)][0]["skipped"]:
                continue
            force = (engine, weights) != reference and (work / "reference.json").is_file()
            with Hog(args.hog, "spin"):          # the row beside --hog busy processes (0: none)
                out = child(["--step", "run", "--row", f"{engine}:{weights}", "--work", str(args.work),
                             "--tokens", str(args.tokens), "--threads", str(args.threads)]
                            + (["--force"] if force else []), log)
            results[(engine, weights)].append(out)
            if (engine, weights) == reference and not out["skipped"] and not (work / "reference.json").is_file():
                (work / "reference.json").write_text(json.dumps(out["ids"]))
            say(f"  {engine:<12} {weights:<8} " + (f"skipped: {out['skipped']}" if out["skipped"] else
                f"decode {out['decode_ms']:7.1f} ms/token  prefill {out['prefill_s']:5.1f} s  "
                f"load {out['load_s']:5.1f} s  peak {out['peak_rss_gb']:.1f} GB"))
    bandwidth.append(measure_bandwidth_gbs(args.threads))
    loads.append(os.getloadavg()[0])
    text, summary = summarize(results, bandwidth, args.prompt, args.tokens)
    peak = max([p for _, p in prep_peaks] + [r["peak_rss_gb"] for runs in results.values() for r in runs] + [0.0])
    head = (
        f"{cpu_line()}\n{args.threads} threads; prompt {args.prompt} ids, then {args.tokens} greedy steps; "
        f"{args.rounds} alternating rounds; 1-min load average {min(loads):.2f}-{max(loads):.2f}"
        + (f"; every row beside {args.hog} busy processes (spin)" if args.hog else "") + "\n"
        f"memory bandwidth ({args.threads} threads, 2 GiB working set, between rounds): read "
        + ", ".join(f"{r:.1f}" for r, _ in bandwidth)
        + " GB/s; best of read/copy/triad "
        + ", ".join(f"{b:.1f}" for _, b in bandwidth)
        + f" GB/s; floors use the highest, {max(b for _, b in bandwidth):.1f}"
    )
    foot = (f"peak RSS of any one process: {peak:.1f} GB (each row and each conversion in its own process)"
            + ("; conversions: " + ", ".join(f"{s} {p:.1f} GB" for s, p in prep_peaks) if prep_peaks else ""))
    print(json.dumps({"rows": summary, "bandwidth": bandwidth, "loads": loads, "peak_rss_gb": peak}, indent=2)
          if args.json else f"{head}\n\n{text}\n\n{foot}")
    return 0


def step(args) -> int:
    """One step in this process (run by run_all): write a weight file, or run one row once."""
    work = Path(args.work)
    if args.step == "weights":
        write_weights(work, args.seed, args.layers)
    elif args.step.startswith("gguf:"):
        write_gguf(work, args.step.split(":", 1)[1])
    elif args.step.startswith("openvino:"):
        write_openvino(work, args.step.split(":", 1)[1])
    elif args.step == "run":
        engine, weights = args.row.split(":", 1)
        prompt = json.loads((work / "prompt.json").read_text())
        forced = json.loads((work / "reference.json").read_text()) if args.force else None
        res = RUNNERS[engine](work, weights, prompt, args.tokens, args.threads, forced)
        res.forced = forced is not None
        res.peak_rss_gb = peak_rss_gb()
        print(json.dumps(res.__dict__))
        return 0
    print(json.dumps({"peak_rss_gb": peak_rss_gb()}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--work", default="/tmp/litevlm-peers", help="folder for the weight files (~20 GB with the defaults)"
    )
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--weights", default="float,int8,int4",
                   help="this project's backend.weights forms (a form this checkout lacks is skipped, said why)")
    p.add_argument(
        "--gguf", default=",".join(GGUF_FORMS), help=f"llama.cpp rows: comma list of {', '.join(GGUF_FORMS)}"
    )
    p.add_argument("--openvino", default=",".join(OPENVINO_FORMS),
                   help=f"OpenVINO rows: comma list of {', '.join(OPENVINO_FORMS)}")
    p.add_argument("--prompt", type=int, default=256, help="prompt ids (random, from --seed)")
    p.add_argument("--tokens", type=int, default=32, help="greedy decode steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hog", type=int, default=0,
                   help="run every row beside this many busy processes (litevlm bench --contention's hogs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=HF_CONFIG["num_hidden_layers"],
                   help="decoder layers (default InternVL3-2B's 28; fewer: a quick check of the set-up)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--force", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("prompt", "tokens", "rounds", "threads", "layers"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} {getattr(args, name)}: must be 1 or more")
    return step(args) if args.step else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
