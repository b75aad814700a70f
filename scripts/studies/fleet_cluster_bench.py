"""The fleet on a cluster as a team runs it, measured on this machine: a Ray cluster started with
`ray start --head` (token authentication as Ray sets it up) and a real S3 API server (moto) on
loopback, the bags uploaded to it, then

1. `litevlm fleet bench` of the bags on S3 with pools of 1 and 2 workers, sizes alternating round
   by round (the table: wall time and its ratio to 1 worker, bags/min, per-bag time, CPU, the
   transfer each worker fetched per bag, load average);
2. a regression like a release's (optional, --report): run B with `--set tokens.keep_ratio=0.1`
   after one bag was deleted from the bucket, `fleet compare` of the bench's first 1-worker run
   (A) with it, the report written and screenshotted (scripts/studies/fleet_screenshot.sh).

    python scripts/studies/fleet_cluster_bench.py BAG_DIR... --out /tmp/fleet-bench \\
        [--ground-truth DIR ...] [--rounds 2] [--cpus 2] [--report docs/fleet_report.png]

The bags are local rosbag2 folders or .mcap files (e.g. made with `litevlm synth` + `litevlm bag
make`); each is uploaded as s3://bags/bench/NAME. Every process it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.ray import environment, ray_cluster  # noqa: E402
from helpers.s3 import s3_server  # noqa: E402

from litevlm_runtime.cli import main  # noqa: E402


def log(text: str) -> None:
    print(f"[fleet_cluster_bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bags", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="a new local folder for the runs and the report")
    ap.add_argument("--ground-truth", action="append", default=[], type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=2, help="the cluster's CPUs (the bench's 2 workers get 1 each)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="node parameters for every run")
    ap.add_argument("--report", type=Path, help="also run the regression and save the report's screenshot here")
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: give a new --out")
    args.out.mkdir(parents=True)
    common = [*(f"--set={s}" for s in args.set), *(f"--ground-truth={g.resolve()}" for g in args.ground_truth)]
    with s3_server() as s3:
        uris = []
        for bag in args.bags:
            uri = f"s3://bags/bench/{bag.name}"
            s3.upload(bag.resolve(), uri)
            uris.append(uri)
        log(f"S3 API server (moto) at {s3.endpoint}; {len(uris)} bags uploaded")
        node_env = {**s3.env("node"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        with ray_cluster(cpus=args.cpus, auth=True, env=node_env) as cluster, environment(s3.env("driver")):
            log(f"Ray cluster at {cluster.address} (token authentication: "
                f"{'on' if 'Token authentication is enabled' in cluster.head.output else 'off'})")
            code = main(["fleet", "bench", *uris, "--ray", cluster.address, "--workers", "1,2", "--rounds",
                         str(args.rounds), "--out", str(args.out / "bench"), "--json", str(args.out / "bench.json"),
                         *common])
            if args.report is None:
                return code
            s3.delete(uris[-1])
            log(f"deleted {uris[-1]} from the bucket; run B with tokens.keep_ratio=0.1")
            main(["fleet", "eval", *uris, "--ray", cluster.address, "--out", str(args.out / "b"), "--quiet",
                  "--set", "tokens.keep_ratio=0.1", *common])
            with environment(s3.env("node")):       # a reviewer who may read the bags (the thumbnails)
                code = main(["fleet", "compare", str(args.out / "bench" / "workers1-round0"), str(args.out / "b"),
                             "--report", str(args.out / "report"), "--max-p99-ratio", "1.10"])
        subprocess.run(["bash", str(ROOT / "scripts" / "studies" / "fleet_screenshot.sh"), str(args.out / "report"),
                        str(args.report.resolve()), "1300x2200"], check=True)
        log(f"report {args.out / 'report' / 'index.html'}, screenshot {args.report}")
    return code


if __name__ == "__main__":
    sys.exit(run())
