"""`litevlm ask`: one question about six camera images, answered with a per-stage latency table."""

from __future__ import annotations

import json
from pathlib import Path

from ..cameras import CAMERAS
from ..errors import InputError
from ..frames import frame_set
from ..report import answer_table


def add_pipeline_args(p) -> None:
    """Options every command that builds a Pipeline shares."""
    p.add_argument("--model", type=Path, required=True, help="InternVL2.5 checkpoint folder")
    p.add_argument("--tiles-per-camera", type=int, choices=(1, 2), default=1)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--eagle-tree", default="60,6,10", metavar="TOTAL,DEPTH,TOPK",
                   help="EAGLE-2 draft tree where EAGLE decoding is used (paper defaults 60,6,10)")


def pipeline_options(args):
    from ..pipeline import PipelineOptions

    total, depth, topk = (int(x) for x in args.eagle_tree.split(","))
    return PipelineOptions(device=args.device, dtype=args.dtype, tiles_per_camera=args.tiles_per_camera,
                           max_new_tokens=args.max_new_tokens, threads=args.threads,
                           eagle_total=total, eagle_depth=depth, eagle_topk=topk)


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
    from ..pipeline import Pipeline

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
        print(f"cameras: {', '.join(ans.cameras)}  visual tokens: {ans.kept_tokens}/{ans.visual_tokens}  "
              f"input tokens: {ans.input_tokens}  decode steps: {ans.decode_steps}\n")
        print(answer_table(ans))
    return 0
