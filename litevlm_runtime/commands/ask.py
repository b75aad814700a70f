"""`litevlm ask`: one question about six camera images, answered with a per-stage latency table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..cameras import CAMERAS
from ..errors import InputError
from ..frames import frame_set
from ..report import table


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
    p.add_argument("--explain", type=Path, metavar="OUT.png",
                   help="also draw what the answer was based on (cameras kept, token scores, the decoder's attention, "
                        "the objects named) as one picture of the rig: PNG, or JPEG for a .jpg name (docs/explain.md)")
    p.add_argument("--explain-width", type=int, default=1440, help="the picture's width in pixels")
    p.set_defaults(func=run)


PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg")


def frame_sets(paths: dict[str, Path], frames: int, stride_s: float) -> list:
    """The question's frame sets, oldest first: the given images (frames 1), or with them the
    `frames` - 1 sets before, `stride_s` apart, found beside each file by the capture time in its
    nuScenes-style name (frames.frames_over_time: an InputError names the camera and step missing)."""
    from ..frames import frames_over_time
    from ..pipeline.frame_sets import FrameSet

    if frames == 1:
        return [FrameSet({cam: p.read_bytes() for cam, p in paths.items()})]
    return [FrameSet({cam: p.read_bytes() for cam, p in s.paths.items()}, {cam: str(p) for cam, p in s.paths.items()})
            for s in frames_over_time(paths, frames, stride_s, cameras=[c for c in CAMERAS if c in paths])]


def run(args) -> int:
    from ..pipeline.pipeline import Pipeline
    from ..pipeline.request import QueryRequest

    if args.explain and args.explain.suffix.lower() not in PICTURE_SUFFIXES:
        raise InputError(f"--explain {args.explain}: write a .png or .jpg file")
    if args.explain_width < 600:
        raise InputError(f"--explain-width {args.explain_width}: at least 600 pixels (three cameras side by side)")

    paths: dict[str, Path] = {}
    if args.frames:
        paths.update(frame_set(args.frames, args.frame_index))
    for item in args.image:
        cam, sep, path = item.partition("=")
        if not sep or cam not in CAMERAS:
            raise InputError(f"--image {item!r}: expected CAM=PATH with CAM one of {', '.join(CAMERAS)}")
        if not Path(path).is_file():
            raise InputError(f"--image {item!r}: no such file")
        paths[cam] = Path(path)
    options = pipeline_options(args)
    sets = frame_sets(paths, options.temporal.frames, options.temporal.stride_s)
    images = sets[-1].images
    pipe = Pipeline.from_pretrained(args.model, options)
    ans = pipe.answer(sets, QueryRequest(args.question, explain=bool(args.explain)))
    if args.explain and ans.trace is None:      # (issue 45: the picture of frames over time is the node's work)
        print(f"explanation: not drawn: an answer over {ans.frames} frame sets is not explained yet", file=sys.stderr)
    elif args.explain:
        write_explanation(pipe, ans, images, args.explain, args.explain_width)
    if args.json:
        print(json.dumps(ans.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(f"Q: {ans.question}\nA: {ans.text}\n")
        if ans.frames > 1 or len(sets) > 1:
            print(f"frame sets: {ans.frames} of {len(sets)} asked; (camera, frame) views encoded "
                  f"{ans.encoded_views}, from the feature cache {ans.reused_views}; visual tokens kept per frame set "
                  f"(oldest first): {ans.kept_per_frame}")
        print(f"pipeline: {ans.pipeline}  cameras: {', '.join(ans.cameras)}  visual tokens: "
              f"{ans.kept_tokens}/{ans.visual_tokens}  input tokens: {ans.input_tokens}  decode steps: "
              f"{ans.decode_steps}  accepted length: {ans.accepted_length:.2f}\n")
        for obj in ans.objects:
            print(f"object {obj.object_id} on {obj.camera} at ({obj.x:g}, {obj.y:g}): {obj.phrase}")
        for why in ans.malformed_tags:
            print(f"malformed tag, ignored: {why}")
        print(table(["stage", "ms"], [[stage, ms] for stage, ms in ans.stage_ms.items()] + [["total", ans.total_ms]]))
    return 0


def write_explanation(pipe, ans, images: dict, out: Path, width: int) -> None:
    """The answer's explanation (its trace, taken because the request asked) drawn into `out`."""
    from ..explain.picture import draw_explanation, encode_jpeg, encode_png
    from ..pipeline.explanation import explain

    explanation = explain(pipe.rt, ans.trace)
    picture = draw_explanation(explanation, images, width)
    data = encode_png(picture) if out.suffix.lower() == ".png" else encode_jpeg(picture, 90)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    cost = ", ".join(f"{part} {ms:.0f} ms" for part, ms in explanation.cost_ms.items())
    print(f"explanation: {out} ({picture.shape[1]} x {picture.shape[0]}; {cost})", file=sys.stderr)
