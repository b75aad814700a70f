"""Fleet regression: many bags, each evaluated exactly as `litevlm bag eval` does, on a pool of Ray
actors, written as one Parquet dataset per run, and two runs compared in a report.

  sources.py      BAGS arguments (bag folders, .mcap/.db3 files, list files) -> BagRef
  groundtruth.py  DriveLM/SynthDrive QA folders -> the reference answer of a bag's question
  worker.py       BagEvaluator: the model loaded once, one bag at a time through bag.evaluate;
                  FleetWorker: the same as a Ray actor that streams answers as they come
  dataset.py      a run folder: rows schema, per-bag atomic Parquet partitions, failures, manifest
  run.py          `litevlm fleet eval`: plan (resume), the actor pool, retries, progress, exit code
  compare.py      `litevlm fleet compare`: scores (the challenge's rules), changes, latency, gates
  report.py       the comparison as static HTML with PNG plots, thumbnails and summary.json
  bench.py        `litevlm fleet bench`: wall time of N workers against 1 in the same run
"""
