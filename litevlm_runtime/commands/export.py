"""`litevlm export`: a checkpoint -> a bundle of per-stage, per-bucket ONNX graphs + manifest.json."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..report import table
from .ask import add_pipeline_args, pipeline_options


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="export every stage as ONNX graphs per shape bucket (a bundle)")
    add_pipeline_args(p)
    p.add_argument("--out", type=Path, required=True, help="bundle folder to write")
    p.add_argument("--buckets", help="shape buckets, e.g. 'vision=2,6;prefill=256,512;step=1,64;head=1,64;batch=2,4' "
                                     "(batch: queries per batched decode step, at most serving.max_batch; `batch=`: "
                                     "none; default: derived from the arena limits)")
    p.add_argument("--verify", action="store_true", help="then run every graph in ONNX Runtime against the "
                                                         "PyTorch stage and print the relative errors")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..engines.buckets import default_buckets, parse_buckets
    from ..export.exporter import export_bundle
    from ..pipeline.pipeline import Pipeline

    # The exporter logs one warning per torchvision op it cannot register; we use none of them.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    rt = Pipeline.from_pretrained(args.model, pipeline_options(args)).rt
    buckets = parse_buckets(args.buckets, default_buckets(rt.arena))
    print(f"exporting {args.model} ({rt.options.dtype}) -> {args.out}\nbuckets: {buckets.to_dict()}", file=sys.stderr)
    manifest = export_bundle(rt, args.out, buckets, progress=lambda m: print(m, file=sys.stderr))
    for stage, why in manifest["not_present"].items():
        print(f"{stage}: {why}", file=sys.stderr)
    print(args.out / "manifest.json")
    if args.verify:
        from ..export.exporter import verify_bundle

        rows = verify_bundle(rt, args.out)
        print()
        print(table(["stage", "bucket", "output", "rel error"],
                    [[r["stage"], f"{r['bucket']} ({r['rows']} rows)" if r.get("rows", r["bucket"]) != r["bucket"]
                      else r["bucket"], r["output"], f"{r['rel_error']:.2e}"] for r in rows]))
        print("\nrel error = max |onnxruntime - torch| / max |torch| on random inputs (fp32 target: <= 1e-4); a "
              "quantized cache's stored rows (arena.kv_dtype): the fraction of codes that differ, none by more than "
              "one step (target <= 1e-3)")
        limit = 1e-4 if rt.options.dtype == "float32" else 1e-2
        if any(r["rel_error"] > (r.get("target") or limit) for r in rows):
            print("verify: FAILED", file=sys.stderr)
            return 1
    return 0
