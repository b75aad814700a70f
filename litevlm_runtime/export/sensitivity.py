"""Per-layer sensitivity to quantization: one layer (or stage part) quantized at a time, the rest in
float, and the damage measured on the model's output over calibration traffic.

Traffic: questions answered by the float PyTorch pipeline (views and tokens as configured, greedy);
per query the tiles the vision stage saw, the prefill rows (kept visual tokens at their positions),
and the float answer's tokens. The output measured is the decoder's next-token distribution at
every answer position, teacher-forced on the float answer: prompt rows + answer tokens through the
decoder in one causal pass, the logits of the last prompt row and of every answer row but the last.
A unit is quantized, everything is run again on the same inputs (a vision unit: the tiles through
the vision stage again, its visual tokens replacing the kept visual rows of the prompt), and per
unit we report the mean KL(float || quantized) over answer positions, the fraction of positions
whose argmax changes, and the relative error of the final hidden states.

Units: each vision layer, the projector (mlp1), each decoder layer (all their Linears), and the
stages whole. Formats: FP8 (fake_quant.py: activations and weights, per-tensor scales, the FP8
bundle's own scales when one is given, else amax / 448 over this traffic as ModelOpt's `max`
calibration computes them) and INT4 (weight only, blocked, symmetric: fake_quant.int4_round).
Why teacher forcing: free-running answers diverge after the first changed token, so their
difference measures one flip, not the layer's error; every position's distribution does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LiteVLMError
from .fake_quant import FP8_MAX, FakeQuantLinear, fp8_scales, swapped

# matplotlib is imported where the plot is drawn: it is heavy, and only --plot needs it.


@dataclass
class QueryTraffic:
    pixels: torch.Tensor            # [tiles, 3, s, s] the vision stage's input
    embeds: torch.Tensor            # [n, D] prefill rows (kept visual tokens spliced in)
    positions: torch.Tensor         # [n]
    visual_index: torch.Tensor      # [n] row -> index into the tiles' flattened visual tokens, -1: text
    answer: list[int]               # the float answer's token ids


def record_traffic(pipe, queries, progress=print) -> list[QueryTraffic]:
    """Each query answered by `pipe` (torch, greedy, no visual feature cache); what sensitivity
    re-runs is read back from the arena after the answer."""
    rt = pipe.rt
    if rt.features is not None or rt.engines.backend != "torch":
        raise LiteVLMError("sensitivity traffic needs backend.name torch and serving.feature_cache false")
    a, img = rt.arena, rt.tok.img_context_id
    out = []
    for i, q in enumerate(queries):
        ans = pipe.answer(q.images, q.request)
        n = ans.input_tokens
        tiles = len(ans.cameras) * rt.options.tiles_per_camera
        full_rows = a.kept_rows[:n].clone()
        visual_rows = (a.prompt_ids[:int(a.positions[n - 1]) + 1] == img).nonzero().flatten()
        where = torch.full((int(full_rows.max()) + 1,), -1, dtype=torch.long)
        where[visual_rows] = torch.arange(len(visual_rows))
        out.append(QueryTraffic(a.pixels[:tiles].clone(), a.embeds[:n].clone(), a.positions[:n].clone(),
                                where[full_rows], list(ans.token_ids)))
        progress(f"[sensitivity traffic {i + 1}/{len(queries)}] {len(ans.cameras)} cameras, {n} rows, "
                 f"{len(ans.token_ids)} answer tokens")
    return out


@torch.no_grad()
def answer_logits(rt, t: QueryTraffic, visual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(final hidden [A + 1, D], logits [A + 1, V]) at the rows that predict the A answer tokens
    and the end, teacher-forced; `visual`:
    the tiles' visual tokens [tiles, tokens, D] replacing the prompt's kept visual rows."""
    lm = rt.lm
    embeds = t.embeds
    if visual is not None:
        embeds = embeds.clone()
        rows = (t.visual_index >= 0).nonzero().flatten()
        embeds[rows] = visual.reshape(-1, visual.shape[-1])[t.visual_index[rows]].to(embeds.dtype)
    ids = torch.tensor(t.answer, dtype=torch.long)          # the last one's row predicts the end
    x = torch.cat([embeds, lm.embed(ids).to(embeds.dtype)])
    n = embeds.shape[0]
    positions = torch.cat([t.positions, t.positions[-1] + 1 + torch.arange(len(ids))])
    mask = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).tril_()
    hidden, _, _ = lm(x, positions, mask)
    hidden = hidden[n - 1:]
    return hidden, lm.head(hidden).double()        # float64: the KL of near-equal distributions


@dataclass
class Unit:
    name: str                   # "vision.layers.0", "projector", "decoder.layers.3", "vision (all)"
    stage: str                  # vision | decoder
    modules: list[str]          # module paths under rt.model
    row: dict = field(default_factory=dict)


def units_of(rt) -> list[Unit]:
    model = rt.model
    linears = lambda prefix: [n for n, m in model.named_modules() if n.startswith(prefix) and isinstance(m, nn.Linear)]  # noqa: E731
    units = [Unit(f"vision.layers.{i}", "vision", linears(f"vision_model.encoder.layers.{i}."))
             for i in range(len(model.vision_model.encoder.layers))]
    units.append(Unit("projector (mlp1)", "vision", linears("mlp1.")))
    units += [Unit(f"decoder.layers.{i}", "decoder", linears(f"language_model.model.layers.{i}."))
              for i in range(len(rt.lm.layers))]
    units.append(
        Unit("vision + projector (all)", "vision", [m for u in units if u.stage == "vision" for m in u.modules])
    )
    units.append(Unit("decoder (all)", "decoder", [m for u in units[:-1] if u.stage == "decoder" for m in u.modules]))
    return units


class ActivationRange:
    """amax of every Linear's input over the traffic (ModelOpt's `max` calibration: scale = amax / 448)."""

    def __init__(self, model: nn.Module):
        self.amax: dict[str, float] = {}
        self.hooks = [m.register_forward_pre_hook(self.hook(n)) for n, m in model.named_modules()
                      if isinstance(m, nn.Linear)]

    def hook(self, name):
        def record(_, args):
            self.amax[name] = max(self.amax.get(name, 0.0), float(args[0].detach().abs().max()))
        return record

    def remove(self):
        for h in self.hooks:
            h.remove()


def fp8_unit_scales(rt, traffic: list[QueryTraffic], bundle_graphs: list | None) -> dict[str, tuple[float, float]]:
    """module path (under rt.model) -> (activation scale, weight scale) for FP8: from the FP8
    bundle's graphs when given (the largest bucket of each stage that quantized the weight), else
    calibrated here (amax / 448 over the traffic; weights per tensor, amax / 448)."""
    scales: dict[str, tuple[float, float]] = {}
    for path in bundle_graphs or []:
        for name, value in fp8_scales(path).items():
            module = ("language_model." + name[len("lm."):] if name.startswith("lm.") else name[len("model."):])
            scales[module.removesuffix(".weight")] = value
    if scales:
        return scales
    ranges = ActivationRange(rt.model)
    try:
        for t in traffic:
            answer_logits(rt, t, rt.model.encode_images(t.pixels, rt.pos_embed))
    finally:
        ranges.remove()
    for name, amax in ranges.amax.items():
        w = rt.model.get_submodule(name).weight
        scales[name] = (
            max(amax, 1e-12) / FP8_MAX,
            w.detach().float().abs().amax(1, keepdim=True).clamp(min=1e-12) / FP8_MAX,
        )
    return scales


def quantized(rt, unit: Unit, fmt: str, scales: dict, int4_block: int) -> dict[str, nn.Module]:
    out = {}
    for path in unit.modules:
        linear = rt.model.get_submodule(path)
        if fmt == "fp8":
            if path not in scales:
                continue                         # not quantized in the bundle (the LM head, a GEMV)
            out[path] = FakeQuantLinear(linear, *scales[path])
        else:
            block = min(int4_block, linear.in_features)
            out[path] = FakeQuantLinear(linear, int4_block=block)
    return out


@torch.no_grad()
def sensitivity(rt, traffic: list[QueryTraffic], formats=("fp8", "int4"), bundle_graphs=None, int4_block: int = 128,
                progress=print) -> list[dict]:
    """One row per (unit, format): the damage of quantizing that unit alone (module docstring)."""
    visual = [rt.model.encode_images(t.pixels, rt.pos_embed) for t in traffic]
    reference = [answer_logits(rt, t, v) for t, v in zip(traffic, visual)]
    ref_logp = [F.log_softmax(lg, -1) for _, lg in reference]
    scales = fp8_unit_scales(rt, traffic, bundle_graphs) if "fp8" in formats else {}
    rows = []
    for fmt in formats:
        for unit in units_of(rt):
            swaps = quantized(rt, unit, fmt, scales, int4_block)
            if not swaps:
                continue
            t0 = time.perf_counter()
            kl = flips = positions = 0.0
            err_num = err_den = 0.0
            with swapped(rt.model, swaps):
                for t, v, (h_ref, _), lp in zip(traffic, visual, reference, ref_logp):
                    v_q = rt.model.encode_images(t.pixels, rt.pos_embed) if unit.stage == "vision" else v
                    h, logits = answer_logits(rt, t, v_q)
                    logq = F.log_softmax(logits, -1)
                    kl += float((lp.exp() * (lp - logq)).sum())
                    flips += float((logits.argmax(-1) != lp.argmax(-1)).sum())
                    positions += lp.shape[0]
                    err_num += float((h - h_ref).float().pow(2).sum())
                    err_den += float(h_ref.float().pow(2).sum())
            rows.append({"unit": unit.name, "format": fmt, "linears": len(swaps), "kl": kl / positions,
                         "top1_changed": flips / positions, "hidden_rel_error": (err_num / err_den) ** 0.5,
                         "positions": int(positions)})
            progress(f"[sensitivity {fmt}] {unit.name:<26} KL {rows[-1]['kl']:.2e}  top-1 changed "
                     f"{rows[-1]['top1_changed']:.4f}  ({time.perf_counter() - t0:.1f} s)")
    return rows


SENSITIVITY_HEADER = ["unit", "format", "linears", "mean KL (nats)", "top-1 changed", "hidden rel. error"]


def sensitivity_rows(rows: list[dict]) -> list[list]:
    return [[r["unit"], r["format"], r["linears"], f"{r['kl']:.2e}", f"{r['top1_changed']:.4f}",
             f"{r['hidden_rel_error']:.4f}"] for r in rows]


def most_sensitive(rows: list[dict], fmt: str, count: int) -> list[str]:
    """The `count` single units (not the whole-stage rows) with the largest KL under `fmt`."""
    single = [r for r in rows if r["format"] == fmt and "(all)" not in r["unit"]]
    return [r["unit"] for r in sorted(single, key=lambda r: -r["kl"])[:count]]


def keep_float_pattern(units: list[str]) -> str:
    """The `calibrate --keep-float` expression (weight names in the exported graphs) of these units."""
    parts = []
    for u in units:
        if u.startswith("decoder.layers."):
            parts.append(rf"^lm\.model\.layers\.{u.rsplit('.', 1)[1]}\.")
        elif u.startswith("vision.layers."):
            parts.append(rf"^model\.vision_model\.encoder\.layers\.{u.rsplit('.', 1)[1]}\.")
        elif u.startswith("projector"):
            parts.append(r"^model\.mlp1\.")
    return "|".join(parts)


def plot(rows: list[dict], path) -> None:
    """Bars of mean KL per unit, one panel per format (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = sorted({r["format"] for r in rows})
    fig, axes = plt.subplots(len(formats), 1, figsize=(10, 3.2 * len(formats)), squeeze=False)
    for ax, fmt in zip(axes[:, 0], formats):
        mine = [r for r in rows if r["format"] == fmt]
        colors = ["tab:orange" if r["unit"].startswith(("vision", "projector")) else "tab:blue" for r in mine]
        ax.bar(range(len(mine)), [max(r["kl"], 1e-12) for r in mine], color=colors)
        ax.set_yscale("log")
        ax.set_xticks(range(len(mine)), [r["unit"].replace("decoder.layers.", "dec ").replace("vision.layers.", "vit ")
                                         for r in mine], rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("mean KL (nats)")
        ax.set_title(f"{fmt}: one unit quantized at a time (orange: vision stage, blue: decoder)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
