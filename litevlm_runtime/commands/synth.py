"""`litevlm synth`: generate a SynthDrive set (six-camera scenes + DriveLM-format QA)."""

from __future__ import annotations

import json

from ..errors import InputError


def register(subparsers) -> None:
    p = subparsers.add_parser("synth", help="generate SynthDrive: six-camera scenes with DriveLM-format QA")
    p.add_argument("--out", required=True, help="output folder (created; must be new, empty or a SynthDrive set)")
    p.add_argument("--scenes", type=int, required=True, help="number of scenes (one key frame each)")
    p.add_argument("--seed", type=int, default=0, help="scene i is drawn from RNG([seed, i]) (default 0)")
    p.add_argument("--width", type=int, default=1600, help="image width in pixels (default 1600, like nuScenes)")
    p.add_argument("--height", type=int, default=900, help="image height in pixels (default 900)")
    p.add_argument("--sizes", help="render each scene at one of these sizes, drawn per scene (mixed resolutions), "
                                   "e.g. 480x270,800x450,1600x900; instead of --width/--height")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of scenes (the last ones) written to val.json (default 0.1)")
    p.add_argument("--frames", type=int, default=1,
                   help="time steps per scene (default 1: one frame set, as before); K > 1: every scene in motion, "
                        "rendered at K steps --stride apart, the key frame last, with motion questions that need "
                        "time (docs/motion.md)")
    p.add_argument("--stride", type=float, default=0.5,
                   help="seconds between time steps with --frames (default 0.5: DriveLM's key frames are 2 Hz)")
    p.add_argument("--sheet", metavar="PNG",
                   help="with --frames: also draw one scene's six cameras over time, with each key object's "
                        "ground-truth position at every step, into this PNG")
    p.add_argument("--sheet-scene", type=int, default=0, metavar="N", help="the scene --sheet draws (default 0)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..synth.generate import SynthSpec, generate
    sizes = None
    if args.sizes:
        try:
            sizes = [tuple(int(v) for v in size.lower().split("x")) for size in args.sizes.split(",")]
        except ValueError:
            raise InputError(f"--sizes {args.sizes!r}: expected WxH[,WxH...], e.g. 480x270,1600x900") from None
        if any(len(size) != 2 for size in sizes):
            raise InputError(f"--sizes {args.sizes!r}: expected WxH[,WxH...], e.g. 480x270,1600x900")
    if args.sheet and args.frames < 2:
        raise InputError("--sheet draws a scene over time: it needs --frames K with K > 1")
    spec = SynthSpec(args.scenes, args.seed, args.width, args.height, args.val_fraction, sizes=sizes,
                     frames=args.frames, stride=args.stride)
    info = generate(args.out, spec, workers=args.workers, progress=not args.quiet)
    if args.sheet:
        from ..evaluation.motion_sheet import sequence_sheet
        info["sheet"] = str(sequence_sheet(args.out, args.sheet, scene=args.sheet_scene))
    print(json.dumps(info))
    return 0
