"""The node's query server (what `litevlm bag eval` runs) with the shipped parameters on the DriveLM
sample bag: the LiteVLM pipeline serves (fewer than six cameras, pruned tokens, EAGLE-2), and
the same parameters with backend onnxruntime and a bundle exported from the bundled model give
answers identical to the torch backend."""

import pytest

from litevlm_runtime.bag.evaluate import evaluate
from litevlm_runtime.bag.io import write_bag
from litevlm_runtime.bag.make import drivelm_contents
from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.cli import main
from litevlm_runtime.kernels import lowbit_kernels
from litevlm_runtime.ros.params_file import load_node_params
from litevlm_runtime.weights.bf16 import cpu_has_bf16_units


@pytest.fixture(scope="module")
def sample_bag(drivelm_dir, tmp_path_factory):
    return write_bag(drivelm_contents(drivelm_dir, max_frames=3, questions_per_frame=3),
                     tmp_path_factory.mktemp("bag") / "drivelm")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """`litevlm export` of the bundled model with the shipped defaults (fewer prompt buckets)."""
    out = tmp_path_factory.mktemp("export") / "bundle"
    assert main(["export", "--model", str(DEFAULT_MODEL), "--out", str(out), "--buckets", "prefill=256,640"]) == 0
    return out


@pytest.fixture(scope="module")
def torch_answers(sample_bag):
    return evaluate(sample_bag, load_node_params(None))


def test_shipped_parameters_serve_litevlm(torch_answers):
    ok = [r for r in torch_answers if r.status == "ok"]
    assert len(ok) == len(torch_answers) == 9
    assert {r.pipeline for r in ok} == {"litevlm[views,tokens@0.8,eagle]"}
    assert sum(len(r.cameras) for r in ok) / len(ok) < 6
    assert all(r.kept_tokens < r.visual_tokens for r in ok)


def test_onnxruntime_bundle_answers_identically(sample_bag, bundle, torch_answers):
    params = load_node_params(None, {"backend.name": "onnxruntime", "backend.bundle": str(bundle)})
    ort = evaluate(sample_bag, params)
    assert [r.status for r in ort] == ["ok"] * len(torch_answers)
    for a, b in zip(ort, torch_answers):
        assert (a.query_id, a.cameras, a.kept_tokens) == (b.query_id, b.cameras, b.kept_tokens)
        assert a.token_ids == b.token_ids, a.question
        assert a.pipeline == b.pipeline


def test_a_backend_the_node_cannot_run_is_refused_with_the_reason(sample_bag):
    params = load_node_params(None, {"backend.name": "onnxruntime"})         # no bundle
    records = evaluate(sample_bag, params)
    assert {r.status for r in records} == {"pipeline_error"}
    assert "backend.name onnxruntime needs backend.bundle" in records[0].status_message


def test_later_questions_on_a_frame_set_reuse_its_vision(drivelm_dir, tmp_path):
    """4 questions per frame set through bag eval: the later questions' vision stage is a fraction
    of the first's, and every answer equals a run with serving.feature_cache false."""
    import statistics

    bag = write_bag(drivelm_contents(drivelm_dir, max_frames=3, questions_per_frame=4), tmp_path / "four")
    on = evaluate(bag, load_node_params(None))
    off = evaluate(bag, load_node_params(None, {"serving.feature_cache": "false"}))
    assert [r.status for r in on] == ["ok"] * 12
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    firsts = [r.stage_ms["vision"] for i, r in enumerate(on) if i % 4 == 0]
    laters = [r.stage_ms["vision"] for i, r in enumerate(on) if i % 4]
    assert statistics.median(laters) <= 0.25 * statistics.median(firsts), (firsts, laters)
    assert all(r.reused_cameras == [] for r in off)


@pytest.fixture(scope="module")
def int4_answers(sample_bag):
    return evaluate(sample_bag, load_node_params(None, {"backend.weights": "int4"}))


@pytest.mark.parametrize("served", ["openvino", "int4"])
def test_node_serves_a_backend_from_drive_yaml_over_dds(tmp_path, sample_bag, bundle, torch_answers, int4_answers,
                                                       served):
    """The shipped config/drive.yaml with `backend: {name: openvino, bundle: B}` or
    `backend: {weights: int4}`, served by `litevlm drive` over real DDS (the bag replayed into the
    node, the answers recorded from its topic, separate processes): every answer token for token
    what bag eval gives (OpenVINO: the torch backend's float answers; int4: bag eval with the same
    weights), and /diagnostics says which engines and weights ran."""
    import yaml
    from diagnostic_msgs.msg import DiagnosticArray
    from helpers.ros import RosClient, domain_id, run_replay

    from litevlm_runtime.ros.params_file import config_dir

    doc = yaml.safe_load((config_dir() / "drive.yaml").read_text())
    section = next(iter(doc.values()))["ros__parameters"]
    assert (section["backend"]["name"], section["backend"]["weights"]) == ("torch", "float")   # the shipped file
    if served == "openvino":
        section["backend"].update(name="openvino", bundle=str(bundle))
        expected, diagnosed = torch_answers, ("openvino", "float", "")
    else:
        section["backend"].update(weights="int4")
        # backend.lowbit_prefill's shipped auto, resolved on this CPU (weights/lowbit.py)
        prefill = "int8" if lowbit_kernels.has_int8_gemm() else "bfloat16" if cpu_has_bf16_units() else "float32"
        expected, diagnosed = int4_answers, ("torch", "int4", prefill)
    params = tmp_path / "drive.yaml"
    params.write_text(yaml.safe_dump(doc))

    domain = domain_id(33 if served == "openvino" else 37)
    client = RosClient(domain)
    diags = []
    client.node.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)

    def values():
        return {kv.key: kv.value for kv in diags[-1].status[0].values} if diags else {}

    def answered():              # the node's own count, before it stops
        assert client.spin_until(lambda: values().get("answered") == str(len(expected)), 30), values()

    try:
        rows, _ = run_replay(tmp_path, sample_bag, params, len(expected), domain, timeout=300, node_ready_s=300,
                             served=answered)
    finally:
        client.close()
    assert (values()["backend"], values()["weights"], values()["lowbit_prefill"], values()["state"]) == \
        (*diagnosed, "active")
    # which path the int4 forms run: the kernels, or the reference path and why (a CPU they do not cover)
    assert values()["lowbit_kernels"] == ("" if served == "openvino" else lowbit_kernels.path_in_words(
        lowbit_kernels.load()))
    by_id = {r["query_id"]: r for r in rows}
    assert sorted(by_id) == sorted(r.query_id for r in expected)
    for want in expected:
        got = by_id[want.query_id]
        assert got["status"] == "ok", got["status_message"]
        assert got["token_ids"] == want.token_ids, want.question
        assert got["pipeline"] == want.pipeline
