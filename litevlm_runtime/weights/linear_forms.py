"""The linear layers of a model in the forms `backend.weights` names, swapped in place:

    float   the checkpoint's weights in the pipeline's dtype
    int8    the decoder's linears (every layer's projections and the LM head) as Int8Linear (int8.py)
    bf16    the compute-bound linears (vision encoder, projector, decoder layers, token selector,
            EAGLE-2 draft) as Bf16Linear (bf16.py)

A pipeline converts once at load (`convert_linears`, runtime.py); `litevlm bench --roofline
--weights float,int8,bf16` keeps every form in one process and swaps them round by round
(`LinearForms.use`), so a loaded machine hits them alike.
"""

from __future__ import annotations

import logging

from torch import nn

from .bf16 import BF16_UNIT_FLAGS, Bf16Linear, cpu_has_bf16_units
from .int8 import Int8Linear

WEIGHT_KINDS = ("float", "int8", "bf16")
log = logging.getLogger("litevlm.weights")
CONVERT = {"int8": Int8Linear, "bf16": Bf16Linear}


def child_linears(roots) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, nn.Linear) of every nn.Linear below `roots` (None entries skipped)."""
    found = []
    for root in roots:
        if root is None:
            continue
        for parent in root.modules():
            for name, child in parent.named_children():
                if isinstance(child, nn.Linear):
                    found.append((parent, name, child))
    return found


def decoder_linears(lm: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every linear layer a decode step reads: the layers' projections and the LM head (a head
    tied to the embedding is a matmul, not a Linear: kept)."""
    found = child_linears(lm.layers)
    for name in ("output", "lm_head"):
        child = getattr(lm, name, None)
        if isinstance(child, nn.Linear):
            found.append((lm, name, child))
    return found


def linears_for(kind: str, model: nn.Module, extra=()) -> list[tuple[nn.Module, str, nn.Linear]]:
    """The float linears form `kind` replaces: int8 the decoder's (memory-bound decode steps);
    bf16 those that see many rows (model = InternVL; `extra`: the token selector, the draft head)."""
    if kind == "int8":
        return decoder_linears(model.language_model)
    if kind == "bf16":
        return child_linears([model.vision_model, getattr(model, "mlp1", None), model.language_model.layers, *extra])
    raise ValueError(f"weights {kind!r}: one of {', '.join(WEIGHT_KINDS)}")


class LinearForms:
    """The model's linear layers in float and in each of `kinds`, switchable in place with
    `use(kind)`. keep_float False: the float modules are dropped once converted (int8 frees the
    float weights; a Bf16Linear keeps its float weight itself)."""

    def __init__(self, model: nn.Module, kinds, extra=(), keep_float: bool = True):
        self.slots: dict[tuple[int, str], tuple[nn.Module, str, dict]] = {}
        for kind in kinds:
            if kind == "float":
                continue
            for parent, name, linear in linears_for(kind, model, extra):
                _, _, forms = self.slots.setdefault((id(parent), name), (parent, name, {"float": linear}))
                forms[kind] = CONVERT[kind](linear)
        if not keep_float:
            for _, _, forms in self.slots.values():
                forms.pop("float")
        self.kind = "float"

    def use(self, kind: str) -> None:
        if kind not in WEIGHT_KINDS:
            raise ValueError(f"weights {kind!r}: one of {', '.join(WEIGHT_KINDS)}")
        for parent, name, forms in self.slots.values():
            # a linear no form of `kind` replaces stays float (bf16 leaves the LM head, int8 the vision encoder)
            module = forms.get(kind, forms.get("float"))
            if module is None:
                raise ValueError("float weights were not kept (LinearForms(keep_float=True))")
            setattr(parent, name, module)
        self.kind = kind


def convert_linears(model: nn.Module, kind: str, extra=()) -> LinearForms:
    """Replace the linears `kind` names by their `kind` form, in place, at load."""
    if kind == "bf16" and cpu_has_bf16_units() is False:
        log.warning("backend.weights bf16 on a CPU without bfloat16 units (no %s in /proc/cpuinfo): oneDNN "
                    "emulates them, several times slower than float32 here; use backend.weights float",
                    " or ".join(BF16_UNIT_FLAGS))
    forms = LinearForms(model, [kind], extra, keep_float=False)
    forms.use(kind)
    return forms


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
