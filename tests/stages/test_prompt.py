"""Prompt ids against upstream InternVL: BOS per the tokenizer's own configuration, the `internvl`
layout token-identical to upstream's `chat()` for one image and for several, `litevlm prompt`
equal to what the pipeline feeds the decoder, and layout resolution with its errors.

The expected ids never come from prompt.py: the upstream query string is built here by the rules of
InternVL's `conversation.py` (template `internvl2_5`, MPT separators) and `chat()` (`<image>\\n` +
question for one image, `Image-i: <image>\\n` lines for several, each `<image>` replaced in order by
`<img>` + `<IMG_CONTEXT>` x 256 per tile + `</img>`), then tokenized whole by transformers:
`SentencePieceBackend` (legacy sentencepiece path: split at added tokens, `sp_model.encode` per
piece, what `InternLM2Tokenizer` does) with the BOS pattern for an InternLM2-style tokenizer.model,
and `PreTrainedTokenizerFast` (the `tokenizers` post-processor path, transformers' precedence of
`add_bos_token`) for tokenizer.json folders.
"""

import io
import json

import pytest
import torch
from helpers import random_frames

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.cli import main
from litevlm_runtime.errors import CheckpointError, InputError
from litevlm_runtime.models.config import INTERNVL_SYSTEM_MESSAGE
from litevlm_runtime.models.internvl import InternVL
from litevlm_runtime.options import Tokens
from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions, assemble_prompt, prompt_ids
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.stages.prompt import build_prompt, model_layout, render, resolve_layout
from litevlm_runtime.weights.checkpoint import write_checkpoint
from litevlm_runtime.weights.corpus import default_corpus
from litevlm_runtime.weights.presets import preset
from litevlm_runtime.weights.tokenizer import SPECIAL_TOKENS, Tokenizer, train_bpe_tokenizer

QUESTION = "Is there a pedestrian in front of the ego car?"
TOKENS_PER_TILE = 256          # upstream's num_image_token at 448 px tiles
BUNDLED = "litevlm_runtime/bundled/synthdrive-internvl2_5-v2"


def upstream_query(system: str, question: str, num_patches_list: list[int]) -> str:
    """The string InternVL's chat() tokenizes (modeling_internvl_chat.py + conversation.py)."""
    if len(num_patches_list) == 1:
        question = "<image>\n" + question
    else:
        question = "".join(f"Image-{i + 1}: <image>\n" for i in range(len(num_patches_list))) + question
    sep = "<|im_end|>\n"
    query = "<|im_start|>system\n" + system + sep + "<|im_start|>user\n" + question + sep + "<|im_start|>assistant\n"
    for n in num_patches_list:
        query = query.replace("<image>", "<img>" + "<IMG_CONTEXT>" * TOKENS_PER_TILE * n + "</img>", 1)
    return query


def upstream_chat_query(system: str, question: str, num_patches_list: list[int], history=()) -> str:
    """The string InternVL's chat(..., history=) tokenizes (modeling_internvl_chat.py): the image
    line(s) are prepended to the question only in the first turn (history is None then; the model
    card writes `Image-i: <image>` lines itself for several images), and history keeps each
    question as it was asked; conversation.py's template internvl2_5 (MPT) writes
    system + sep, then per message `role + message + sep`, or the role alone when the message is
    empty (`if message:`), the last one the generation prompt."""
    def with_images(q):
        if len(num_patches_list) == 1:
            return "<image>\n" + q
        return "".join(f"Image-{i + 1}: <image>\n" for i in range(len(num_patches_list))) + q

    user, assistant, sep = "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n"
    turns = [(with_images(history[0][0]), history[0][1]), *history[1:]] if history else []
    messages = [m for q, a in turns for m in ((user, q), (assistant, a))]
    messages += [(user, question if history else with_images(question)), (assistant, None)]
    query = "<|im_start|>system\n" + system + sep
    for role, message in messages:
        query += role + message + sep if message else role
    for n in num_patches_list:
        query = query.replace("<image>", "<img>" + "<IMG_CONTEXT>" * TOKENS_PER_TILE * n + "</img>", 1)
    return query


HISTORIES = {
    "one_earlier_turn": [("Is there a car in front?", "Yes, a white car is parked ahead.")],
    "two_earlier_turns": [("Is there a car in front?", "Yes."), ("What colour is it?", "It is white, 12.5 m away.")],
    "an_empty_answer": [("Is there a car in front?", ""), ("Anything behind?", "No.")],
}


def write_model_config(folder, vocab_size: int, architecture: str = "internlm2") -> None:
    """config.json of a model whose 448 px tiles give upstream's 256 tokens (no weights needed)."""
    cfg = preset("tiny", vocab_size=vocab_size)
    cfg.force_image_size = 448
    cfg.system_message = INTERNVL_SYSTEM_MESSAGE
    cfg.llm.architecture = architecture
    (folder / "config.json").write_text(json.dumps(cfg.to_dict(), ensure_ascii=False))


def added_tokens_decoder(token_id) -> dict:
    return {str(token_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": True} for t in SPECIAL_TOKENS}


def write_internlm2_tokenizer(folder, add_dummy_prefix: bool, add_bos_token: bool | None = True) -> None:
    """A small sentencepiece BPE tokenizer.model laid out as InternLM2's (<unk> <s> </s> = 0 1 2,
    InternVL's special tokens as user-defined pieces, byte fallback) and a tokenizer_config.json
    like upstream's (InternLM2Tokenizer, add_bos_token, bos_token <s>, added_tokens_decoder)."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(default_corpus() + [INTERNVL_SYSTEM_MESSAGE]), model_writer=model,
        vocab_size=700, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        user_defined_symbols=[t for t in SPECIAL_TOKENS if t not in ("<unk>", "<s>", "</s>")],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix, minloglevel=2)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    config = {"tokenizer_class": "InternLM2Tokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "</s>", "add_eos_token": False,
              "added_tokens_decoder": added_tokens_decoder(sp.piece_to_id)}
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def internlm2_reference(folder, add_bos_token: bool):
    """transformers' sentencepiece tokenizer on the same files, as InternLM2Tokenizer configures it."""
    from tokenizers import AddedToken
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    config = json.loads((folder / "tokenizer_config.json").read_text())
    added = {int(i): AddedToken(t["content"], special=True, normalized=False, lstrip=False, rstrip=False)
             for i, t in config["added_tokens_decoder"].items()}
    return SentencePieceBackend(vocab_file=str(folder / "tokenizer.model"), bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>", added_tokens_decoder=added, legacy=True,
                                special_tokens_pattern="bos" if add_bos_token else None)


def write_bpe_tokenizer(folder, post_processor, config: dict) -> None:
    """A byte-level BPE tokenizer.json (as Qwen2.5's) with the given post-processor and config."""
    from tokenizers import Tokenizer as HFTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    train_bpe_tokenizer(default_corpus() + [INTERNVL_SYSTEM_MESSAGE], 800, folder / "tokenizer.json")
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    if post_processor is not None:
        tok.post_processor = post_processor
    tok.save(str(folder / "tokenizer.json"))
    config = dict(config, added_tokens_decoder=added_tokens_decoder(tok.token_to_id))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def prompt_json(capsys, folder, *args) -> dict:
    assert main(["prompt", "--model", str(folder), "--question", QUESTION, "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module", params=[True, False], ids=["dummy_prefix", "no_dummy_prefix"])
def internlm2_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("internlm2")
    write_internlm2_tokenizer(folder, add_dummy_prefix=request.param)
    write_model_config(folder, 700)
    return folder


@pytest.mark.parametrize("cameras, tiles", [(["CAM_FRONT"], 2), (list(CAMERAS), 1), (["CAM_BACK", "CAM_FRONT"], 2)],
                         ids=["one_image_2_tiles", "six_images", "two_images_2_tiles"])
def test_internlm2_prompt_starts_with_bos_and_equals_upstream(capsys, internlm2_folder, cameras, tiles):
    d = prompt_json(capsys, internlm2_folder, "--layout", "internvl", "--cameras", *cameras,
                    "--tiles-per-camera", str(tiles))
    ref = internlm2_reference(internlm2_folder, add_bos_token=True)
    expected = ref(upstream_query(INTERNVL_SYSTEM_MESSAGE, QUESTION, [tiles] * len(cameras)))["input_ids"]
    assert d["input_ids"][0] == 1 == ref.convert_tokens_to_ids("<s>")
    assert d["input_ids"] == expected
    assert d["added_by_tokenizer"] == {"before": ["<s>"], "after": []}
    context = ref.convert_tokens_to_ids("<IMG_CONTEXT>")
    for c in d["cameras"]:
        start, count = c["start"], c["count"]
        assert count == TOKENS_PER_TILE * tiles
        assert set(expected[start:start + count]) == {context}
        assert expected[start - 1] == ref.convert_tokens_to_ids("<img>")
        assert expected[start + count] == ref.convert_tokens_to_ids("</img>")
    assert d["question"]["text"].strip() == QUESTION


@pytest.mark.parametrize("history", HISTORIES.values(), ids=HISTORIES.keys())
@pytest.mark.parametrize("cameras, tiles", [(["CAM_FRONT"], 2), (list(CAMERAS), 1)], ids=["one_image", "six_images"])
def test_internlm2_conversation_equals_upstream_chat_with_history(internlm2_folder, history, cameras, tiles):
    """A follow-up's prompt: upstream's chat(history=) string, tokenized whole by the tokenizer's
    own files; its question span is still the first question's (what the tokens were chosen on)."""
    tok = Tokenizer(internlm2_folder)
    p = build_prompt(tok, INTERNVL_SYSTEM_MESSAGE, "internvl", cameras, QUESTION, TOKENS_PER_TILE * tiles, history)
    ref = internlm2_reference(internlm2_folder, add_bos_token=True)
    expected = ref(upstream_chat_query(INTERNVL_SYSTEM_MESSAGE, QUESTION, [tiles] * len(cameras), history))["input_ids"]
    assert list(p.input_ids) == expected
    first = build_prompt(tok, INTERNVL_SYSTEM_MESSAGE, "internvl", cameras, history[0][0], TOKENS_PER_TILE * tiles)
    assert p.image_spans == first.image_spans and p.question_span == first.question_span
    assert tok.decode(p.input_ids[slice(*p.question_span)]).strip() == history[0][0]


@pytest.mark.parametrize("history", HISTORIES.values(), ids=HISTORIES.keys())
def test_qwen_tokenizer_json_conversation_equals_upstream(tmp_path, history):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    write_bpe_tokenizer(tmp_path, processors.ByteLevel(trim_offsets=False), QWEN_CONFIG)
    cams = ["CAM_FRONT", "CAM_BACK"]
    p = build_prompt(Tokenizer(tmp_path), INTERNVL_SYSTEM_MESSAGE, "internvl", cams, QUESTION, TOKENS_PER_TILE, history)
    ref = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert (
        list(p.input_ids) == ref(upstream_chat_query(INTERNVL_SYSTEM_MESSAGE, QUESTION, [1, 1], history))["input_ids"]
    )


def test_internlm2_folder_without_litevlm_json_is_internvl(internlm2_folder):
    layout, source = model_layout(internlm2_folder)
    assert layout == "internvl" and "tokenizer.model" in source


def test_sentencepiece_without_bos_when_config_says_so(capsys, tmp_path):
    write_internlm2_tokenizer(tmp_path, add_dummy_prefix=False, add_bos_token=False)
    write_model_config(tmp_path, 700)
    d = prompt_json(capsys, tmp_path, "--cameras", "CAM_FRONT")
    expected = internlm2_reference(tmp_path, add_bos_token=False)(
        upstream_query(INTERNVL_SYSTEM_MESSAGE, QUESTION, [1])
    )
    assert d["input_ids"] == expected["input_ids"] and d["input_ids"][0] != 1


QWEN_CONFIG = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "unk_token": None}


@pytest.mark.parametrize("case", ["qwen2_5_bytelevel", "template_bos", "template_bos_and_config_agree"])
def test_tokenizer_json_follows_its_post_processor(capsys, tmp_path, case):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos_template = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    post_processor, config, bos = {
        # Qwen2.5 (InternVL2.5-1B): a ByteLevel post-processor, no add_bos_token, bos_token null
        "qwen2_5_bytelevel": (processors.ByteLevel(trim_offsets=False), QWEN_CONFIG, False),
        "template_bos": (bos_template, {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>"}, True),
        "template_bos_and_config_agree": (bos_template, {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>",
                                                         "add_bos_token": True, "add_eos_token": False}, True),
    }[case]
    write_bpe_tokenizer(tmp_path, post_processor, config)
    write_model_config(tmp_path, 800, "qwen2")
    d = prompt_json(capsys, tmp_path, "--layout", "internvl", "--cameras", "CAM_FRONT", "--tiles-per-camera", "2")
    ref = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert d["input_ids"] == ref(upstream_query(INTERNVL_SYSTEM_MESSAGE, QUESTION, [2]))["input_ids"]
    assert (d["input_ids"][0] == 1) == bos
    assert d["added_by_tokenizer"]["before"] == (["<s>"] if bos else [])


def test_config_flag_that_contradicts_the_post_processor_is_named(tmp_path):
    """transformers 5 follows tokenizer.json here, transformers 4's Llama tokenizers the config:
    a folder where they differ has no single upstream answer."""
    from tokenizers import processors

    write_bpe_tokenizer(tmp_path, processors.ByteLevel(trim_offsets=False), dict(QWEN_CONFIG, bos_token="<s>",
                                                                                 add_bos_token=True))
    with pytest.raises(CheckpointError, match="add_bos_token is True but tokenizer.json's post_processor adds nothing"):
        Tokenizer(tmp_path).added_around_text


def test_qwen2_folder_without_litevlm_json_is_internvl_and_renders_upstream_text(tmp_path):
    from tokenizers import processors

    write_bpe_tokenizer(tmp_path, processors.ByteLevel(trim_offsets=False), QWEN_CONFIG)
    assert model_layout(tmp_path)[0] == "internvl"
    tok = Tokenizer(tmp_path)
    cams = ["CAM_FRONT", "CAM_BACK"]
    p = build_prompt(tok, INTERNVL_SYSTEM_MESSAGE, "internvl", cams, QUESTION, TOKENS_PER_TILE)
    run = "<IMG_CONTEXT>" * TOKENS_PER_TILE
    text = upstream_query(INTERNVL_SYSTEM_MESSAGE, QUESTION, [1, 1]).replace(run, f"<IMG_CONTEXT>*{TOKENS_PER_TILE}")
    assert render(tok, p.input_ids) == text
    assert tok.decode(p.input_ids[slice(*p.question_span)]) == "\n" + QUESTION


def test_cameras_layout_equals_whole_string_tokenization_and_bundled_keeps_it():
    """The bundled model was trained with `cameras` and no BOS: its folder says so, and the ids are
    those of tokenizing the whole `CAM_X: <img>..</img>` string at once."""
    assert model_layout(BUNDLED) == ("cameras", f"{BUNDLED}/litevlm.json")
    tok = Tokenizer(BUNDLED)
    assert tok.added_around_text == ((), ())
    system = json.loads(open(f"{BUNDLED}/config.json").read())["system_message"]
    cams = ["CAM_FRONT", "CAM_BACK_LEFT", "CAM_BACK"]
    n = 64
    text = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
            + "".join(f"{c}: <img>{'<IMG_CONTEXT>' * n}</img>\n" for c in cams)
            + f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    p = build_prompt(tok, system, "cameras", cams, QUESTION, n)
    assert list(p.input_ids) == tok._tok.encode(text).ids
    # the question rows: from the last </img> to <|im_end|>, as the token selector was trained on
    q0, q1 = p.question_span
    assert p.input_ids[q0 - 1] == tok.img_end_id and p.input_ids[q1] == tok.im_end_id


def test_cameras_layout_conversation_equals_whole_string_tokenization():
    """The project's `cameras` layout continues a conversation with the same turns: the bundled
    model's multi-turn string tokenized whole by its tokenizer.json."""
    tok = Tokenizer(BUNDLED)
    system = json.loads(open(f"{BUNDLED}/config.json").read())["system_message"]
    cams, n = ["CAM_FRONT", "CAM_BACK"], 64
    for history in HISTORIES.values():
        user_images = "".join(f"{c}: <img>{'<IMG_CONTEXT>' * n}</img>\n" for c in cams)
        text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user_images}{history[0][0]}<|im_end|>\n"
        for i, (_, a) in enumerate(history):
            text += f"<|im_start|>assistant\n{a}<|im_end|>\n" if a else "<|im_start|>assistant\n"
            later = history[i + 1][0] if i + 1 < len(history) else QUESTION
            text += f"<|im_start|>user\n{later}<|im_end|>\n"
        text += "<|im_start|>assistant\n"
        assert (
            list(build_prompt(tok, system, "cameras", cams, QUESTION, n, history).input_ids)
            == tok._tok.encode(text).ids
        )


def test_history_with_a_reserved_token_is_named():
    tok = Tokenizer(BUNDLED)
    with pytest.raises(InputError, match="history turn 1 contains reserved token '<img>'"):
        build_prompt(tok, "sys", "cameras", ["CAM_FRONT"], QUESTION, 64, [("Q", "see <img> here")])


@pytest.mark.parametrize("template, layout, cameras", [
    ("{camera}: <image>\n", "cameras", list(CAMERAS)),
    ("Image-{index}: <image>\n", "internvl", list(CAMERAS)),
    ("<image>\n", "internvl", ["CAM_BACK"]),
])
def test_templates_that_spell_out_a_named_layout_give_its_ids(tiny_model, template, layout, cameras):
    tok = Tokenizer(tiny_model)
    assert build_prompt(tok, "sys", template, cameras, QUESTION, 16) == build_prompt(
        tok, "sys", layout, cameras, QUESTION, 16
    )


def test_litevlm_prompt_is_what_the_pipeline_feeds_the_decoder(capsys, tiny_model):
    rt = Pipeline.from_pretrained(tiny_model, PipelineOptions(tiles_per_camera=2, max_new_tokens=2)).rt
    cams = ["CAM_FRONT_LEFT", "CAM_BACK"]
    d = prompt_json(capsys, tiny_model, "--cameras", *cams, "--tiles-per-camera", "2")
    ids, spans = prompt_ids(rt, cams, QUESTION)
    assert d["layout"] == "cameras" and d["input_ids"] == ids
    assert [(c["camera"], c["start"], c["count"]) for c in d["cameras"]] == [
        (c, s, n) for c, (s, n) in zip(cams, spans)
    ]
    # the human form: the text with image spans collapsed, and the ids with runs collapsed
    assert main(["prompt", "--model", str(tiny_model), "--question", QUESTION, "--cameras", *cams,
                 "--tiles-per-camera", "2"]) == 0
    out = capsys.readouterr().out
    n = 2 * rt.cfg.tokens_per_tile
    assert f"CAM_BACK: <img><IMG_CONTEXT>*{n}</img>\n{QUESTION}<|im_end|>" in out
    assert f"{rt.tok.img_context_id} x{n}" in out


def test_litevlm_prompt_with_history_is_a_follow_ups_prompt(capsys, tiny_model):
    """`litevlm prompt --history Q A` prints the conversation's ids and the digest an Answer carries."""
    pipe = Pipeline.from_pretrained(tiny_model, PipelineOptions(max_new_tokens=2))
    history = [("What is in front?", "A white truck.")]
    ans = pipe.answer(random_frames(0), QueryRequest(QUESTION, history=history))
    d = prompt_json(capsys, tiny_model, "--cameras", *ans.cameras, "--history", *history[0])
    assert d["input_ids"] == prompt_ids(pipe.rt, ans.cameras, QUESTION, history)[0]
    assert d["sha256"] == ans.prompt_sha256 and "<|im_start|>assistant\nA white truck.<|im_end|>" in d["text"]


def test_pipeline_on_an_internlm2_folder_uses_internvl_with_bos(tmp_path):
    """Weights plus an InternLM2-style tokenizer.model: the pipeline's prompt starts with <s>, puts
    `Image-i:` lines before the question, and the token selector's question rows are the question."""
    write_internlm2_tokenizer(tmp_path, add_dummy_prefix=True)
    write_checkpoint(tmp_path, InternVL(preset("tiny", vocab_size=700)))
    cams = ("CAM_FRONT", "CAM_BACK")
    pipe = Pipeline.from_pretrained(tmp_path, PipelineOptions(cameras=cams, max_new_tokens=3,
                                                              tokens=Tokens(mode="layer0", keep_ratio=0.5)))
    rt = pipe.rt
    assert rt.prompt_layout == "internvl"
    ids, spans = prompt_ids(rt, list(cams), QUESTION)
    assert ids[0] == 1
    assert "Image-2: <img><IMG_CONTEXT>" in render(rt.tok, ids)
    ans = pipe.answer(random_frames(0), QUESTION)
    assert ans.input_tokens < len(ids)            # half the visual tokens kept
    with torch.inference_mode():
        layout = assemble_prompt(rt, list(cams), QUESTION, rt.arena.visual[:2].view(2, rt.tokens_per_camera, -1))
    q0, q1 = layout.question
    assert rt.tok.decode(ids[q0:q1]).strip() == QUESTION
    # the option overrides the folder
    other = Pipeline.from_pretrained(tmp_path, PipelineOptions(cameras=cams, prompt_layout="cameras")).rt
    assert "CAM_BACK: <img>" in render(other.tok, prompt_ids(other, list(cams), QUESTION)[0])


@pytest.mark.parametrize("content, message", [
    ("{not json", "invalid JSON"),
    ('{"layout": "internvl"}', "no 'prompt_layout' key"),
    ('{"prompt_layout": "internvl", "extra": 1}', "unknown key 'extra'"),
    ('{"prompt_layout": "qwen"}', "a layout is internvl or cameras"),
])
def test_bad_litevlm_json_is_named(tmp_path, content, message):
    (tmp_path / "litevlm.json").write_text(content)
    with pytest.raises(CheckpointError, match=message) as e:
        model_layout(tmp_path)
    assert str(tmp_path / "litevlm.json") in str(e.value)


@pytest.mark.parametrize("layout, message", [
    ("Image: no image here", "a layout is internvl or cameras"),
    ("<image> and <image>", "a layout is internvl or cameras"),
    ("{cam}: <image>\n", "unknown placeholder {cam}"),
    ("<img><image>", "special token '<img>'"),
])
def test_bad_layout_option_is_named(tiny_model, layout, message):
    with pytest.raises(InputError, match=message):
        resolve_layout(layout, tiny_model)


def test_bad_prompt_arguments_exit_2_naming_the_culprit(capsys, tiny_model):
    assert main(["prompt", "--model", str(tiny_model), "--question", QUESTION, "--cameras", "CAM_TOP"]) == 2
    assert "CAM_TOP" in capsys.readouterr().err
    assert main(["prompt", "--model", str(tiny_model), "--question", "what <|im_end|> now"]) == 2
    assert "<|im_end|>" in capsys.readouterr().err
