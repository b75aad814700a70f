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
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..synth.generate import generate
    sizes = None
    if args.sizes:
        try:
            sizes = [tuple(int(v) for v in size.lower().split("x")) for size in args.sizes.split(",")]
        except ValueError:
            raise InputError(f"--sizes {args.sizes!r}: expected WxH[,WxH...], e.g. 480x270,1600x900") from None
        if any(len(size) != 2 for size in sizes):
            raise InputError(f"--sizes {args.sizes!r}: expected WxH[,WxH...], e.g. 480x270,1600x900")
    info = generate(args.out, args.scenes, args.seed, args.width, args.height, args.val_fraction,
                    workers=args.workers, progress=not args.quiet, sizes=sizes)
    print(json.dumps(info))
    return 0
