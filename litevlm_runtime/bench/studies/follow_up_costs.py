"""What a follow-up question costs against the same conversation asked from scratch (docs/serving.md):

  follow-up      Pipeline.answer(follow_up_of=): no view or token selection, the earlier turn's KV
                 rows copied into the region, prefill over the rows after them only
  from scratch   Pipeline.answer(history=) with the frame keys (its vision from the feature cache, as
                 a node's would be): view selection, token selection on the first question, and a
                 prefill over the whole conversation
  copies         the two KV copies a follow-up adds: a turn's rows out of its region into its slot
                 (every kept answer pays it) and back into a region (every follow-up pays it)

Both decode greedily (a follow-up decodes with plain steps; EAGLE-2 would give the same tokens), so the
answers must be equal (checked) and the decode stages comparable. Per turn, the median of --repeats
repetitions, the two orders alternating. Frames: the DriveLM sample's first key frame when it is
there, else random. `--memory`: the arena's bytes under serving.max_turns / serving.conversations.

    litevlm bench --study follow_up_costs [--model DIR] [--repeats 15] [--max-new 24] [--threads 1]
    litevlm bench --study follow_up_costs --memory [--preset internvl2_5-2b --dtype float16 --tiles 2]
"""

from __future__ import annotations

import litevlm_runtime  # noqa: F401 - before torch, so that its threads sleep when idle (threads.py)

# isort: split
# (libgomp reads OMP_WAIT_POLICY once, when `import torch` loads it)
import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.arena import Arena
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.pipeline.runtime import DTYPES, arena_limits
from litevlm_runtime.report import table
from litevlm_runtime.stages.prompt import resolve_layout
from litevlm_runtime.weights.checkpoint import read_config
from litevlm_runtime.weights.presets import preset
from litevlm_runtime.weights.tokenizer import Tokenizer

TURNS = ["What is in front of the ego vehicle?", "Is it moving?", "What should the ego vehicle do about it?",
         "Why?"]
SAMPLE = Path(__file__).resolve().parents[4] / "shared" / "drivelm_sample" / "samples"


def frames() -> tuple[dict, str]:
    if SAMPLE.is_dir():
        files = {cam: sorted((SAMPLE / cam).iterdir())[0] for cam in CAMERAS}
        return {cam: f.read_bytes() for cam, f in files.items()}, "DriveLM sample, first key frame"
    rng = np.random.default_rng(0)
    return {cam: rng.integers(0, 256, (450, 800, 3), dtype=np.uint8) for cam in CAMERAS}, "random 800x450"


def memory(model: str, preset_name: str | None, dtype: str, tiles: int) -> None:
    """The arena's bytes as runtime.arena_limits sizes it, allocated on the meta device (no memory,
    no weights): `model`'s config and tokenizer, or a preset's config with `model`'s tokenizer
    standing in for the template's rows."""
    tok = Tokenizer(model)
    cfg = preset(preset_name) if preset_name else read_config(Path(model))
    layout = "internvl" if preset_name else resolve_layout(None, model)[0]
    rows = []
    for turns, conversations in ((1, 0), (2, 4), (3, 4), (4, 4), (4, 8)):
        opts = options_from_flat({"serving.max_turns": turns, "serving.conversations": conversations, "dtype": dtype,
                                  "tiles_per_camera": tiles}).resolved(None)
        a = Arena(cfg, arena_limits(cfg, tok, opts, layout), DTYPES[dtype], torch.device("meta"))
        size = {k: t.numel() * t.element_size() for k, t in a.buffers().items() if k not in ("k_cache", "v_cache")}
        kv = sum(v for k, v in size.items() if k in ("k_regions", "v_regions", "k_turns", "v_turns"))
        rows.append([turns, conversations, a.max_len, f"{sum(size.values()) / 2**20:.1f}", f"{kv / 2**20:.1f}",
                     f"{(size['k_turns'] + size['v_turns']) / 2**20:.1f}"])
    print(f"{preset_name or model}, {dtype}, {tiles} tile(s) per camera, max_batch {opts.serving.max_batch}")
    print(table(["max_turns", "conversations", "max_len", "arena MiB", "KV MiB", "of which kept turns MiB"], rows))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1, help="backend.threads (0: one per core)")
    ap.add_argument("--memory", action="store_true", help="print the arena's bytes per setting instead")
    ap.add_argument("--preset", help="--memory of a preset's shapes (e.g. internvl2_5-2b)")
    ap.add_argument("--dtype", default="float32", help="--memory: the arena's dtype")
    ap.add_argument("--tiles", type=int, default=1, help="--memory: tiles per camera")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.memory:
        return memory(args.model, args.preset, args.dtype, args.tiles)

    pipe = Pipeline.from_pretrained(
        args.model,
        options_from_flat({"decoding.mode": "greedy", "max_new_tokens": args.max_new, "backend.threads": args.threads}),
    )
    rt, a = pipe.rt, pipe.rt.arena
    images, source = frames()
    keys = {c: "f" for c in images}
    pipe.warm_up()
    stages = ("view_select", "token_select", "prefill", "decode")
    ms = {(turn, kind, s): [] for turn in range(2, len(TURNS) + 1) for kind in ("follow", "scratch")
          for s in (*stages, "total", "rows")}
    copies = {"keep": [], "restore": [], "rows": []}
    for r in range(args.repeats):
        first = pipe.answer(images, QueryRequest(TURNS[0], query_id=(r, 1), keep_turn=True), frame_keys=keys)
        history = [(TURNS[0], first.text)]
        for turn in range(2, len(TURNS) + 1):
            q = TURNS[turn - 1]
            runs = {}
            for kind in (("follow", "scratch") if (r + turn) % 2 else ("scratch", "follow")):
                if kind == "follow":
                    runs[kind] = pipe.answer(
                        images,
                        QueryRequest(q, follow_up_of=(r, turn - 1), query_id=(r, turn), keep_turn=True),
                        frame_keys=keys,
                    )
                else:
                    runs[kind] = pipe.answer(images, QueryRequest(q, history=history), frame_keys=keys)
            assert runs["follow"].token_ids == runs["scratch"].token_ids, (r, turn)
            for kind, ans in runs.items():
                for s in stages:
                    ms[(turn, kind, s)].append(ans.stage_ms[s])
                ms[(turn, kind, "total")].append(ans.total_ms)
                ms[(turn, kind, "rows")].append(ans.input_tokens)
            history.append((q, runs["follow"].text))
        kept = rt.conversations.follow((r, len(TURNS) - 1))
        with torch.inference_mode():
            for _ in range(10):
                t0 = time.perf_counter()
                rt.conversations.keep(("copy", r), replace(kept), a.k_cache, a.v_cache)   # (its rows' sizes)
                t1 = time.perf_counter()
                rt.conversations.restore(kept, kept.rows + [(-1, -1)], a.k_cache, a.v_cache)
                t2 = time.perf_counter()
                copies["keep"].append((t1 - t0) * 1e3)
                copies["restore"].append((t2 - t1) * 1e3)
        copies["rows"].append(len(kept.rows))

    med = statistics.median
    print(f"{pipe.name}, {pipe.options.label()}, greedy, answer cap {args.max_new}, {source}, "
          f"{args.repeats} repetitions, threads {torch.get_num_threads()}")
    rows = []
    for turn in range(2, len(TURNS) + 1):
        for kind in ("scratch", "follow"):
            row = [turn, "from scratch (history=)" if kind == "scratch" else "follow-up (follow_up_of=)",
                   int(med(ms[(turn, kind, "rows")]))]
            row += [f"{med(ms[(turn, kind, s)]):.2f}" for s in (*stages, "total")]
            row.append(f"{med(ms[(turn, 'follow', 'total')]) / med(ms[(turn, 'scratch', 'total')]):.2f}"
                       if kind == "follow" else "1.00")
            rows.append(row)
    print(table(["turn", "", "prefill rows", *(f"{s} ms" for s in stages), "total ms", "x scratch"], rows))
    print(f"\nKV copies of a turn of {int(med(copies['rows']))} rows: into its slot {med(copies['keep']):.3f} ms, "
          f"back into a region {med(copies['restore']):.3f} ms (medians)")


if __name__ == "__main__":
    main()
