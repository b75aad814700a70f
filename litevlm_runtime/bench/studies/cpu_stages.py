"""The compute-bound stages of a whole question on the CPU (vision over tiles, the prompt's prefill),
each in the variants of its GEMM, alternating in one process: before/after in the same run, under
the same load (issue 43: where a whole six-camera question spends its time on 2 cores).

    litevlm bench --study cpu_stages [--preset internvl3-2b | --model DIR] [--weights int4-rtn] [--threads 2]
        [--stages prefill,vision] [--prefill-rows 256] [--tiles 1]
        [--prefill-gemm bfloat16,int8] [--vision-gemm float32,bfloat16] [--rounds 3] [--hog N]

prefill   the decoder over --prefill-rows prompt rows (the torch engine's prefill: every layer, the
          K/V rows stored), per `backend.lowbit_prefill` variant (set_prefill_gemm on the same
          low-bit forms; with --weights float or bf16 the one GEMM those run)
vision    InternViT + projector over --tiles tiles of random pixels, per `backend.vision_gemm`
          variant: float32 (the vision linears as built: oneDNN or MKL float32, weights/gemm.py),
          bfloat16 (the same linears as Bf16Linear, weights/bf16.py) or int8 (as Int8Linear, on the
          int8 GEMM: AVX-512 VNNI or AVX2)

A variant may name its attention after a slash, GEMM/ATTENTION with ATTENTION sdpa (torch's
scaled_dot_product_attention) or bf16 (the kernels' bfloat16 attention): e.g. --prefill-gemm
int8/sdpa,int8/bf16 times the attention alone; without one it follows the GEMM as a pipeline's does
(bfloat16 attention beside bfloat16 or int8 GEMMs where the CPU has AVX-512 BF16).

Variants alternate within every round (order reversed every other round); the table gives each
round's ms, the median, GFLOP/s (FLOPs counted once per stage by torch's FlopCounterMode) and the
median's speed-up over the first variant. The first variant is the reference of the same run:
put the old path first. --hog N runs every round beside N busy processes (`litevlm bench
--contention`'s spin hogs). The 1-minute load average is printed before and after.
"""

from __future__ import annotations

import litevlm_runtime  # noqa: F401 - before torch, so that its threads sleep when idle (threads.py)

# isort: split
# (libgomp reads OMP_WAIT_POLICY once, when `import torch` loads it)
import argparse
import os
import statistics
import sys
import time

import torch

from litevlm_runtime.bench.contention import Hog
from litevlm_runtime.bench.roofline import count_flops
from litevlm_runtime.kernels import lowbit_kernels
from litevlm_runtime.kernels.cpuinfo import read_cpuinfo
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.report import table
from litevlm_runtime.weights.bf16 import Bf16Linear
from litevlm_runtime.weights.linear_forms import child_linears, use_bf16_attention
from litevlm_runtime.weights.lowbit import Int8Linear, set_prefill_gemm


def build(args):
    settings = {"pipeline": "baseline", "backend.threads": args.threads, "decoding.mode": "greedy",
                "backend.weights": args.weights, "backend.vision_gemm": "float32",
                **dict(s.split("=", 1) for s in args.set)}
    options = options_from_flat(settings)
    if args.model:
        from litevlm_runtime.pipeline.pipeline import Pipeline

        return Pipeline.from_pretrained(args.model, options)
    from litevlm_runtime.bench.random_model import random_pipeline

    return random_pipeline(args.preset, options)


class VisionSwitch:
    """The vision encoder's and projector's linears as built (float32), as Bf16Linear or as Int8Linear on
    the int8 GEMM (backend.vision_gemm's forms), swapped in place; a form is made when first used."""

    def __init__(self, model):
        self.vision = model.vision_model
        self.slots = [(parent, name, {"float32": module})
                      for parent, name, module in child_linears([model.vision_model, model.mlp1])]

    def use(self, variant: str) -> None:
        if variant not in ("float32", "bfloat16", "int8"):
            raise SystemExit(f"--vision-gemm {variant!r}: float32, bfloat16 or int8")
        if variant == "int8" and not lowbit_kernels.has_int8_gemm():
            raise SystemExit(f"--vision-gemm int8: needs the low-bit kernels ({lowbit_kernels.unavailable()})")
        use_bf16_attention([self.vision], variant != "float32")       # as vision_to sets it
        for parent, name, forms in self.slots:
            if variant not in forms:
                forms[variant] = Bf16Linear(forms["float32"]) if variant == "bfloat16" else Int8Linear(forms["float32"])
                forms[variant].prefill_int8 = variant == "int8"
            setattr(parent, name, forms[variant])


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="internvl3-2b")
    ap.add_argument("--model", help="a model folder instead of a preset's random weights")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another pipeline setting")
    ap.add_argument("--weights", default="int4-rtn", help="backend.weights of the pipeline (one form)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stages", default="prefill,vision")
    ap.add_argument("--prefill-rows", type=int, default=256)
    ap.add_argument("--tiles", type=int, default=1)
    ap.add_argument("--prefill-gemm", default="bfloat16,int8", help="lowbit_prefill variants, reference first")
    ap.add_argument("--vision-gemm", default="float32,bfloat16", help="vision_gemm variants, reference first")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hog", type=int, default=0, help="busy processes beside every round")
    return ap


def gemm_variant(use, roots):
    """A stage's switch to variant `GEMM[/ATTENTION]`: `use(GEMM)`, and the bfloat16 attention of
    `roots` on or off when an attention is named."""
    def apply(v: str) -> None:
        gemm, _, attention = v.partition("/")
        use(gemm)
        if attention:
            if attention not in ("sdpa", "bf16"):
                raise SystemExit(f"variant {v!r}: attention sdpa or bf16 after the slash")
            use_bf16_attention(roots, attention == "bf16")
    return apply


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    torch.manual_seed(0)
    pipe = build(args)
    rt = pipe.rt
    a, e = rt.arena, rt.engines
    stages = [s for s in args.stages.split(",") if s]
    rows = min(args.prefill_rows, a.max_prompt)
    tiles = min(args.tiles, a.pixels.shape[0])
    embeds = torch.randn(rows, rt.cfg.llm.hidden_size, generator=torch.Generator().manual_seed(1)) * 0.02
    pixels = torch.randn(a.pixels[:tiles].shape, generator=torch.Generator().manual_seed(2))
    vision = VisionSwitch(rt.model)
    lowbit = rt.weights is not None and rt.weights.prefill is not None

    def prefill():
        e.decoder.prefill(embeds, a.positions[:rows], a.causal_mask(rows))

    def encode():
        e.vision.run(pixels)

    runs = {"prefill": (prefill, args.prefill_gemm.split(",") if lowbit else [args.weights],
                        gemm_variant(lambda v: set_prefill_gemm([rt.model], v) if lowbit else None, [rt.lm])),
            "vision": (encode, args.vision_gemm.split(","), gemm_variant(vision.use, [rt.model.vision_model]))}
    unknown = [s for s in stages if s not in runs]
    if unknown:
        raise SystemExit(f"--stages {','.join(unknown)}: prefill, vision")
    vendor, flags = read_cpuinfo() or ("?", [])
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
    load0 = os.getloadavg()[0]
    times = {(s, v): [] for s in stages for v in runs[s][1]}
    flops = {}
    with torch.inference_mode(), Hog(args.hog, "spin"):
        for stage in stages:
            fn, variants, use = runs[stage]
            use(variants[0])
            fn()                                                    # warm: kernels built, buffers sized
            flops[stage] = count_flops(fn)
            for r in range(args.rounds):
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    use(v)
                    fn()                                            # warm after a swap
                    t0 = time.perf_counter()
                    fn()
                    times[(stage, v)].append(time.perf_counter() - t0)
                    print(f"{stage} {v} round {r + 1}: {times[(stage, v)][-1] * 1e3:.0f} ms", file=sys.stderr)
            use(variants[0])
    load1 = os.getloadavg()[0]

    label = {"prefill": f"prefill ({rows} rows)", "vision": f"vision ({tiles} tile{'s' if tiles > 1 else ''})"}
    out = []
    for stage in stages:
        variants = runs[stage][1]
        ref = statistics.median(times[(stage, variants[0])])
        for v in variants:
            ts = times[(stage, v)]
            med = statistics.median(ts)
            out.append([label[stage], v, ", ".join(f"{t * 1e3:.0f}" for t in ts), f"{med * 1e3:.0f}",
                        f"{flops[stage] / 1e9:.0f}", f"{flops[stage] / med / 1e9:.0f}", f"{ref / med:.2f}x"])
    print(f"{rt.cfg.llm.architecture} {args.model or args.preset}: weights {args.weights}, {args.threads} thread(s), "
          f"{args.rounds} rounds, variants alternating; beside {args.hog} busy processes; 1-min load {load0:.2f} -> "
          f"{load1:.2f}; {vendor}, {' '.join(f for f in wanted if f in flags)}\n")
    print(table(["stage", "variant", "ms (rounds)", "median ms", "GFLOP", "GFLOP/s", "vs first"], out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
