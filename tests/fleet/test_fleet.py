"""litevlm fleet eval on one machine: BAGS arguments, the run folder (one atomic partition per bag,
written once), in-process runs that answer exactly as bag eval does and resume, the comparison
and its report (what it says where the rules score nothing, lost bags, effective parameters,
stdout/stderr), and the slow multi-node cases. The cluster, object storage and job cases are in
test_fleet_cluster.py."""

import os
import shutil
from pathlib import Path

import pytest
from helpers.fleet import answers, bag_eval

from litevlm_runtime.cli import main
from litevlm_runtime.errors import InputError
from litevlm_runtime.fleet.dataset import RunFolder, record_json
from litevlm_runtime.fleet.run import FleetConfig, run_fleet
from litevlm_runtime.fleet.sources import expand_bags

ROOT = Path(__file__).resolve().parents[2]


def test_bags_from_the_command_line_and_list_files(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    for d in ("x", "y"):
        (tmp_path / d / "drive").mkdir()
    (tmp_path / "x" / "one.mcap").write_bytes(b"")
    listing = tmp_path / "x" / "bags.txt"
    listing.write_text("# release set\ndrive\none.mcap   # a bare MCAP file\n\n../y/drive\n/nowhere/bag\n")
    refs = expand_bags([listing, tmp_path / "x" / "drive"])
    assert [r.path for r in refs] == [str(tmp_path / "x" / "drive"), str(tmp_path / "x" / "one.mcap"),
                                      str(tmp_path / "y" / "drive"), "/nowhere/bag"]   # relative to the list; once
    assert len({r.key for r in refs}) == 4 and refs[0].key.startswith("drive-") and refs[1].key.startswith("one-")
    assert expand_bags([tmp_path / "x" / "drive"])[0].key == refs[0].key               # stable across runs
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(InputError, match="no bags"):
        expand_bags([tmp_path / "empty.txt"])


def test_a_bag_partition_is_atomic_and_written_once(tmp_path):
    run = RunFolder(tmp_path / "run")
    row = {"bag_path": "/b", "seq": 0, "query_id": "q", "question": "?", "answer": "a", "status": "ok",
           "status_code": 0, "cameras": ["CAM_FRONT"], "token_ids": [1], "frame_stamps_ns": {"CAM_FRONT": 5}}
    with run.lock():
        (run.answers.local_path() / ".tmp-b-1234").mkdir()    # a driver killed before its rename
        with pytest.raises(InputError, match="another"), run.lock():
            pass
    with run.lock():
        assert not list(run.answers.local_path().glob(".tmp-*"))
        run.write_bag("b", [row], {"answers": 1})
        with pytest.raises(FileExistsError):
            run.write_bag("b", [row], {"answers": 1})
        run.mark_failed("c", {"reason": "broken"})
    assert run.complete_keys() == {"b"} and run.bag_meta("b") == {"answers": 1}
    (back,) = run.read_rows()
    assert back["bag"] == "b" and back["frame_stamps_ns"] == {"CAM_FRONT": 5} and back["gt_answer"] is None
    assert run.failures() == {"c": {"reason": "broken"}}


def test_in_process_run_answers_as_bag_eval_and_resumes(tmp_path, bags, params, drivelm_dir):
    out = tmp_path / "run"
    plan = expand_bags([bags["small"], bags["two"], bags["corrupt"]])
    keys = [b.key for b in plan]
    cfg = FleetConfig(plan, out, params, ground_truth=[str(drivelm_dir)], workers=0, progress=False)

    def stop_after_first_bag(event):
        if event["event"] == "done":
            raise KeyboardInterrupt             # the driver stopped (Ctrl-C) after one bag
    with pytest.raises(KeyboardInterrupt):
        run_fleet(cfg, stop_after_first_bag)
    run = RunFolder(out)
    assert run.complete_keys() == {keys[0]}
    first_file = run.part_file(keys[0]).local_path()
    inode = first_file.stat().st_ino

    started = []
    result = run_fleet(cfg, lambda e: started.append(e["bag"]) if e["event"] == "start" else None)
    assert started == keys[1:]                  # only what was not finished
    assert result.skipped == keys[:1] and result.complete == keys[1:2] and result.exit_code == 1
    assert "cannot read the bag" in result.failed[keys[2]] or "corrupt" in result.failed[keys[2]].lower()
    assert first_file.stat().st_ino == inode    # never rewritten
    rows = run.read_rows()
    for bag in (bags["small"], bags["two"]):
        key = expand_bags([bag])[0].key
        mine = sorted((r for r in rows if r["bag"] == key), key=lambda r: r["seq"])
        assert [r["seq"] for r in mine] == list(range(len(mine)))
        assert answers(mine) == bag_eval(bag, params)       # exactly bag eval's answers
        assert [record_json(r)["query_id"] for r in mine] == [a["query_id"] for a in bag_eval(bag, params)]
    assert all(r["gt_question_id"] and r["gt_answer"] for r in rows)     # every question is DriveLM's
    manifest = run.read_manifest()
    assert manifest["bags"][keys[2]]["status"] == "failed" and manifest["invocations"][0]["interrupted"]
    assert manifest["model"]["sha256"] and manifest["params"]["max_new_tokens"] == 4

    started.clear()
    assert run_fleet(cfg, lambda e: started.append(e["bag"]) if e["event"] == "start" else None).exit_code == 1
    assert started == keys[2:]                  # a failed bag is tried again, finished ones are not
    changed = FleetConfig(plan, out, params | {"max_new_tokens": 5}, workers=0, progress=False,
                          ground_truth=[str(drivelm_dir)])
    with pytest.raises(InputError, match="max_new_tokens"):
        run_fleet(changed)


@pytest.mark.skipif(shutil.which("java") is None, reason="language scores need Java")
def test_cli_eval_then_compare(tmp_path, bags, params, drivelm_dir, tiny_model):
    common = [str(bags["small"]), "--set", f"model_dir={tiny_model}", "--set", "max_new_tokens=4",
              "--ground-truth", str(drivelm_dir), "--workers", "0", "--quiet"]
    assert main(["fleet", "eval", *common, "--out", str(tmp_path / "a")]) == 0
    assert main(["fleet", "eval", *common, "--set", "pipeline=baseline", "--out", str(tmp_path / "b")]) == 0
    assert main(["fleet", "compare", str(tmp_path / "a"), str(tmp_path / "a"), "--report", str(tmp_path / "same"),
                 "--max-p99-ratio", "1.0", "--max-changed", "0", "--lenient"]) == 0
    code = main(["fleet", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "rep"),
                 "--max-p99-ratio", "0.0001", "--lenient"])
    assert code == 1                           # the p99 gate is crossed at any latency
    html = (tmp_path / "rep" / "index.html").read_text()
    assert "FAILED" in html and "pipeline" in html and "latency_stages.png" in html
    if shutil.which("chromium"):                # the report as a person sees it: not a blank page
        import subprocess

        import numpy as np
        from PIL import Image

        shot = tmp_path / "shot.png"
        subprocess.run(["bash", str(ROOT / "scripts" / "studies" / "fleet_screenshot.sh"), str(tmp_path / "rep"),
                        str(shot), "1000x1400"], check=True, timeout=120)
        pixels = np.asarray(Image.open(shot).convert("L"), dtype=float)
        assert pixels.shape == (1400, 1000) and pixels.std() > 10


@pytest.mark.skipif(shutil.which("java") is None, reason="language scores need Java")
def test_the_report_cannot_mislead(tmp_path, bags, drivelm_dir, tiny_model, capsys):
    """B ran with other parameters and lost a bag (its copy became unreadable): the comparison's
    parameter table shows the values that ran (tokens.keep_ratio 0 resolves to 0.8), says first
    that the challenge's rules scored no answer for accuracy and calls changed answers "changed",
    fails the gate on the lost bag by default and says so on stdout; progress goes to stderr;
    every row names its model and project version."""
    import json

    from litevlm_runtime import __version__

    drive = tmp_path / "drive.mcap"
    shutil.copy(bags["two"], drive)
    common = [str(bags["small"]), str(drive), "--set", f"model_dir={tiny_model}", "--ground-truth", str(drivelm_dir),
              "--workers", "0"]
    assert main(["fleet", "eval", *common, "--set", "max_new_tokens=4", "--out", str(tmp_path / "a"), "--quiet"]) == 0
    capsys.readouterr()
    drive.write_bytes(drive.read_bytes()[:1000])                          # B cannot read it any more
    assert main(["fleet", "eval", *common, "--set", "max_new_tokens=6", "--set", "tokens.keep_ratio=0.1",
                 "--out", str(tmp_path / "b")]) == 1                     # with the progress bar
    out, err = capsys.readouterr()
    assert "fleet eval: drive.mcap: FAILED:" in err and "fleet eval: drive.mcap: FAILED" not in out
    assert out.startswith("fleet eval: 1 bag(s) evaluated, 0 already finished, 1 failed") and "  FAILED drive-" in out
    rows = RunFolder(tmp_path / "a").read_rows()
    assert {r["model_sha256"] for r in rows} == {RunFolder(tmp_path / "a").read_manifest()["model"]["sha256"]}
    assert {r["project_version"] for r in rows} == {__version__}

    code = main(["fleet", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert code == 1                                                      # no gate given: the lost bag fails it
    assert "NOTE: under the challenge rules no answer was scored for accuracy" in out
    assert "B LOST 1 bag(s)" in out and "lost bag drive-" in out and "failed in B:" in out
    assert "THRESHOLD B lost 1 bag(s)" in out and "gates: 1 crossed" in out
    assert "parameter tokens.keep_ratio: 0.8 -> 0.1" in out and "0.0 -> 0.1" not in out
    html = (tmp_path / "r" / "index.html").read_text()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["no_accuracy_scored"] and summary["changed_answers"] and summary["lost_bags"]
    assert html.index("no answer was scored for accuracy") < html.index("<h2>")      # at the top
    assert "&nbsp; changed" in html and not any(f"{n} {v}" in html for n in "AB" for v in ("right", "wrong"))
    assert "effective values" in html and "<td class=\"l\">0.8</td><td class=\"l\">0.1</td>" in html
    assert main(["fleet", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "r2"),
                 "--allow-lost"]) == 0
    assert main(["fleet", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "r3"),
                 "--allow-lost", "--lenient"]) == 0
    lenient = json.loads((tmp_path / "r3" / "summary.json").read_text())
    judged = [c for c in lenient["changed_answers"] if c["A_correct"] is not None]
    assert judged and len(judged) < len(lenient["changed_answers"])       # tag-0 questions only
    assert "A wrong" in (tmp_path / "r3" / "index.html").read_text()


@pytest.mark.slow
def test_a_lost_node_ends_every_bag_complete(tmp_path, bags, params, drivelm_dir):
    """Two Ray nodes (raylets) on this machine, one actor on each; the worker node is removed
    (every process of it killed) after the first answer it streams: its bag is redone by the
    actor that is left, and every bag's answers are there exactly once."""
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    short = tempfile.mkdtemp(prefix="lvray-")       # unix socket paths: <= 107 bytes
    env = {"RAY_TMPDIR": short, "RAY_AUTH_MODE": "disabled"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker_node = cluster.add_node(num_cpus=1)
    # a bag is handed only to an actor that has loaded its model: the long bag first keeps the first
    # ready actor busy long enough for the other to take the next one
    plan = expand_bags([bags["long"], bags["two"], bags["small"]])
    events, removed = [], []

    def lose_node(event):
        events.append(event)
        if event["event"] == "start" and event["node"] == worker_node.node_id:
            removed.append(event["bag"])
        if event["event"] == "row" and removed and event["bag"] == removed[0] and len(removed) == 1:
            cluster.remove_node(worker_node, allow_graceful=False)
            removed.append("gone")
    try:
        cfg = FleetConfig(plan, tmp_path / "run", params, ray_address=cluster.address, workers=2, threads=1,
                          progress=False)
        result = run_fleet(cfg, lose_node)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(short, ignore_errors=True)
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert removed[-1] == "gone"
    assert any(e["event"] == "died" and e["bag"] == removed[0] for e in events)
    assert sorted(result.complete) == sorted(b.key for b in plan) and not result.failed
    rows = RunFolder(tmp_path / "run").read_rows()
    for bag in (bags["long"], bags["two"], bags["small"]):
        key = expand_bags([bag])[0].key
        mine = sorted((r for r in rows if r["bag"] == key), key=lambda r: r["seq"])
        assert answers(mine) == bag_eval(bag, params)


@pytest.mark.slow
def test_bench_two_workers_answer_as_one(tmp_path, bags, params, drivelm_dir, monkeypatch):
    """`fleet bench` on a local Ray instance (no --ray): 1 and 2 workers, the same answers as each
    other and as bag eval of each bag (the speed is the note's business, not a test's)."""
    import tempfile

    from litevlm_runtime.fleet.bench import scaling

    short = tempfile.mkdtemp(prefix="lvray-")      # Ray's files (not /tmp/ray); sockets <= 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", short)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    plan = expand_bags([bags["small"], bags["two"]])
    try:
        text, result = scaling(lambda out, n: FleetConfig(plan, out, params, workers=n, threads=1, progress=False),
                               [1, 2], tmp_path / "bench", versus_bag_eval=True)
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert result["identical_runs"] and result["identical_to_bag_eval"], text
    assert "vs 1 worker(s)" in text
