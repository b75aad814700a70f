"""What the finite check of every weight (weights/finite.py) costs a load: a model folder loaded
with no check, with one read of every page (what the first forward costs at least) and with the
check, alternating, best of N; one table with the ratio to the page-reading load.

    python -m litevlm_runtime.bench.finite_cost DIR [ROUNDS]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ..weights import checkpoint
from ..weights.finite import check_finite
from ..weights.integrity import verify_model_folder


def main(argv: list[str]) -> int:
    """Time a full load of a model folder with and without the check (one table, ratio)."""
    folder = Path(argv[0])
    rounds = int(argv[1]) if len(argv) > 1 else 2
    verify_model_folder(folder)          # hash once: every timed load then verifies from the digest cache
    def touch(source, name, t):          # one read of every 4 KB page: what the first forward costs at least
        if t.numel():
            t.reshape(-1)[:: max(1, 4096 // t.element_size())].sum()

    variants = {"load, no finite check": lambda *a: None, "load + read every page": touch,
                "load + finite check": check_finite}
    times = {label: [] for label in variants}
    for r in range(rounds):              # alternating, so page cache and CPU load favour neither
        for label in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            checkpoint.check_finite = variants[label]
            t0 = time.perf_counter()
            model = checkpoint.load_model(folder)
            times[label].append(time.perf_counter() - t0)
            n = sum(p.numel() for p in model.parameters())
            del model
    checkpoint.check_finite = check_finite
    best = {label: min(ts) for label, ts in times.items()}
    base = best["load + read every page"]
    print(f"{folder} ({n / 1e9:.2f} B parameters, float32, best of {rounds})")
    print(f"| {'what':24} | {'s':>7} | {'ratio':>5} |")
    print(f"|{'-' * 26}|{'-' * 9}|{'-' * 7}|")
    for label, s in best.items():
        print(f"| {label:24} | {s:7.2f} | {s / base:5.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
