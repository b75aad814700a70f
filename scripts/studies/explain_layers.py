"""Which decoder layers' attention points at the object a question names: the evidence behind the
explanation's choice of layers (pipeline/explanation.py, attention_layers).

For every question of a SynthDrive set that tags exactly one object on a camera the query kept (and
whose token the token selector kept), one pass over prompt + answer gives every layer's attention
of the answer rows (mean over heads and rows). Per layer: the attention on the token whose cell
holds the tagged object's centre, divided by the mean over that camera's kept tokens (1.0: no
preference; the same number for every layer would say the choice does not matter), and how often
that token is in the top 10% of its camera's tokens (chance: 10%).

    litevlm synth --out /tmp/synth3301 --scenes 12 --seed 3301 --width 800 --height 450
    python scripts/studies/explain_layers.py --data /tmp/synth3301/train.json --frames /tmp/synth3301 [--model DIR]

Measure on a seed the model was not trained on (the bundled model: SynthDrive seeds 2026 and 2027).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import litevlm_runtime  # noqa: F401 - first, so that torch's threads sleep when idle (threads.py)

# isort: split
import numpy as np
import torch

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.explain.capture import drivelm_questions
from litevlm_runtime.objects import TAG_FRAME, parse_objects
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.explanation import answer_attention, trace_from_arena
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.report import table


def layer_bands(n: int) -> dict[str, range]:
    """The candidate averages, by relative depth: the explanation's choice is one of them."""
    q = max(1, n // 4)
    return {"first quarter": range(0, q), "second quarter": range(q, 2 * q), "third quarter": range(2 * q, 3 * q),
            "last quarter": range(n - q, n), "middle half": range(q, n - q), "all": range(n)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--frames", type=Path, required=True)
    ap.add_argument("--questions", type=int, default=60, help="at most this many tagged questions")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a pipeline setting")
    args = ap.parse_args()
    pipe = Pipeline.from_pretrained(args.model, options_from_flat(dict(s.split("=", 1) for s in args.set)))
    rt = pipe.rt
    layers = list(range(len(rt.lm.layers)))
    side = rt.cfg.tokens_per_side
    tiles = rt.options.tiles_per_camera
    bands = layer_bands(len(layers))
    focus = {i: [] for i in [*layers, *bands]}
    top = {i: [] for i in [*layers, *bands]}
    share = {i: [] for i in [*layers, *bands]}
    used = 0
    for q in drivelm_questions(args.data, args.frames):
        objects = parse_objects(q.question).objects
        if len(objects) != 1 or used >= args.questions:
            continue
        obj = objects[0]
        images = {c: p.read_bytes() for c, p in q.images.items()}
        answer = pipe.answer(images, q.question)
        if obj.camera not in answer.cameras:
            continue
        trace = trace_from_arena(rt, answer)
        col = min(max(int(obj.x / TAG_FRAME[0] * tiles * side), 0), tiles * side - 1)    # tags: in TAG_FRAME
        row = min(max(int(obj.y / TAG_FRAME[1] * side), 0), side - 1)
        token = (col // side) * side * side + row * side + col % side          # TokenGrid's order
        i = trace.cameras.index(obj.camera)
        start, count = trace.layout.spans[i]
        kept = trace.keep[i].tolist()
        if token not in kept:
            continue
        n, fed = len(trace.rows), list(answer.token_ids[:-1])
        with torch.inference_mode():
            embeds = torch.cat([trace.prompt_embeds[trace.rows], rt.lm.embed(torch.tensor(fed, dtype=torch.long))])
            positions = torch.cat([trace.rows, trace.layout.length + torch.arange(len(fed))])
            probs = answer_attention(rt.lm, embeds, positions, torch.arange(n - 1, n + len(fed)), layers).mean(1)
        row_of = {int(r): j for j, r in enumerate(trace.rows)}
        visual = [row_of[s + k] for (s, c), keep in zip(trace.layout.spans, trace.keep) for k in keep.tolist()]
        mine = np.array([row_of[start + k] for k in kept])
        for layer in [*layers, *bands]:
            p = (probs[layer] if isinstance(layer, int) else probs[list(bands[layer])].mean(0)).numpy()
            values = p[mine]
            at = p[row_of[start + token]]
            focus[layer].append(at / values.mean())
            top[layer].append(at >= np.quantile(values, 0.9))
            share[layer].append(p[visual].sum())
        used += 1
        print(f"[{used}] {obj.camera} {q.question[:60]} -> {answer.text[:40]}", flush=True)
    rows = [[layer if isinstance(layer, int) else f"{layer} {bands[layer][0]}-{bands[layer][-1]}",
             f"{statistics.median(focus[layer]):.2f}", f"{100 * np.mean(top[layer]):.0f}%",
             f"{100 * statistics.median(share[layer]):.1f}%"] for layer in [*layers, *bands]]
    print(f"\n{args.model}  {args.data}  {used} questions tagging one object on a kept camera and kept token")
    print(table(["layer(s)", "object token / camera mean (median)", "object token in top 10%",
                 "attention on visual tokens (median)"], rows))


if __name__ == "__main__":
    main()
