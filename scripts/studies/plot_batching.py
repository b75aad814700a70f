"""Throughput and p99 latency against serving.max_batch, from one `litevlm bag peak --json` run
with a configuration per max_batch (docs/serving.md):

    litevlm bag peak runs/drive_bag --concurrency 4 --set serving.max_batch=4 \
        --versus b1=serving.max_batch=1 --versus b2=serving.max_batch=2 --json runs/peak.json
    python scripts/studies/plot_batching.py runs/peak.json docs/batching.png

Throughput: each configuration's peak rate (highest rate under 5% queue_full). p99: of queue +
pipeline milliseconds over the ok answers of the trial at that peak rate. Prints the table it plots.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the file backend
import numpy as np  # noqa: E402


def rows(doc: dict) -> list[tuple[int, float, float, float]]:
    out = []
    for label, c in doc["configs"].items():
        batch = int(c["overrides"].get("serving.max_batch", 4))
        trials = c["trials"]
        at_peak = next((i for i, t in enumerate(trials) if t["rate"] == c["peak_rate"]), None)
        prefix = f"peak{at_peak + 1}_" if at_peak is not None else None
        lat = [a["queue_ms"] + a["total_ms"] for a in c["answers"]
               if a["status"] == "ok" and prefix and a["query_id"].startswith(prefix)]
        p99 = float(np.percentile(lat, 99)) if lat else float("nan")
        out.append((batch, c["peak_rate"], p99, c["lone_pipeline_p50_ms"]))
    return sorted(out)


def main() -> None:
    doc = json.loads(open(sys.argv[1]).read())
    table = rows(doc)
    print(f"{'max_batch':>10}{'peak q/s':>10}{'p99 ms':>10}{'lone p50 ms':>13}")
    for b, rate, p99, lone in table:
        print(f"{b:>10}{rate:>10.2f}{p99:>10.0f}{lone:>13.1f}")
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=120)
    xs = [r[0] for r in table]
    ax.plot(xs, [r[1] for r in table], "o-", color="tab:blue", label="peak rate (q/s)")
    ax.set_xlabel("serving.max_batch")
    ax.set_ylabel("peak rate, queries/s (< 5% queue_full)", color="tab:blue")
    ax.set_xticks(xs)
    ax2 = ax.twinx()
    ax2.plot(xs, [r[2] for r in table], "s--", color="tab:red", label="p99 at peak (ms)")
    ax2.set_ylabel("p99 queue + pipeline at that rate, ms", color="tab:red")
    ax.set_title(f"bundled model, DriveLM sample bag, {doc['concurrency']} clients at once", fontsize=9)
    fig.tight_layout()
    fig.savefig(sys.argv[2])
    print(f"-> {sys.argv[2]}")


if __name__ == "__main__":
    main()
