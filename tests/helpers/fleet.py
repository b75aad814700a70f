"""Bags, parameters and answer comparisons shared by the fleet tests (test_fleet.py,
test_fleet_cluster.py)."""

from __future__ import annotations

from pathlib import Path

from litevlm_runtime.bag.evaluate import evaluate
from litevlm_runtime.bag.io import write_bag
from litevlm_runtime.bag.make import drivelm_contents
from litevlm_runtime.ros.params_file import load_node_params

ANSWER_FIELDS = ("query_id", "question", "status", "answer", "token_ids", "cameras", "kept_tokens", "pipeline")


def answers(rows) -> list[dict]:
    return [{k: r[k] for k in ANSWER_FIELDS} for r in rows]


def bag_eval(bag, params) -> list[dict]:
    """What `litevlm bag eval BAG` writes, per answer."""
    return answers([r.to_json() for r in evaluate(bag, params)])


def rows_of(rows: list[dict], key: str) -> list[dict]:
    """A bag's rows in answer order."""
    return sorted((r for r in rows if r["bag"] == key), key=lambda r: r["seq"])


def make_bags(root: Path, drivelm_dir: Path) -> dict[str, Path]:
    """Small bags from the DriveLM sample: `small` (a folder), `two` (a bare .mcap file), `long`
    (enough answers after the first that a kill lands mid-bag) and `corrupt` (cut off mid-file)."""
    small = write_bag(drivelm_contents(drivelm_dir, max_frames=1, questions_per_frame=2, max_width=160), root / "small")
    two = write_bag(drivelm_contents(drivelm_dir, max_frames=2, questions_per_frame=2, max_width=160), root / "two")
    mcap = next(two.glob("*.mcap"))
    long = write_bag(drivelm_contents(drivelm_dir, max_frames=4, questions_per_frame=3, max_width=160), root / "long")
    corrupt = root / "corrupt.mcap"
    corrupt.write_bytes(mcap.read_bytes()[: mcap.stat().st_size // 3])
    return {"small": small, "two": mcap, "long": long, "corrupt": corrupt}


def tiny_params(model: Path, **more) -> dict:
    return load_node_params(None, {"model_dir": str(model), "max_new_tokens": "4", **more})
