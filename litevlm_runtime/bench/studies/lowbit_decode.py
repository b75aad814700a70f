"""Decode steps with each decoder weight form (`backend.weights`), quiet and beside N busy processes,
in one process: ms per token (p50, p99, p99/p50) per form and condition, and the forms' speed-ups
over one another. The issue-35 bars it checks: int4 decode >= 1.5x int8's; beside 2 busy
processes, int4's p99/p50 no worse than that of "today's passive threads" (the tree the issue was
filed on: --against; this tree's float path is the other reference), per step and per window of
as many steps as take one float step (the same span of time).

    litevlm bench --study lowbit_decode [--preset internvl3-2b] [--weights int4-rtn,int8,fp16,float]
                                    [--threads 2] [--hog 2] [--hog-kind spin] [--steps 20] [--rounds 3]
                                    [--context 256] [--model DIR --set backend.quantized=DIR] [--omp]
                                    [--against DIR --against-weights int8] [--plot PNG]

A step is what greedy decoding pays per token (bench/roofline.py `decode_step`: the decoder over
`context` cached rows through the torch engine, the LM head, the argmax). The forms alternate
within every round and condition (order reversed every other round), all kept in memory at once
(LinearForms): at InternVL3-2B that is the float weights (6.2 GB) plus each low-bit copy; leave
`float` out to stay near 3 GB. The busy processes are `litevlm bench --contention`'s hogs.

--against DIR: also the forms of another checkout of this project (e.g. `git worktree add /tmp/filed
7d7774f`, the tree issue 35 was filed against, whose int8 ran on torch's kernels and the passive
OpenMP threads the issue calls "today's"), built from the same preset and seed in a child process
that imports DIR's package, its steps taken in turn with this process's under the same busy
processes; rows '<form> @DIR'.

--plot PNG: each form's loaded steps over its quiet p50, as a histogram and over time (one
round's run): where the loaded spread comes from.
"""

from __future__ import annotations

import litevlm_runtime  # before torch, so that its threads sleep when idle (threads.py)

# isort: split
# (libgomp reads OMP_WAIT_POLICY once, when `import torch` loads it: sorted after torch, the
# package's PASSIVE came too late and these measurements ran with spinning threads)
import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

# Only what every tree since issue 35 was filed has is imported here: `--serve` runs this file
# over another checkout's package (--against); what is newer is imported in main().
from litevlm_runtime.bench.contention import Hog
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.weights.linear_forms import LinearForms


def build(args):
    settings = {"pipeline": "baseline", "backend.threads": args.threads, "decoding.mode": "greedy",
                **dict(s.split("=", 1) for s in args.set)}
    options = options_from_flat(settings)
    if args.model:
        from litevlm_runtime.pipeline.pipeline import Pipeline

        return Pipeline.from_pretrained(args.model, options)
    from litevlm_runtime.bench.random_model import random_pipeline

    return random_pipeline(args.preset, options)


def timed_steps(step, count: int) -> list[float]:
    step()                                                   # warm: first call after a swap
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def older_decode_step(rt, context: int):
    """bench/roofline.py decode_step, written out: a tree under --against may predate it."""
    a, e = rt.arena, rt.engines
    context = min(context, a.max_len - 2)
    x = torch.zeros(1, rt.cfg.llm.hidden_size, dtype=rt.dtype, device=rt.device)

    def run():
        hidden = e.decoder.step(x, a.positions[context:context + 1], a.slots[context:context + 1],
                                a.all_visible(1, context), a.causal_mask(1))
        e.head.run(hidden).argmax(-1)
    return run


@torch.inference_mode()
def serve(args) -> None:
    """The child of --against: lines 'FORM STEPS' on stdin, each answered by one JSON line of step
    times on stdout (everything else this process prints goes to stderr)."""
    reply, sys.stdout = sys.stdout, sys.stderr
    package = os.path.dirname(os.path.realpath(litevlm_runtime.__file__))
    if os.path.dirname(package) != os.path.realpath(os.getcwd()):   # the installed package, not the checkout's
        raise SystemExit(f"--against {os.getcwd()}: no litevlm_runtime package there (would import {package})")
    kinds = [w for w in args.weights.split(",") if w]
    rt = build(args).rt
    forms = LinearForms(rt.model, kinds, keep_float="float" in kinds)
    step = older_decode_step(rt, args.context)
    print(json.dumps({"ready": torch.get_num_threads()}), file=reply, flush=True)
    for line in sys.stdin:
        kind, count = line.split()
        forms.use(kind)
        print(json.dumps(timed_steps(step, int(count))), file=reply, flush=True)


class Against:
    """The --against child: another checkout's forms, asked for steps in turn with ours."""

    def __init__(self, args):
        self.name = os.path.basename(os.path.abspath(args.against))
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--preset", args.preset, "--weights",
               args.against_weights, "--threads", str(args.threads), "--context", str(args.context)]
        cmd += [x for s in args.set for x in ("--set", s)]
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.against)}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=args.against)
        ready = self.proc.stdout.readline()
        if not ready:
            raise SystemExit(f"--against {args.against}: the child exited before it was ready (its error is above)")
        self.threads = json.loads(ready)["ready"]
        print(f"--against: {args.against_weights} from {os.path.abspath(args.against)}/litevlm_runtime, "
              f"{self.threads} thread(s)", flush=True)

    def steps(self, kind: str, count: int) -> list[float]:
        self.proc.stdin.write(f"{kind} {count}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


@torch.inference_mode()
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="internvl3-2b")
    ap.add_argument("--model", help="a model folder instead of a preset's random weights")
    ap.add_argument("--weights", default="int4-rtn,int8,fp16,float")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hog", type=int, default=2, help="busy processes in the loaded condition")
    ap.add_argument("--hog-kind", default="spin", help="spin (a Python loop) | matmul (numpy, one thread)")
    ap.add_argument("--steps", type=int, default=20, help="steps per form, condition and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a pipeline setting")
    ap.add_argument("--omp", action="store_true",
                    help="also run each low-bit form's kernels in OpenMP regions instead of their own helpers "
                         "(rows '<form> omp'; lowbit_kernels.cpp RowPool)")
    ap.add_argument("--against", metavar="DIR", help="another checkout whose forms run in turn with these")
    ap.add_argument("--against-weights", default="int8", help="the forms of --against's tree")
    ap.add_argument("--plot", metavar="PNG", help="loaded steps over quiet p50 per form: histogram and series")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.serve:
        return serve(args)
    from litevlm_runtime.bench.roofline import decode_step
    from litevlm_runtime.kernels import lowbit_kernels
    from litevlm_runtime.kernels.cpuinfo import read_cpuinfo
    from litevlm_runtime.report import table
    from litevlm_runtime.weights.linear_forms import DECODER_KINDS, Quantized, quantized_folder

    kinds = [w for w in args.weights.split(",") if w]
    pipe = build(args)
    rt = pipe.rt
    quantized = None
    if "int4" in kinds:
        folder = quantized_folder(rt.options.backend.quantized, rt.model_dir)
        quantized = Quantized(folder, rt.model_dir) if folder else None
    forms = LinearForms(rt.model, kinds, quantized=quantized, keep_float="float" in kinds)
    forms.use(kinds[0])
    step = decode_step(rt, args.context)
    # (label, form, whether the kernels' own helpers run the small calls)
    variants = [(k, k, True) for k in kinds]
    if args.omp:
        variants += [(f"{k} omp", k, False) for k in kinds if k in DECODER_KINDS]
    against = Against(args) if args.against else None
    if against:
        variants += [(f"{k} @{against.name}", k, None) for k in args.against_weights.split(",") if k]
    labels = [label for label, _, _ in variants]
    row_pool = torch.ops.litevlm_lowbit.use_row_pool if lowbit_kernels.load() else (lambda on: on)
    samples = {(k, c): [] for k in labels for c in ("quiet", "loaded")}
    load0 = os.getloadavg()[0]
    for r in range(args.rounds):
        for cond in ("quiet", "loaded"):
            with Hog(args.hog if cond == "loaded" else 0, args.hog_kind):
                for kind, form, pool in (variants if r % 2 == 0 else variants[::-1]):
                    if pool is None:
                        samples[(kind, cond)] += against.steps(form, args.steps)
                        continue
                    forms.use(form)
                    row_pool(pool)
                    samples[(kind, cond)] += timed_steps(step, args.steps)
                    row_pool(True)
            print(f"[round {r + 1}/{args.rounds}, {cond}] " + "  ".join(
                f"{k} {statistics.median(samples[(k, cond)]):.1f} ms" for k in labels), flush=True)
    if against:
        against.close()
    vendor, flags = read_cpuinfo() or ("?", [])
    print(f"\n{rt.name}: decode step over {args.context} cached rows, {torch.get_num_threads()} thread(s), "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}; {args.rounds} rounds x {args.steps} steps per "
          f"form and condition, forms alternating; loaded = beside {args.hog} {args.hog_kind} processes; "
          f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}; {vendor}, "
          f"{' '.join(f for f in ('avx2', 'fma', 'f16c', 'avx512f') if f in flags)}\n")
    # The same spread over the same span of time: a step of 50 ms feels a scheduler slice that a
    # 600 ms one averages out, so each form's steps are also summed in windows of as many steps as
    # take one float step (quiet p50s), within each round's run of --steps, and that sum's p99/p50 is
    # the steadiness of the tokens a user waits for over that time.
    quiet = {k: statistics.median(samples[(k, "quiet")]) for k in labels}
    rows = window_rows(labels, samples, quiet, args.steps)
    print(table(["weights", "condition", "p50 ms", "p99 ms", "p99/p50", "min ms", "max ms",
                 "window (steps)", "windows", "window p99/p50"], rows))
    print("\n" + table(["same run (p50 speed-up)", "quiet", "loaded"], speedup_rows(labels, samples)))
    if args.plot:
        plot(args.plot, labels, samples, quiet, args)
        print(f"\nwrote {args.plot}")


def window_rows(labels: list[str], samples: dict, quiet: dict, steps: int) -> list[list]:
    """Per form and condition: p50, p99, their ratio, min, max, and the p99/p50 of the sums over windows
    of as many steps as take one float step (within each round's run of `steps`)."""
    from litevlm_runtime.timing import percentile

    span = quiet.get("float")
    rows = []
    for kind in labels:
        # At most a round's run of steps: windows never span two rounds (a form far faster than float
        # would otherwise want more steps than a run holds, and have no windows at all).
        window = min(steps, max(1, round(span / quiet[kind]))) if span else 1
        for cond in ("quiet", "loaded"):
            v = samples[(kind, cond)]
            p50, p99 = statistics.median(v), percentile(v, 99)
            sums = [sum(v[b + i:b + i + window]) for b in range(0, len(v), steps)
                    for i in range(0, steps - window + 1, window)]
            rows.append([kind, cond, p50, p99, f"{p99 / p50:.2f}", min(v), max(v), window, len(sums),
                         f"{percentile(sums, 99) / statistics.median(sums):.2f}"])
    return rows


def speedup_rows(labels: list[str], samples: dict) -> list[list[str]]:
    """Each pair of forms' p50 speed-up (the later's p50 over the earlier's), quiet and loaded."""
    ratios = []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            p50 = {c: (statistics.median(samples[(b, c)]), statistics.median(samples[(a, c)]))
                   for c in ("quiet", "loaded")}
            ratios.append([f"{a} vs {b}"] + [f"{p50[c][0] / p50[c][1]:.2f}x" for c in ("quiet", "loaded")])
    return ratios


def plot(path: str, labels: list[str], samples: dict, quiet: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist, series) = plt.subplots(1, 2, figsize=(13, 4.5))
    bins = [1 + i * 0.05 for i in range(-8, 61)]
    for kind in labels:
        rel = [t / quiet[kind] for t in samples[(kind, "loaded")]]
        hist.hist(rel, bins=bins, histtype="step", density=True, lw=1.5,
                  label=f"{kind} (quiet p50 {quiet[kind]:.0f} ms)")
        first = samples[(kind, "loaded")][:args.steps]   # round 1's run of steps
        series.plot([t / 1000 for t in itertools.accumulate(first)], rel[:args.steps], lw=1, label=kind)
    hist.set_xlabel("loaded step time / quiet p50")
    hist.set_ylabel("density")
    hist.set_title(f"beside {args.hog} busy processes, {args.rounds} x {args.steps} steps per form")
    hist.legend(fontsize=8)
    series.set_xscale("log")
    series.set_xlabel("seconds into round 1's loaded run (log)")
    series.set_ylabel("step time / quiet p50")
    series.set_title("the same steps in order")
    series.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
