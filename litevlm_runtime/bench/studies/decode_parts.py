"""What five changes to the decode step outside its GEMVs are worth: projections of one input stacked
into one low-bit call (weights/lowbit.fuse_projections: q, k, v and gate, up), the step's K/V rows
written into the cache, read there without a copy, with a few rows' attention as matmuls
(LayerCall.rows_in_cache, models/decoder.attend_few_rows), the layer's small operators as one
kernel call each (models/decoder.on_layer_ops: RMSNorm, RoPE, SwiGLU), and the whole layer as one call
(kernels/decode_layer.cpp, DecoderLayer.step_args: it needs the other three), and the kernels' helpers awake
between calls where the CPU has room (lowbit_kernels.cpp, set_helper_spin_us), switched in turn, in one process.

    litevlm bench --study decode_parts [--preset internvl3-2b] [--weights int4-rtn] [--threads 2]
                                        [--context 256,1780] [--steps 8] [--rounds 8] [--hog 0]
                                        [--variants none,default]

A step is bench/roofline.py's `decode_step` (the decoder over `context` cached rows through the torch
engine, the LM head, the argmax). The variants alternate block by block, the order reversed every
other round, so a shared machine's load hits them alike; a variant is switched by clearing the stacked
forms (the projections then run one by one on the same buffers) and by sending the step down the
engine's other path (the copy path that slots away from the cache's end take), so every variant runs
code the runtime runs. --hog N: the rounds beside N busy processes (bench/contention.py). Beside the wall
time, each block's CPU time of the calling thread and of the whole process per step: beside busy processes
the calling thread's share of the wall time is what the scheduler gave the step's critical path (the
helpers only share the calls it hands out), and process CPU above the wall time is helpers awake.
Then what the calling thread waited per step, after its own chunks, for chunks a helper had taken and
not finished (the kernels' row_pool_waits), and the share of shared calls it waited in: beside busy
processes a helper put aside while it holds a chunk holds the step until it runs again.
The variant "all, on one CPU" is the default with every thread of the process held to the CPU the
calling thread is on (and freed after its block): the step's one-core work, and beside busy processes
what the step takes when the process has one CPU to itself rather than its share in pieces.
"""

from __future__ import annotations

import litevlm_runtime  # noqa: F401 - before torch, so that its threads sleep when idle (threads.py)

# isort: split
import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from litevlm_runtime.bench.contention import Hog
from litevlm_runtime.bench.random_model import random_pipeline
from litevlm_runtime.bench.roofline import decode_step
from litevlm_runtime.engines import torch_engine
from litevlm_runtime.errors import InputError
from litevlm_runtime.models import decoder
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.report import table

# the five changes on or off, and whether the process's threads are held to one CPU (not a change: a probe)
VARIANTS = {"none": (False, False, False, False, False, False),
            "stacked projections": (True, False, False, False, False, False),
            "rows in the cache": (False, True, False, False, False, False),
            "layer operators": (False, False, True, False, False, False),
            "all but layer operators": (True, True, False, False, True, False),
            "all but one call a layer": (True, True, True, False, True, False),
            "all but helpers awake": (True, True, True, True, False, False),
            "all (the default)": (True, True, True, True, True, False),
            "all, on one CPU": (True, True, True, True, True, True)}
ALL_ON = VARIANTS["all (the default)"]


class Switches:
    """The five changes on or off in a built pipeline."""

    def __init__(self, lm):
        self.stacked = [(g[0], g[0].fused) for layer in lm.layers for g in layer.same_input()
                        if getattr(g[0], "fused", None) is not None]
        self.follows_live = torch_engine.follows_live
        self.on_layer_ops = decoder.on_layer_ops
        self.step_args = decoder.DecoderLayer.step_args
        self.spin_us = torch.ops.litevlm_lowbit.set_helper_spin_us(0)
        torch.ops.litevlm_lowbit.set_helper_spin_us(self.spin_us)
        self.cpus = os.sched_getaffinity(0)

    def set(self, stacked: bool, in_cache: bool, layer_ops: bool, one_call: bool, awake: bool,
            one_cpu: bool) -> None:
        for first, fused in self.stacked:
            first.fused = fused if stacked else None
        torch_engine.follows_live = self.follows_live if in_cache else (lambda *_: False)
        decoder.on_layer_ops = self.on_layer_ops if layer_ops else (lambda _: False)
        decoder.DecoderLayer.step_args = self.step_args if one_call else (lambda _: None)
        torch.ops.litevlm_lowbit.set_helper_spin_us(self.spin_us if awake else 0)
        hold_threads({current_cpu()} if one_cpu else self.cpus)


def current_cpu() -> int:
    """The CPU the calling thread runs on now (/proc's stat field 39: Python's os has no sched_getcpu)."""
    return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])


def hold_threads(cpus: set[int]) -> None:
    """Every thread of this process (the kernels' helpers and torch's pool too) allowed only `cpus`."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:                       # a thread that ended meanwhile
            pass


def chosen_variants(spec: str | None) -> list[str]:
    """The variants --variants names (each a whole name or a part of exactly one), in the table's order."""
    if not spec:
        return list(VARIANTS)
    chosen = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        hits = [n for n in VARIANTS if n == part] or [n for n in VARIANTS if part in n]
        if len(hits) != 1:
            raise InputError(f"--variants {part!r}: {'matches ' + ', '.join(hits) if hits else 'matches no variant'} "
                             f"(the variants: {'; '.join(VARIANTS)})")
        chosen.add(hits[0])
    return [n for n in VARIANTS if n in chosen]


def process_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="litevlm bench --study decode_parts", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="internvl3-2b", help="random weights of this preset's shapes")
    p.add_argument("--weights", default="int4-rtn", help="backend.weights (a low-bit form: int4-rtn, int8)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", default="256,1780", help="cached rows before the step, comma-separated")
    p.add_argument("--steps", type=int, default=8, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=8, help="alternating blocks per variant")
    p.add_argument("--hog", type=int, default=0, help="busy processes beside every round")
    p.add_argument("--variants", help="comma-separated variants (a part of a name will do: none,default); "
                                      "the first is the speed-up's base")
    args = p.parse_args(argv)
    variants = chosen_variants(args.variants)
    contexts = [int(c) for c in args.context.split(",")]
    pipe = random_pipeline(args.preset, options_from_flat({"pipeline": "baseline", "backend.threads": args.threads,
                                                           "backend.weights": args.weights,
                                                           "decoding.mode": "greedy"}))
    switches = Switches(pipe.rt.lm)
    if not switches.stacked:
        raise InputError(f"--weights {args.weights}: no projections stacked (a low-bit form on the kernels stacks "
                         f"them: int4-rtn or int8 on a CPU with AVX2)")
    print(f"{args.preset} (random weights), {args.weights}, {args.threads} thread(s); {len(switches.stacked)} groups "
          f"of projections stacked", file=sys.stderr, flush=True)
    load_before = Path("/proc/loadavg").read_text().split()[0]
    rows = []
    try:
        with Hog(args.hog), torch.inference_mode():
            for context in contexts:
                step = decode_step(pipe.rt, context)
                ms = {name: [] for name in variants}
                thread_ms, process_ms = {name: [] for name in variants}, {name: [] for name in variants}
                wait_ms, waited = {name: [] for name in variants}, {name: [] for name in variants}
                for r in range(args.rounds):
                    for name in (variants if r % 2 == 0 else variants[::-1]):
                        switches.set(*VARIANTS[name])
                        step()                                    # warm after the switch
                        torch.ops.litevlm_lowbit.row_pool_waits()          # (zeroes the counts)
                        t0, c0, p0 = time.perf_counter(), time.thread_time(), process_cpu_s()
                        for _ in range(args.steps):
                            step()
                        ms[name].append((time.perf_counter() - t0) * 1000 / args.steps)
                        thread_ms[name].append((time.thread_time() - c0) * 1000 / args.steps)
                        process_ms[name].append((process_cpu_s() - p0) * 1000 / args.steps)
                        calls, waits, wait_ns = torch.ops.litevlm_lowbit.row_pool_waits()
                        wait_ms[name].append(wait_ns / 1e6 / args.steps)
                        waited[name].append(waits / calls if calls else 0.0)
                    print(f"[context {context}, round {r + 1}/{args.rounds}] "
                          + "  ".join(f"{n} {v[-1]:.1f} ms" for n, v in ms.items()), file=sys.stderr, flush=True)
                base = statistics.median(ms[variants[0]])
                rows += [[context, name, statistics.median(v), min(v), statistics.median(thread_ms[name]),
                          statistics.median(process_ms[name]), statistics.median(wait_ms[name]),
                          f"{statistics.median(waited[name]):.0%}", base / statistics.median(v)]
                         for name, v in ms.items()]
    finally:
        switches.set(*ALL_ON)
    load_after = Path("/proc/loadavg").read_text().split()[0]
    print(f"\n{args.preset} (random weights) decode step, {args.weights}, {args.threads} thread(s), beside {args.hog} "
          f"busy process(es); {args.rounds} alternating blocks of {args.steps} steps per variant; 1-min load "
          f"{load_before} -> {load_after}\n")
    print(table(["context", "variant", "p50 ms/step", "min ms/step", "calling thread CPU ms/step",
                 "process CPU ms/step", "waited for helpers ms/step", "shared calls waited",
                 f"speed-up vs {variants[0]}"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
