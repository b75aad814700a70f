"""Follow-up questions and per-query sampling over DDS, on the bundled model with the shipped
parameters (greedy decoding, so that sampled draws do not depend on the speculation policy):

- a follow-up (Query.follow_up_of), asked after newer frames arrived and together with two other
  questions (so it is decoded in a batch): its prompt is upstream's multi-turn template (the
  Answer's prompt_sha256 against the conversation string tokenized whole by the tokenizer's own
  tokenizer.json, independently of stages/prompt.py), its vision stage is skipped (0 ms, every
  camera reused), it is answered on the first turn's frames, and its answer is the same
  conversation computed from scratch in this process (Pipeline.answer(history=));
- an unknown follow_up_of is STATUS_BAD_FOLLOW_UP naming it; a negative temperature is
  STATUS_BAD_QUESTION naming the field;
- a sampled query (temperature, seed) is the pipeline's answer at that temperature and seed.
"""

from __future__ import annotations

import hashlib
import json
from array import array

from helpers.ros import Proc, Rig, RosClient, domain_id, jpeg, ros_env
from test_ros_partials import params_with

from litevlm_runtime.pipeline.request import QueryRequest

Q1 = "What is in front of the ego vehicle?"
Q2 = "Is it moving?"
OTHERS = ["Is there a pedestrian behind the ego car?", "What should the ego vehicle do next?"]


def upstream_digest(model_dir, cameras: list[str], tokens_per_camera: int, history, question: str) -> str:
    """sha256 of the conversation's ids as the bundled model's tokenizer gives them for the whole
    string: its `cameras` layout (`CAM_X: <img>...</img>` lines in the first user turn), each
    earlier answer an assistant turn with upstream's MPT separators."""
    from tokenizers import Tokenizer as HFTokenizer

    system = json.loads((model_dir / "config.json").read_text())["system_message"]
    images = "".join(f"{c}: <img>{'<IMG_CONTEXT>' * tokens_per_camera}</img>\n" for c in cameras)
    text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{images}"
    for q, a in history:
        text += f"{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n<|im_start|>user\n"
    text += f"{question}<|im_end|>\n<|im_start|>assistant\n"
    ids = HFTokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    return hashlib.sha256(array("i", ids).tobytes()).hexdigest()


def test_follow_up_and_sampling_over_dds(tmp_path):
    from litevlm_msgs.msg import Answer

    from litevlm_runtime.bundled import DEFAULT_MODEL
    from litevlm_runtime.cameras import CAMERAS
    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.ros.parameters import pipeline_options_from

    values = params_with(tmp_path / "p.yaml", **{"queue_size": 8, "decoding.mode": "greedy"})
    assert values["serving.max_batch"] == 4 and values["serving.conversations"] == 4
    domain = domain_id(23)
    node = Proc(["drive", "--params", str(tmp_path / "p.yaml")], ros_env(domain), tmp_path / "node.log")
    client = RosClient(domain)

    def answered(*ids):
        return lambda: {a.query_id for a in rig.answers} >= set(ids)

    try:
        rig = Rig(client)
        node.wait_for("ready (active)", timeout=180)
        assert client.spin_until(rig.connected, 30)
        client.spin_for(0.5)
        rig.frames(seed=5)
        client.spin_for(0.3)
        rig.ask("q1", Q1)
        assert client.spin_until(answered("q1"), 120), node.text()[-2000:]
        rig.frames(seed=6)                                  # newer frames: the follow-up is about seed 5's
        client.spin_for(0.3)
        rig.ask("q2", Q2, follow_up_of="q1")
        for i, q in enumerate(OTHERS):
            rig.ask(f"b{i}", q)
        rig.ask("q3", Q2, follow_up_of="nope")
        rig.ask("q4", Q1, temperature=-1.0)
        assert client.spin_until(answered("q2", "b0", "b1", "q3", "q4"), 120), node.text()[-2000:]
        rig.frames(seed=5)
        client.spin_for(0.3)
        rig.ask("s1", OTHERS[1], temperature=1.5, seed=9)
        assert client.spin_until(answered("s1"), 120), node.text()[-2000:]
        client.spin_for(0.3)
    finally:
        client.close()
        node.stop()

    got = {a.query_id: a for a in rig.answers}
    assert len(rig.answers) == len(got) == 7, [a.query_id for a in rig.answers]      # one answer each
    first, follow = got["q1"], got["q2"]
    assert first.status == follow.status == Answer.STATUS_OK, (first.status_message, follow.status_message)
    assert (follow.follow_up_of, follow.turn, first.turn) == ("q1", 2, 1)
    assert list(follow.frame_stamps) == list(first.frame_stamps)          # the first turn's frames
    stages = dict(zip(follow.stage_names, follow.stage_ms))
    assert stages["vision"] == stages["preprocess"] == 0.0
    assert list(follow.reused_cameras) == list(follow.cameras) == list(first.cameras)
    assert 0 < follow.reused_tokens and follow.reused_tokens >= first.input_tokens
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, pipeline_options_from(values))
    tpc = pipe.rt.tokens_per_camera
    assert follow.prompt_sha256 == upstream_digest(DEFAULT_MODEL, list(follow.cameras), tpc, [(Q1, first.answer)], Q2)
    assert first.prompt_sha256 == upstream_digest(DEFAULT_MODEL, list(first.cameras), tpc, [], Q1)
    images = {cam: jpeg(5 * 10 + i) for i, cam in enumerate(CAMERAS)}          # what rig.frames(seed=5) sent
    assert list(first.token_ids) == pipe.answer(images, Q1).token_ids
    scratch = pipe.answer(images, QueryRequest(Q2, history=[(Q1, first.answer)]))
    assert list(follow.token_ids) == scratch.token_ids and follow.answer == scratch.text

    assert got["q3"].status == Answer.STATUS_BAD_FOLLOW_UP and "'nope'" in got["q3"].status_message
    assert got["q4"].status == Answer.STATUS_BAD_QUESTION and got["q4"].status_message.startswith("temperature ")
    newer = {cam: jpeg(6 * 10 + i) for i, cam in enumerate(CAMERAS)}           # seed 6: what b0, b1 were asked on
    for i, q in enumerate(OTHERS):
        assert list(got[f"b{i}"].token_ids) == pipe.answer(newer, q).token_ids
    sampled = pipe.answer(images, QueryRequest(OTHERS[1], temperature=1.5, seed=9))
    assert got["s1"].status == Answer.STATUS_OK and list(got["s1"].token_ids) == sampled.token_ids
    assert sampled.token_ids != pipe.answer(images, OTHERS[1]).token_ids      # (the node's default is greedy)
