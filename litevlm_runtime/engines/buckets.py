"""Static shape buckets per stage.

Graphs, TensorRT engines and CUDA graphs are built for fixed shapes. A call with a variable
count (selected tiles, prompt rows after token selection, draft-tree size) runs in the smallest
bucket that holds it; the engine pads the rest and the padding is masked or ignored:

  vision   tiles    padded tiles are zeros; tiles are independent, their outputs are dropped
  prefill  rows     the prompt (no earlier cache rows): padded rows attend only to themselves
  decoder  rows     decode / tree-verify steps over the cache: padded rows likewise
  head     rows     padded rows are independent, their logits are dropped
  batch    queries  a batched decode step over the arena's KV regions (batching.py): a row of
                    a free region sees only itself (its cache mask all False), its K/V row is
                    dropped; rows never see each other

An exported decoder step graph attends over the whole static KV cache (max_len columns) and the
mask says which columns are live: the cache length is not a bucket dimension of a bundle.
torch-compile binds its step graphs to column prefixes of the cache as well (compiled.py,
cache_buckets). The prefill graph has no cache input at all: a prompt attends only to itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import LiteVLMError

STAGE_KEYS = ("vision", "prefill", "step", "head")
BATCH_KEY = "batch"               # may be empty: no batched step (an arena of one region)
CACHE_KEY = "cache"               # may be empty: step graphs over the whole static cache


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Buckets:
    vision: tuple[int, ...]    # tile counts
    prefill: tuple[int, ...]   # decoder rows for the prompt (template + kept visual tokens + question)
    step: tuple[int, ...]      # decoder rows per decode step: 1 (plain greedy) and the draft-tree size
    head: tuple[int, ...]      # LM-head rows: 1 (last prompt row / decode), the draft-tree size, the batch sizes
    batch: tuple[int, ...] = ()   # queries per batched decode step (>= 2; a query alone takes `step`)
    cache: tuple[int, ...] = ()   # cache columns a step graph reads (torch-compile; () = all max_len)

    def __post_init__(self):
        for key in STAGE_KEYS:
            values = getattr(self, key)
            if not values or any(int(v) < 1 for v in values):
                raise LiteVLMError(f"buckets: {key} needs positive sizes, got {values!r}")
            object.__setattr__(self, key, tuple(sorted({int(v) for v in values})))
        if any(int(v) < 2 for v in self.batch):
            raise LiteVLMError(f"buckets: batch sizes are 2 or more queries (one query decodes in `step`), "
                               f"got {self.batch!r}")
        object.__setattr__(self, BATCH_KEY, tuple(sorted({int(v) for v in self.batch})))
        if any(int(v) < 1 for v in self.cache):
            raise LiteVLMError(f"buckets: cache needs positive column counts, got {self.cache!r}")
        object.__setattr__(self, CACHE_KEY, tuple(sorted({int(v) for v in self.cache})))

    def decoder(self) -> tuple[int, ...]:
        """Every row count of a decoder call (prefill and step sizes together)."""
        return tuple(sorted(set(self.prefill) | set(self.step)))

    def for_stage(self, stage: str) -> tuple[int, ...]:
        """Graph stage -> its buckets: `prefill` (the prompt, no history), `decoder` (steps over the
        cache), `decoder_batch` (batched steps), `vision`, `head`."""
        named = {"decoder": self.step, "decoder_batch": self.batch}
        return named[stage] if stage in named else getattr(self, stage)

    def to_dict(self) -> dict:
        return {k: list(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Buckets":
        try:
            return cls(**{k: tuple(d[k]) for k in STAGE_KEYS}, batch=tuple(d.get(BATCH_KEY, ())),
                       cache=tuple(d.get(CACHE_KEY, ())))
        except KeyError as exc:
            raise LiteVLMError(f"buckets: missing {exc.args[0]!r}") from None


def pick(sizes: tuple[int, ...], n: int, stage: str) -> int:
    """The smallest bucket that holds n rows/tiles."""
    for size in sizes:
        if size >= n:
            return size
    keys = {"decoder": "step=...", "decoder_batch": "batch=..."}.get(stage, f"{stage}=...")
    raise LiteVLMError(f"{stage}: {n} exceeds the largest shape bucket {max(sizes)}; "
                       f"re-export with a larger bucket (litevlm export --buckets '{keys}')")


def step_cache_sizes(cache: tuple[int, ...], max_len: int) -> tuple[int, ...]:
    """The cache columns the step graphs are bound to: the `cache` buckets and always the whole
    static cache (max_len), so that any step fits one."""
    return tuple(sorted(set(cache) | {max_len}))


def default_buckets(arena) -> Buckets:
    """Buckets derived from the arena's maxima: tiles for 1, 2, 3 and 6 cameras (what the view
    selector typically keeps); prompts at a quarter, half and all of the longest prompt and at
    every camera's visual tokens plus 64 or 192 text rows (the common full-rig prompt), rounded
    to 64 rows; decode steps of 1 row and of the draft tree; batched steps of 2, 3, 4, 8, 16 ..
    queries below the arena's batch and of the whole batch (the head takes those row counts too)."""
    lim = arena.limits
    tpc = lim.tiles_per_camera
    vision = tuple(sorted({c * tpc for c in (1, 2, 3, lim.cameras) if c <= lim.cameras}))
    longest = arena.max_prompt
    sizes = [longest * f // 4 for f in (1, 2, 4)] + [arena.max_visual + 64, arena.max_visual + 192]
    prefill = tuple(sorted({min(round_up(n, 64), longest) for n in sizes}))
    step = tuple(sorted({1, lim.tree_tokens}))
    batch = default_batch(lim.batch)
    return Buckets(vision=vision, prefill=prefill, step=step, head=tuple(sorted(set(step) | set(batch))), batch=batch)


def default_batch(capacity: int) -> tuple[int, ...]:
    """2, 3 and 4, then powers of two, below `capacity`, and `capacity` itself (none for one
    query: it decodes in `step`). Up to 4 queries nothing is padded: on the CPU a padding row
    costs what a real one does (ONNX Runtime, bundled model: 3 rows in a 4-bucket measured
    1.5x 3 rows in a 3-bucket), and a shipped max_batch of 4 should not pay it."""
    if capacity < 2:
        return ()
    sizes = {capacity} | {b for b in (2, 3, 4) if b < capacity}
    b = 8
    while b < capacity:
        sizes.add(b)
        b *= 2
    return tuple(sorted(sizes))


def batch_sizes(exported: tuple[int, ...], capacity: int, where: str) -> tuple[int, ...]:
    """The batch buckets a runtime with `capacity` KV regions binds, from the buckets a batched
    step was built for (`exported`; the graph's batch dimension is dynamic up to the largest,
    so a runtime may run fewer regions than it was built for: its own capacity is then its
    largest bucket). () when the runtime has one region or no batched step was built (`batch=`:
    then batching.py decodes one query at a time)."""
    if capacity < 2 or not exported:
        return ()
    if capacity > max(exported):
        most = max(exported)
        raise LiteVLMError(f"serving.max_batch {capacity}: {where} decodes at most {most} queries per batched step; "
                           f"set serving.max_batch <= {most} or rebuild with --buckets 'batch=...,{capacity}'")
    return tuple(sorted({b for b in exported if b < capacity} | {capacity}))


def parse_buckets(spec: str | None, defaults: Buckets) -> Buckets:
    """`vision=2,6;prefill=256,512;step=1,64;head=1,64;batch=2,4;cache=256,1024` (any subset;
    others keep defaults; `batch=` alone: no batched step)."""
    if not spec:
        return defaults
    values = defaults.to_dict()
    for part in spec.replace(" ", "").split(";"):
        if not part:
            continue
        key, sep, sizes = part.partition("=")
        if not sep or key not in STAGE_KEYS + (BATCH_KEY, CACHE_KEY):
            raise LiteVLMError(f"--buckets {part!r}: expected KEY=N[,N...] with KEY one of "
                               f"{', '.join(STAGE_KEYS + (BATCH_KEY, CACHE_KEY))}")
        try:
            values[key] = [int(s) for s in sizes.split(",") if s]
        except ValueError:
            raise LiteVLMError(f"--buckets {part!r}: sizes must be integers") from None
    return Buckets.from_dict(values)


def check_fits(buckets: Buckets, arena) -> None:
    """Every bucket must fit the arena the graphs will be bound to."""
    lim = arena.limits
    limits = {"vision": lim.max_tiles(), "prefill": arena.max_query, "step": arena.max_query,
              "head": arena.max_query, BATCH_KEY: lim.batch, CACHE_KEY: arena.max_len}
    for key, most in limits.items():
        too_big = [v for v in getattr(buckets, key) if v > most]
        if too_big:
            also = " (its KV regions: serving.max_batch)" if key == BATCH_KEY else ""
            raise LiteVLMError(f"buckets: {key} sizes {too_big} exceed the arena's maximum {most}{also}")
