"""The linear layers of a model in the forms `backend.weights` names, swapped in place:

    float     the checkpoint's weights in the pipeline's dtype
    int8      the decoder's linears (every layer's projections, the LM head, a tied head's
              embedding) as per-channel Int8Linear (lowbit.py), quantized at load
    int4      the same set as group-wise INT4 with AWQ scales, read from the folder `litevlm quantize`
              wrote (`backend.quantized`, default <model>/quantized-int4)
    int4-rtn  the same set as group-wise INT4, round to nearest, quantized at load (no data needed)
    fp16      the same set as float16 weights, widened in registers at decode (lowbit.py)
    bf16      the compute-bound linears (vision encoder, projector, decoder layers, token selector,
              EAGLE-2 draft) as Bf16Linear (bf16.py)

A pipeline converts once at load (`convert_linears`, runtime.py); `litevlm bench --roofline
--weights float,int8,int4-rtn,...` keeps every form in one process and swaps them round by round
(`LinearForms.use`), so a loaded machine hits them alike.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError, InputError
from ..kernels import lowbit_kernels
from ..kernels.lowbit_kernels import path_in_words
from ..models.decoder import DecoderLayer
from ..models.intern_vit import VisionAttention
from .bf16 import BF16_UNIT_FLAGS, Bf16Linear, cpu_has_bf16_units
from .integrity import read_manifest
from .lowbit import (
    Fp16Linear,
    Int4Linear,
    Int8Linear,
    LowBitEmbedding,
    embedding_as_linear,
    fuse_projections,
    runs_kernels,
    set_prefill_gemm,
)
from .quantize import GROUP_SIZE, Int4Weight, Int8Weight, load_quantized

WEIGHT_KINDS = ("float", "int8", "int4", "int4-rtn", "fp16", "bf16")
DECODER_KINDS = ("int8", "int4", "int4-rtn", "fp16")      # the forms of the decoder's linears (and tied head)
QUANTIZED_DIR = "quantized-int4"                          # the default folder of `int4` in a model folder
log = logging.getLogger("litevlm.weights")


def child_linears(roots) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, nn.Linear) of every nn.Linear below `roots` (None entries skipped)."""
    return child_modules(roots, nn.Linear)


def child_modules(roots, kinds) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every module of the classes `kinds` below `roots` (None skipped)."""
    found = []
    for root in roots:
        if root is None:
            continue
        for parent in root.modules():
            for name, child in parent.named_children():
                if isinstance(child, kinds):
                    found.append((parent, name, child))
    return found


def tied_embedding(lm: nn.Module) -> tuple[nn.Module, str, nn.Embedding] | None:
    """(parent, attribute, embedding) of a decoder whose LM head is its embedding (InternVL3/3.5)."""
    if not getattr(lm.cfg, "tie_word_embeddings", False):
        return None
    for parent in lm.modules():
        for name, child in parent.named_children():
            if child is lm.embed:
                return parent, name, child
    return None


def decoder_linears(lm: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every weight a decode step reads through a matmul: the layers' projections and the LM head
    (a Linear, or the embedding when the head is tied to it)."""
    found = child_linears(lm.layers)
    for name in ("output", "lm_head"):
        child = getattr(lm, name, None)
        if isinstance(child, nn.Linear):
            found.append((lm, name, child))
    tied = tied_embedding(lm)
    if tied is not None and isinstance(tied[2], nn.Embedding):
        found.append(tied)
    return found


def linears_for(kind: str, model: nn.Module, extra=()) -> list[tuple[nn.Module, str, nn.Module]]:
    """The float modules form `kind` replaces: the low-bit forms the decoder's (memory-bound decode
    steps); bf16 those that see many rows (model = InternVL; `extra`: the token selector, the draft head)."""
    if kind in DECODER_KINDS:
        return decoder_linears(model.language_model)
    if kind == "bf16":
        return child_linears([model.vision_model, getattr(model, "mlp1", None), model.language_model.layers, *extra])
    raise ValueError(f"weights {kind!r}: one of {', '.join(WEIGHT_KINDS)}")


class Quantized:
    """Stored quantized weights (quantize.py's files) for one model: module name -> form."""

    def __init__(self, folder: str | Path, model_dir: str | Path | None = None):
        self.folder = Path(folder)
        self.manifest, self.weights = load_quantized(self.folder)
        if model_dir is not None:
            check_source(self.manifest, Path(model_dir), self.folder)

    def form(self, name: str, module: nn.Module, kind: str):
        # `int4` reads any stored INT4 set: AWQ, or round to nearest stored at another group size
        if self.manifest.get("weights") not in {"int4": ("int4", "int4-rtn")}.get(kind, (kind,)):
            raise CheckpointError(f"{self.folder}: holds {self.manifest.get('weights')} weights, "
                                  f"backend.weights asks for {kind}")
        if name not in self.weights:
            raise CheckpointError(f"{self.folder}: no quantized weights for {name} (made for another model? "
                                  f"re-run `litevlm quantize`)")
        return self.weights[name]


def check_source(manifest: dict, model_dir: Path, folder: Path) -> None:
    """Refuse quantized weights made from other float weights than the model folder's now."""

    made_from = manifest.get("source", {}).get("files", {})
    current = read_manifest(model_dir) or {}
    for name, entry in made_from.items():
        if name in current and current[name].get("sha256") != entry.get("sha256"):
            raise CheckpointError(f"{folder}: quantized from another {name} than {model_dir}'s (sha256 differs): "
                                  f"re-run `litevlm quantize --model {model_dir}`")


def convert(kind: str, module: nn.Module, name: str, quantized: Quantized | None = None,
            group_size: int = GROUP_SIZE) -> nn.Module:
    """The `kind` form of one float module (an nn.Linear, or a tied embedding)."""
    if isinstance(module, nn.Embedding):
        return LowBitEmbedding(convert(kind, embedding_as_linear(module), name, quantized, group_size),
                               module.weight.dtype)
    if kind == "int8":
        return Int8Linear(module)
    if kind == "int4-rtn":
        return Int4Linear(module, group_size=group_size)
    if kind == "int4":
        if quantized is None:
            raise InputError("backend.weights int4 reads AWQ weights from `litevlm quantize` (backend.quantized); "
                             "none given: use int4-rtn to quantize at load without calibration")
        stored = quantized.form(name, module, kind)
        if isinstance(stored, Int4Weight):
            return Int4Linear(weight=stored, bias=getattr(module, "bias", None))
        if isinstance(stored, Int8Weight):
            return Int8Linear(weight=stored, bias=getattr(module, "bias", None))
    if kind == "fp16":
        return Fp16Linear(module)
    if kind == "bf16":
        return Bf16Linear(module)
    raise ValueError(f"weights {kind!r}: one of {', '.join(WEIGHT_KINDS)}")


def module_names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


class LinearForms:
    """The model's linear layers in float and in each of `kinds`, switchable in place with
    `use(kind)`. keep_float False: the float modules are dropped once converted (the low-bit forms
    free the float weights; a Bf16Linear keeps its float weight itself). `quantized`: the stored
    weights `int4` reads."""

    def __init__(self, model: nn.Module, kinds, extra=(), keep_float: bool = True, quantized: Quantized | None = None,
                 group_size: int = GROUP_SIZE):
        kinds = list(kinds)
        self.slots: dict[tuple[int, str], tuple[nn.Module, str, dict]] = {}
        self.root, self.extra, self.has_bf16 = model, tuple(extra), "bf16" in kinds
        names = module_names(model)
        wanted: dict[tuple[int, str], list[str]] = {}
        for kind in kinds:
            if kind == "float":
                continue
            for parent, name, module in linears_for(kind, model, extra):
                self.slots.setdefault((id(parent), name), (parent, name, {"float": module}))
                wanted.setdefault((id(parent), name), []).append(kind)
        for key, (parent, name, forms) in self.slots.items():
            for kind in wanted[key]:
                forms[kind] = convert(kind, forms["float"], names.get(id(forms["float"]), name), quantized, group_size)
            if not keep_float:
                # the float module leaves the model as soon as its forms exist, so that converting a
                # model peaks at its float weights plus one layer's forms, not plus every form
                forms.pop("float")
                setattr(parent, name, forms[wanted[key][0]])
        self.kind = "float" if keep_float else None
        self.prefill: str | None = None   # the low-bit forms' many-row GEMM (set_prefill_gemm), None for the others
        self.kernels = ""                 # the low-bit forms' path (lowbit_kernels.path_in_words), "" for others

    def use(self, kind: str) -> None:
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"weights {kind!r}: one of {', '.join(WEIGHT_KINDS)}")
        for parent, name, forms in self.slots.values():
            # a linear no form of `kind` replaces stays float (bf16 leaves the LM head, int8 the vision encoder)
            module = forms.get(kind, forms.get("float"))
            if module is None:
                raise ValueError("float weights were not kept (LinearForms(keep_float=True))")
            setattr(parent, name, module)
        if kind in DECODER_KINDS:
            fuse_projections(self.root)
        if self.has_bf16 and kind in ("float", "bf16"):
            # bf16's attention with its GEMMs; the low-bit forms' follows set_prefill_gemm, vision's vision_to
            use_bf16_attention([self.root, *self.extra], kind == "bf16")
        self.kind = kind


def quantized_folder(setting: str, model_dir: str | Path | None) -> Path | None:
    """The folder `int4` reads: backend.quantized, else <model_dir>/quantized-int4 where it exists."""
    if setting:
        return Path(setting)
    if model_dir is not None and (Path(model_dir) / QUANTIZED_DIR).is_dir():
        return Path(model_dir) / QUANTIZED_DIR
    return None


def convert_linears(model: nn.Module, kind: str, extra=(), quantized: str | Path | None = None,
                    model_dir: str | Path | None = None, prefill: str = "auto") -> LinearForms:
    """Replace the linears `kind` names by their `kind` form, in place, at load. `quantized`: the
    folder of stored weights (`int4`); `prefill`: the low-bit forms' many-row GEMM
    (backend.lowbit_prefill: auto | float32 | bfloat16 | int8)."""
    if kind == "bf16" and cpu_has_bf16_units() is False:
        log.warning("backend.weights bf16 on a CPU without bfloat16 units (no %s in /proc/cpuinfo): oneDNN "
                    "emulates them, several times slower than float32 here; use backend.weights float",
                    " or ".join(BF16_UNIT_FLAGS))
    stored = None
    if kind == "int4":
        folder = quantized_folder(str(quantized or ""), model_dir)
        if folder is None:
            raise InputError(f"backend.weights int4: no AWQ weights (backend.quantized, or {QUANTIZED_DIR}/ in the "
                             f"model folder): make them with `litevlm quantize --model DIR --data QA.json`, or use "
                             f"backend.weights int4-rtn (round to nearest, quantized at load)")
        stored = Quantized(folder, model_dir)
    forms = LinearForms(model, [kind], extra, keep_float=False, quantized=stored)
    forms.use(kind)
    forms.prefill = set_prefill_gemm([model, *extra], prefill) if kind in DECODER_KINDS else None
    forms.kernels = path_in_words(runs_kernels(model)) if kind in DECODER_KINDS else ""
    return forms


VISION_GEMMS = ("auto", "float32", "bfloat16", "int8")


def resolve_vision_gemm(setting: str, weights: str, device, dtype) -> str:
    """`float32`, `bfloat16` or `int8`: the GEMM the vision encoder and projector run (backend.vision_gemm).
    auto, beside a low-bit decoder form (int8, int4, fp16: its prompt already runs bfloat16 or int8
    GEMMs, `backend.lowbit_prefill`): int8 where the kernels run AVX-512 VNNI (1.33x bfloat16's vision
    tile on a 2-core Zen 4, answers as bfloat16's on a fresh seed: docs/results/, vision-int8-whole-
    question-zen4), else bfloat16 on a CPU with bfloat16 units, else float32 (AVX2's int8 tiles gain
    only 1.16x over float32 there).
    A float pipeline stays float32 unless asked; backend.weights bf16 converts vision itself. int8 needs
    the low-bit kernels (else bfloat16 or float32, with a warning)."""
    if setting not in VISION_GEMMS:
        raise ValueError(f"backend.vision_gemm {setting!r}: one of {', '.join(VISION_GEMMS)}")
    if weights == "bf16" and setting != "int8":
        return "bfloat16"
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return "float32"
    units = cpu_has_bf16_units()
    if setting == "auto":
        if weights not in DECODER_KINDS:
            return "float32"
        return "int8" if lowbit_kernels.has_vnni() else "bfloat16" if units else "float32"
    if setting == "int8" and not lowbit_kernels.has_int8_gemm():
        fallback = "bfloat16" if units or weights == "bf16" else "float32"     # bf16 weights: vision is bf16 already
        log.warning("backend.vision_gemm int8 needs the low-bit kernels (%s): %s instead", lowbit_kernels.unavailable(),
                    fallback)
        return fallback
    if setting == "bfloat16" and units is False:
        log.warning("backend.vision_gemm bfloat16 on a CPU without bfloat16 units (no %s in /proc/cpuinfo): oneDNN "
                    "emulates them, several times slower than float32 here", " or ".join(BF16_UNIT_FLAGS))
    return setting


def vision_to(model: nn.Module, gemm: str) -> int:
    """The vision encoder's and projector's linears in the form `gemm` names, in place; returns how many.
    bfloat16: Bf16Linear (bf16.py); int8: Int8Linear (per-channel int8 weights quantized here, lowbit.py)
    whose calls of many rows run the int8 GEMM (int8 activations per block of 128, AVX-512 VNNI or AVX2).
    Why: a tile is ~1,000 rows through every vision weight, compute-bound; the bfloat16 GEMM runs at about
    twice float32's rate on a CPU with bfloat16 units, int8 products at twice bfloat16's on one with VNNI,
    and at 1.1-1.25x float32's on an AVX2 one (int8 weights take the sign trick there: lowbit_kernels.cpp;
    litevlm bench --study cpu_stages). A Bf16Linear under bf16 weights is quantized from its float weight."""
    found = [(parent, name, module) for parent, name, module in
             child_modules([model.vision_model, getattr(model, "mlp1", None)], (nn.Linear, Bf16Linear))]
    use_bf16_attention([model.vision_model], gemm in ("bfloat16", "int8"))
    count = 0
    for parent, name, module in found:
        if gemm == "int8":
            form = Int8Linear(module if isinstance(module, nn.Linear) else _as_linear(module))
            form.prefill_int8 = True
        elif gemm == "bfloat16" and isinstance(module, nn.Linear):
            form = Bf16Linear(module)
        else:
            continue
        setattr(parent, name, form)
        count += 1
    return count


def use_bf16_attention(roots, on: bool) -> None:
    """The attention of every decoder layer and vision tile below `roots` (None skipped) on the kernels'
    bfloat16 attention (on, where it applies: a causal prompt, a vision tile; models/) or torch's SDPA."""
    for root in roots:
        for m in (root.modules() if root is not None else ()):
            if isinstance(m, (DecoderLayer, VisionAttention)):
                m.bf16_attention = on


def _as_linear(module: Bf16Linear) -> nn.Linear:
    """An nn.Linear view (no copy) of a Bf16Linear's float weight and bias."""
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
    linear.weight, linear.bias = module.weight, module.bias
    return linear


def weight_bytes(modules, many_rows: bool = False) -> int:
    """Bytes of the parameters and buffers of `modules` a call reads (each tensor counted once):
    a Bf16Linear reads its bfloat16 copy in calls of many rows, its float weight in the others
    (unless that weight is bfloat16-valued: then its copy, widened)."""
    seen, total = set(), 0
    for root in modules:
        for m in root.modules():
            tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
            if isinstance(m, Bf16Linear):
                unread = m.weight if many_rows or m.widen else m.weight_bf16
                tensors = [t for t in tensors if t is not unread]
            for t in tensors:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total
