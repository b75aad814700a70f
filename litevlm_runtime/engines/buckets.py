"""Static shape buckets per stage.

Graphs, TensorRT engines and CUDA graphs are built for fixed shapes. A call with a variable
count (selected tiles, prompt rows after token selection, draft-tree size) runs in the smallest
bucket that holds it; the engine pads the rest and the padding is masked or ignored:

  vision   tiles    padded tiles are zeros; tiles are independent, their outputs are dropped
  prefill  rows     the prompt (no earlier cache rows): padded rows attend only to themselves
  decoder  rows     decode / tree-verify steps over the cache: padded rows likewise
  head     rows     padded rows are independent, their logits are dropped

The decoder step graph always attends over the whole static KV cache (max_len columns); the mask
says which columns are live, so the cache length is not a bucket dimension. The prefill graph
has no cache input at all: a prompt attends only to itself.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import LiteVLMError

STAGE_KEYS = ("vision", "prefill", "step", "head")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Buckets:
    vision: tuple[int, ...]    # tile counts
    prefill: tuple[int, ...]   # decoder rows for the prompt (template + kept visual tokens + question)
    step: tuple[int, ...]      # decoder rows per decode step: 1 (plain greedy) and the draft-tree size
    head: tuple[int, ...]      # LM-head rows: 1 (last prompt row / decode) and the draft-tree size

    def __post_init__(self):
        for key in STAGE_KEYS:
            values = getattr(self, key)
            if not values or any(int(v) < 1 for v in values):
                raise LiteVLMError(f"buckets: {key} needs positive sizes, got {values!r}")
            object.__setattr__(self, key, tuple(sorted({int(v) for v in values})))

    def decoder(self) -> tuple[int, ...]:
        """Every row count of a decoder call (prefill and step sizes together)."""
        return tuple(sorted(set(self.prefill) | set(self.step)))

    def for_stage(self, stage: str) -> tuple[int, ...]:
        """Graph stage -> its buckets: `prefill` (the prompt, no history), `decoder` (steps over the
        cache), `vision`, `head`."""
        return self.step if stage == "decoder" else getattr(self, stage)

    def to_dict(self) -> dict:
        return {k: list(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Buckets":
        try:
            return cls(**{k: tuple(d[k]) for k in STAGE_KEYS})
        except KeyError as exc:
            raise LiteVLMError(f"buckets: missing {exc.args[0]!r}") from None


def pick(sizes: tuple[int, ...], n: int, stage: str) -> int:
    """The smallest bucket that holds n rows/tiles."""
    for size in sizes:
        if size >= n:
            return size
    keys = "step=..." if stage == "decoder" else f"{stage}=..."
    raise LiteVLMError(f"{stage}: {n} exceeds the largest shape bucket {max(sizes)}; "
                       f"re-export with a larger bucket (litevlm export --buckets '{keys}')")


def default_buckets(arena) -> Buckets:
    """Buckets derived from the arena's maxima: tiles for 1, 2, 3 and 6 cameras (what the view
    selector typically keeps); prompts at a quarter, half and all of the longest prompt and at
    every camera's visual tokens plus 64 or 192 text rows (the common full-rig prompt), rounded
    to 64 rows; decode steps of 1 row and of the draft tree."""
    lim = arena.limits
    tpc = lim.tiles_per_camera
    vision = tuple(sorted({c * tpc for c in (1, 2, 3, lim.cameras) if c <= lim.cameras}))
    longest = arena.max_prompt
    sizes = [longest * f // 4 for f in (1, 2, 4)] + [arena.max_visual + 64, arena.max_visual + 192]
    prefill = tuple(sorted({min(round_up(n, 64), longest) for n in sizes}))
    step = tuple(sorted({1, lim.tree_tokens}))
    return Buckets(vision=vision, prefill=prefill, step=step, head=step)


def parse_buckets(spec: str | None, defaults: Buckets) -> Buckets:
    """`vision=2,6;prefill=256,512;step=1,64;head=1,64` (any subset; others keep defaults)."""
    if not spec:
        return defaults
    values = defaults.to_dict()
    for part in spec.replace(" ", "").split(";"):
        if not part:
            continue
        key, sep, sizes = part.partition("=")
        if not sep or key not in STAGE_KEYS:
            raise LiteVLMError(f"--buckets {part!r}: expected KEY=N[,N...] with KEY one of {', '.join(STAGE_KEYS)}")
        try:
            values[key] = [int(s) for s in sizes.split(",") if s]
        except ValueError:
            raise LiteVLMError(f"--buckets {part!r}: sizes must be integers") from None
    return Buckets.from_dict(values)


def check_fits(buckets: Buckets, arena) -> None:
    """Every bucket must fit the arena the graphs will be bound to."""
    lim = arena.limits
    limits = {"vision": lim.max_tiles(), "prefill": arena.max_query, "step": arena.max_query,
              "head": arena.max_query}
    for key, most in limits.items():
        too_big = [v for v in getattr(buckets, key) if v > most]
        if too_big:
            raise LiteVLMError(f"buckets: {key} sizes {too_big} exceed the arena's maximum {most}")
