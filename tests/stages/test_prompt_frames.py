"""Prompts over several frame sets (issue 45 item 5) against upstream InternVL's video chat and
transformers' InternVL processor, checked the way tests/stages/test_prompt.py checks `litevlm prompt`.

The expected ids never come from prompt.py. Upstream's video chat (internvl_chat/README.md,
"video_prefix"): the question is `''.join(f'Frame{i+1}: <image>\\n' for each frame) + question`,
one tile per frame (`num_patches_list` of ones); `chat()` adds no `<image>\\n` of its own because
the question holds `<image>`; the `internvl2_5` template (conversation.py, MPT separators) wraps
it; each `<image>` is replaced in order by `<img>` + `<IMG_CONTEXT>` x 256 + `</img>`; the string is
tokenized whole: transformers' sentencepiece backend for an InternLM2 tokenizer.model with BOS
(InternVL2.5), `PreTrainedTokenizerFast` for a Qwen tokenizer.json (InternVL3.5). An -hf folder:
transformers' `apply_chat_template` with one `{"type": "video"}` per camera, then the processor's
`replace_video_token` (processing_internvl.py: `"\\n".join(f"Frame{i + 1}: <img>...</img>")`).
"""

from __future__ import annotations

import pytest
from helpers.internvl3 import EXTRA_SPECIAL, HF_CHAT_TEMPLATE
from test_prompt import (
    BUNDLED,
    HISTORIES,
    QUESTION,
    QWEN_CONFIG,
    TOKENS_PER_TILE,
    internlm2_reference,
    prompt_json,
    upstream_query,
    write_bpe_tokenizer,
    write_internlm2_tokenizer,
    write_model_config,
)

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.cli import main
from litevlm_runtime.errors import InputError
from litevlm_runtime.models.config import INTERNVL_SYSTEM_MESSAGE
from litevlm_runtime.stages.chat_template import build_template_prompt
from litevlm_runtime.stages.prompt import Prompt, build_prompt, render
from litevlm_runtime.weights.corpus import default_corpus
from litevlm_runtime.weights.tokenizer import Tokenizer, train_bpe_tokenizer


def upstream_video_query(system: str, question: str, frames: int) -> str:
    """The string upstream's video chat tokenizes: the README's video_prefix + question, through
    chat() (no `<image>\\n` added: the question holds `<image>`) and the internvl2_5 template."""
    video_prefix = "".join(f"Frame{i + 1}: <image>\n" for i in range(frames))
    sep = "<|im_end|>\n"
    query = ("<|im_start|>system\n" + system + sep + "<|im_start|>user\n" + video_prefix + question + sep
             + "<|im_start|>assistant\n")
    for _ in range(frames):          # num_patches_list: one tile per frame
        query = query.replace("<image>", "<img>" + "<IMG_CONTEXT>" * TOKENS_PER_TILE + "</img>", 1)
    return query


@pytest.fixture(scope="module")
def internlm2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("internlm2")
    write_internlm2_tokenizer(folder, add_dummy_prefix=True)
    write_model_config(folder, 700)
    return folder


@pytest.mark.parametrize("frames", [2, 4, 8])
def test_internlm2_one_camera_over_time_equals_upstream_video_chat(capsys, internlm2_folder, frames):
    """InternVL2.5 (InternLM2 tokenizer.model, BOS): `litevlm prompt --frames K` for one camera in
    the internvl layout is upstream's video-chat prompt, id for id, each frame one span."""
    d = prompt_json(capsys, internlm2_folder, "--layout", "internvl", "--cameras", "CAM_FRONT", "--frames",
                    str(frames))
    ref = internlm2_reference(internlm2_folder, add_bos_token=True)
    expected = ref(upstream_video_query(INTERNVL_SYSTEM_MESSAGE, QUESTION, frames))["input_ids"]
    assert d["input_ids"] == expected and d["input_ids"][0] == 1
    assert [(c["camera"], c["frame"]) for c in d["cameras"]] == [("CAM_FRONT", i + 1) for i in range(frames)]
    context, start, end = (ref.convert_tokens_to_ids(t) for t in ("<IMG_CONTEXT>", "<img>", "</img>"))
    for c in d["cameras"]:
        s, n = c["start"], c["count"]
        assert n == TOKENS_PER_TILE and set(expected[s:s + n]) == {context}
        assert expected[s - 1] == start and expected[s + n] == end
    assert d["question"]["text"].strip() == QUESTION


@pytest.mark.parametrize("frames", [2, 4])
def test_qwen_tokenizer_json_one_camera_over_time_equals_upstream_video_chat(capsys, tmp_path, frames):
    """InternVL3.5 (Qwen tokenizer.json, no BOS): the same, tokenized by PreTrainedTokenizerFast."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    write_bpe_tokenizer(tmp_path, processors.ByteLevel(trim_offsets=False), QWEN_CONFIG)
    write_model_config(tmp_path, 800, "qwen2")
    d = prompt_json(capsys, tmp_path, "--layout", "internvl", "--cameras", "CAM_BACK", "--frames", str(frames))
    ref = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert d["input_ids"] == ref(upstream_video_query(INTERNVL_SYSTEM_MESSAGE, QUESTION, frames))["input_ids"]
    assert d["added_by_tokenizer"]["before"] == []


@pytest.mark.parametrize("layout", ["internvl", "cameras", "Image-{index}: <image>\n", "{camera} <image>\n"])
@pytest.mark.parametrize("cameras", [["CAM_FRONT"], list(CAMERAS)], ids=["one_camera", "six_cameras"])
def test_one_frame_set_is_the_single_frame_prompt(internlm2_folder, layout, cameras):
    """K = 1 is today's prompt for every layout, id for id (the frames argument changes nothing)."""
    tok = Tokenizer(internlm2_folder)
    for history in ((), HISTORIES["one_earlier_turn"]):
        assert build_prompt(tok, "sys", layout, cameras, QUESTION, 16, history, frames=1) == build_prompt(
            tok, "sys", layout, cameras, QUESTION, 16, history)
    ref = internlm2_reference(internlm2_folder, add_bos_token=True)
    if layout == "internvl":
        assert list(build_prompt(tok, INTERNVL_SYSTEM_MESSAGE, layout, cameras, QUESTION, TOKENS_PER_TILE,
                                 frames=1).input_ids) == ref(upstream_query(INTERNVL_SYSTEM_MESSAGE, QUESTION,
                                                                            [1] * len(cameras)))["input_ids"]


def test_several_cameras_over_time_are_videos_camera_by_camera(internlm2_folder):
    """Several cameras x K frames in the internvl layout: each camera's `Image-i:` line holds its
    frames as a video (`Frame1: <image>\\nFrame2: ...`), camera by camera, frames oldest first; the
    ids are the whole string's, tokenized by the reference."""
    tok = Tokenizer(internlm2_folder)
    cams, k = ["CAM_FRONT", "CAM_BACK_LEFT", "CAM_BACK"], 3
    p = build_prompt(tok, INTERNVL_SYSTEM_MESSAGE, "internvl", cams, QUESTION, 16, frames=k)
    video = "\n".join(f"Frame{i + 1}: <img>{'<IMG_CONTEXT>' * 16}</img>" for i in range(k))
    user = "".join(f"Image-{j + 1}: {video}\n" for j in range(len(cams)))
    text = (f"<|im_start|>system\n{INTERNVL_SYSTEM_MESSAGE}<|im_end|>\n<|im_start|>user\n{user}{QUESTION}<|im_end|>\n"
            f"<|im_start|>assistant\n")
    assert list(p.input_ids) == internlm2_reference(internlm2_folder, add_bos_token=True)(text)["input_ids"]
    assert len(p.image_spans) == len(cams) * k
    assert all(p.input_ids[s:s + n] == (tok.img_context_id,) * n for s, n in p.image_spans)
    assert [s for s, _ in p.image_spans] == sorted(s for s, _ in p.image_spans)


def test_cameras_layout_over_time_is_the_bundled_models_string():
    """The `cameras` layout (the bundled model's): `CAM_X: Frame1: <img>..</img>\\nFrame2: ...\\n`, the
    ids of the whole string by its tokenizer.json; the question rows after the last `</img>`."""
    import json

    tok = Tokenizer(BUNDLED)
    system = json.loads(open(f"{BUNDLED}/config.json").read())["system_message"]
    cams, k, n = ["CAM_FRONT_LEFT", "CAM_BACK"], 4, 64
    video = "\n".join(f"Frame{i + 1}: <img>{'<IMG_CONTEXT>' * n}</img>" for i in range(k))
    text = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n" + "".join(f"{c}: {video}\n" for c in cams)
            + f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    p = build_prompt(tok, system, "cameras", cams, QUESTION, n, frames=k)
    assert list(p.input_ids) == tok._tok.encode(text).ids
    q0, q1 = p.question_span
    assert p.input_ids[q0 - 1] == tok.img_end_id and p.input_ids[q1] == tok.im_end_id
    assert "CAM_BACK: Frame1: <img><IMG_CONTEXT>*64</img>\nFrame2: <img>" in render(tok, p.input_ids)


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(default_corpus(), 800, folder / "tokenizer.json")
    return folder


@pytest.mark.parametrize("cameras", [1, 3])
@pytest.mark.parametrize("system", ["", "You are a driving assistant."])
def test_hf_chat_template_over_time_equals_transformers_video_expansion(bpe_folder, cameras, system):
    """An -hf folder: its chat template with one video per camera, rendered by transformers and
    expanded as InternVLProcessor.replace_video_token does, then tokenized whole."""
    from transformers import PreTrainedTokenizerFast

    ref_tok = PreTrainedTokenizerFast(tokenizer_file=str(bpe_folder / "tokenizer.json"),
                                      extra_special_tokens=EXTRA_SPECIAL)
    k = 4
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": [{"type": "video"}] * cameras + [{"type": "text", "text": QUESTION}]}]
    text = ref_tok.apply_chat_template(messages, chat_template=HF_CHAT_TEMPLATE, add_generation_prompt=True,
                                       tokenize=False)
    # transformers' processing_internvl.py replace_video_token, one tile (image_seq_length tokens) per frame
    video = "\n".join(f"Frame{i + 1}: <img>{'<IMG_CONTEXT>' * 16}</img>" for i in range(k))
    expected = ref_tok(text.replace("<video>", video))["input_ids"]
    tok = Tokenizer(bpe_folder)
    p = Prompt(*build_template_prompt(tok, HF_CHAT_TEMPLATE, system, [f"CAM_{i}" for i in range(cameras)], QUESTION,
                                      16, frames=k))
    assert list(p.input_ids) == expected
    assert len(p.image_spans) == cameras * k
    assert tok.decode(p.input_ids[slice(*p.question_span)]) == "\n" + QUESTION
    # K = 1 is the image prompt
    assert build_template_prompt(tok, HF_CHAT_TEMPLATE, system, ["CAM_A"], QUESTION, 16, frames=1) == \
        build_template_prompt(tok, HF_CHAT_TEMPLATE, system, ["CAM_A"], QUESTION, 16)


def test_bad_frames_are_named(capsys, tmp_path):
    write_internlm2_tokenizer(tmp_path, add_dummy_prefix=True)
    write_model_config(tmp_path, 700)
    assert main(["prompt", "--model", str(tmp_path), "--question", QUESTION, "--frames", "0"]) == 2
    assert "--frames 0" in capsys.readouterr().err
    with pytest.raises(InputError, match="at least one frame set"):
        build_prompt(Tokenizer(tmp_path), "sys", "internvl", ["CAM_FRONT"], QUESTION, 16, frames=0)


def test_litevlm_prompt_frames_prints_each_cameras_frames(capsys, internlm2_folder):
    assert main(["prompt", "--model", str(internlm2_folder), "--question", QUESTION, "--cameras", "CAM_FRONT",
                 "CAM_BACK", "--frames", "2", "--layout", "internvl"]) == 0
    out = capsys.readouterr().out
    assert "Image-2: Frame1: <img><IMG_CONTEXT>*256</img>\nFrame2: <img><IMG_CONTEXT>*256</img>\n" in out
    assert "CAM_BACK Frame2" in out
