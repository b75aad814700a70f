"""`litevlm prompt`: exactly what the decoder will see for a question, without loading any weight:
the ids (`<IMG_CONTEXT>` placeholders included), the text with each image span collapsed, and each
camera's span. Compare it with what a training pipeline fed the model.

    litevlm prompt --model DIR --question Q [--cameras CAM ...] [--tiles-per-camera N] [--layout NAME]
                   [--frames K] [--history QUESTION ANSWER ...] [--json]

With --frames K (frame sets over time), each camera's K frames, oldest first, as upstream's video
chat writes them (`Frame1: <image>\nFrame2: ...`; stages/prompt.py): a span per camera and frame.

With --history (earlier turns, oldest first), the prompt of a follow-up question: the conversation
as upstream's chat(history=) builds it. `sha256` is the digest every Answer carries
(`prompt_sha256`): equal digests, the same prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..cameras import CAMERAS
from ..errors import InputError


def register(subparsers) -> None:
    p = subparsers.add_parser("prompt", help="print the prompt ids and text the decoder sees for a question")
    p.add_argument("--model", type=Path, required=True, help="InternVL2.5 checkpoint folder")
    p.add_argument("--question", required=True)
    p.add_argument("--cameras", nargs="+", default=list(CAMERAS), metavar="CAM",
                   help=f"the cameras in the prompt, in order (default: all six: {' '.join(CAMERAS)})")
    p.add_argument("--tiles-per-camera", type=int, default=1, help="tiles per camera (the pipeline's 1 or 2)")
    p.add_argument("--layout", help="internvl | cameras | a template with one <image>, {camera}, {index} "
                                    "(a literal \\n in it is a newline); default: the model folder's "
                                    "(litevlm.json, else guessed from its tokenizer)")
    p.add_argument("--frames", type=int, default=1, metavar="K",
                   help="frame sets per camera, oldest first (1: the newest only, the single-frame prompt)")
    p.add_argument("--history", nargs=2, action="append", default=[], metavar=("QUESTION", "ANSWER"),
                   help="an earlier turn of the conversation (repeat, oldest first): the prompt of a follow-up")
    p.add_argument("--json", action="store_true", help="print one JSON object (input_ids, text, spans)")
    p.set_defaults(func=run)


def describe(model: Path, question: str, cameras: list[str], tiles_per_camera: int,
             layout: str | None = None, history=(), frames: int = 1) -> dict:
    """The prompt of `question` over `cameras` (after the earlier turns `history`; each camera's
    `frames` frame sets) as the pipeline builds it for the model in `model`."""
    from ..stages.prompt import build_prompt, prompt_digest, render, resolve_layout
    from ..weights.checkpoint import read_config
    from ..weights.tokenizer import Tokenizer

    unknown = [c for c in cameras if c not in CAMERAS]
    if unknown:
        raise InputError(f"--cameras: unknown camera {unknown[0]!r} (one of {', '.join(CAMERAS)})")
    if len(set(cameras)) != len(cameras):
        raise InputError(f"--cameras: {', '.join(cameras)} names a camera twice")
    if tiles_per_camera < 1:
        raise InputError(f"--tiles-per-camera {tiles_per_camera}: at least 1")
    if frames < 1:
        raise InputError(f"--frames {frames}: at least 1 (the newest frame set)")
    cfg = read_config(model)
    tok = Tokenizer(model)
    layout, source = resolve_layout(layout, model)
    prompt = build_prompt(tok, cfg.system_message, layout, cameras, question, tiles_per_camera * cfg.tokens_per_tile,
                          tuple(tuple(turn) for turn in history), frames)
    q0, q1 = prompt.question_span
    return {
        "model": str(model),
        "layout": layout,
        "layout_from": source,
        "added_by_tokenizer": {"before": [tok.id_to_token(i) for i in tok.added_around_text[0]],
                               "after": [tok.id_to_token(i) for i in tok.added_around_text[1]]},
        "tokens_per_camera": tiles_per_camera * cfg.tokens_per_tile,
        "frames": frames,
        "length": len(prompt.input_ids),
        "sha256": prompt_digest(prompt.input_ids),
        "input_ids": list(prompt.input_ids),
        "text": render(tok, prompt.input_ids),
        # camera by camera, each camera's frames oldest first (frame 1 the oldest, `frames` the newest)
        "cameras": [{"camera": cameras[i // frames], "frame": i % frames + 1, "start": start, "count": count}
                    for i, (start, count) in enumerate(prompt.image_spans)],
        "question": {"start": q0, "end": q1, "text": tok.decode(prompt.input_ids[q0:q1])},
    }


def collapsed_ids(ids: list[int]) -> str:
    """Ids with each run of one repeated id written `ID x N`."""
    parts, i = [], 0
    while i < len(ids):
        n = 1
        while i + n < len(ids) and ids[i + n] == ids[i]:
            n += 1
        parts.append(f"{ids[i]} x{n}" if n > 2 else ", ".join([str(ids[i])] * n))
        i += n
    return "[" + ", ".join(parts) + "]"


def run(args) -> int:
    layout = args.layout.replace("\\n", "\n") if args.layout is not None else None
    d = describe(args.model, args.question, args.cameras, args.tiles_per_camera, layout, args.history, args.frames)
    if args.json:
        print(json.dumps(d, ensure_ascii=False))
        return 0
    added = d["added_by_tokenizer"]
    print(f"layout: {d['layout']!r} ({d['layout_from']}); tokenizer adds {added['before'] or 'nothing'} before, "
          f"{added['after'] or 'nothing'} after; {d['length']} tokens, {d['tokens_per_camera']} per camera; "
          f"sha256 {d['sha256']}\n")
    print(d["text"])
    print("\ncamera spans (index of the first <IMG_CONTEXT>, count):")
    for c in d["cameras"]:
        frame = f" Frame{c['frame']}" if d["frames"] > 1 else ""
        print(f"  {c['camera'] + frame:<24} {c['start']:>6} {c['count']:>6}")
    q = d["question"]
    print(f"question rows [{q['start']}, {q['end']}): {q['text']!r}\n")
    print(f"input_ids: {collapsed_ids(d['input_ids'])}")
    return 0
