"""Fleet regression: many bags, each evaluated exactly as `litevlm bag eval` does, on a pool of Ray
actors, written as one Parquet dataset per run, and two runs compared in a report.

  storage.py      local paths and URIs (s3://, gs://, ... via pyarrow.fs / fsspec): bags fetched by
                  workers, objects written whole
  sources.py      BAGS arguments (bag folders, .mcap/.db3 files, list files; paths or URIs) -> BagRef
  groundtruth.py  DriveLM/SynthDrive QA folders -> the reference answer of a bag's question
  worker.py       BagEvaluator: the model loaded once, one bag at a time through bag.evaluate;
                  FleetWorker: the same as a Ray actor that streams answers as they come
  dataset.py      a run folder: rows schema, per-bag atomic Parquet partitions, failures, manifest
  cluster.py      the driver's Ray: --ray / RAY_ADDRESS / auto / ray://, token authentication, a probe
                  that names why a cluster cannot be used
  run.py          `litevlm fleet eval`: plan (resume), the actor pool, retries, progress, exit code
  job.py          `litevlm fleet submit`: a fleet command as a Ray job (Ray Jobs API)
  compare.py      `litevlm fleet compare`: scores (the challenge's rules), changes, latency, gates
  report.py       the comparison as static HTML with PNG plots, thumbnails and summary.json
  bench.py        `litevlm fleet bench`: wall time of N workers against 1 in the same run
"""
