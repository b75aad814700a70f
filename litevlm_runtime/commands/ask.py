"""`litevlm ask`: one question about six camera images, answered with a per-stage latency table."""

from __future__ import annotations

import json
from pathlib import Path

from ..cameras import CAMERAS
from ..errors import InputError
from ..frames import frame_set
from ..report import answer_table


def add_pipeline_args(p) -> None:
    """--model and the pipeline settings every command that builds a Pipeline shares: one flag
    per setting of the typed configuration, named as the setting (options.py)."""
    from ..options import add_option_flags

    add_option_flags(p)


def pipeline_options(args, **defaults):
    """The flags -> PipelineOptions (dotted-name `defaults` of the command apply first)."""
    from ..options import options_from_args

    return options_from_args(args, **defaults)


def register(subparsers) -> None:
    p = subparsers.add_parser("ask", help="answer one question about six camera images")
    add_pipeline_args(p)
    p.add_argument("--frames", type=Path, help="folder with CAM_X.jpg files or CAM_X/ sub-folders")
    p.add_argument("--frame-index", type=int, default=0, help="which frame of CAM_X/ sub-folders")
    p.add_argument("--image", action="append", default=[], metavar="CAM=PATH", help="one camera image (repeatable)")
    p.add_argument("--question", required=True)
    p.add_argument("--json", action="store_true", help="print the Answer as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..pipeline.pipeline import Pipeline

    images: dict[str, object] = {}
    if args.frames:
        images.update({cam: path.read_bytes() for cam, path in frame_set(args.frames, args.frame_index).items()})
    for item in args.image:
        cam, sep, path = item.partition("=")
        if not sep or cam not in CAMERAS:
            raise InputError(f"--image {item!r}: expected CAM=PATH with CAM one of {', '.join(CAMERAS)}")
        if not Path(path).is_file():
            raise InputError(f"--image {item!r}: no such file")
        images[cam] = Path(path).read_bytes()
    pipe = Pipeline.from_pretrained(args.model, pipeline_options(args))
    ans = pipe.answer(images, args.question)
    if args.json:
        print(json.dumps(ans.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(f"Q: {ans.question}\nA: {ans.text}\n")
        print(f"pipeline: {ans.pipeline}  cameras: {', '.join(ans.cameras)}  visual tokens: "
              f"{ans.kept_tokens}/{ans.visual_tokens}  input tokens: {ans.input_tokens}  decode steps: "
              f"{ans.decode_steps}  accepted length: {ans.accepted_length:.2f}\n")
        print(answer_table(ans))
    return 0
