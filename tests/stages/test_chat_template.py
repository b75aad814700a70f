"""The -hf prompt builder (chat_template.py) against transformers' own chat-template rendering and
tokenization, without a model: a system turn when the config sets one (InternVL3.5's thinking
mode), none otherwise, one image per camera, the question's span."""

from __future__ import annotations

import pytest
from helpers.internvl3 import EXTRA_SPECIAL, HF_CHAT_TEMPLATE

from litevlm_runtime.errors import InputError
from litevlm_runtime.stages.chat_template import build_template_prompt
from litevlm_runtime.stages.prompt import Prompt
from litevlm_runtime.weights.corpus import default_corpus
from litevlm_runtime.weights.tokenizer import Tokenizer, train_bpe_tokenizer

QUESTION = "Is the traffic light ahead red or green?"
# A stand-in for the model card's reasoning prompt (the text is the user's; the mechanism is tested).
THINKING = "You are an AI assistant that first thinks step by step inside <think> and </think>, then answers."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(default_corpus(), 800, folder / "tokenizer.json")
    return folder


@pytest.mark.parametrize("system", ["", THINKING])
@pytest.mark.parametrize("cameras", [1, 3])
def test_ids_equal_transformers_rendering_and_tokenization(folder, system, cameras):
    from transformers import PreTrainedTokenizerFast

    ref_tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), extra_special_tokens=EXTRA_SPECIAL)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": [{"type": "image"}] * cameras + [{"type": "text", "text": QUESTION}]}]
    text = ref_tok.apply_chat_template(messages, chat_template=HF_CHAT_TEMPLATE, add_generation_prompt=True,
                                       tokenize=False)
    expected = ref_tok(text.replace("<IMG_CONTEXT>", "<img>" + "<IMG_CONTEXT>" * 16 + "</img>"))["input_ids"]
    tok = Tokenizer(folder)
    p = Prompt(
        *build_template_prompt(tok, HF_CHAT_TEMPLATE, system, [f"CAM_{i}" for i in range(cameras)], QUESTION, 16)
    )
    assert list(p.input_ids) == expected
    assert text.startswith("<|im_start|>system\n" + system) == bool(system)
    assert [n for _, n in p.image_spans] == [16] * cameras
    assert all(p.input_ids[s:s + n] == (tok.img_context_id,) * n for s, n in p.image_spans)
    assert tok.decode(p.input_ids[slice(*p.question_span)]) == "\n" + QUESTION


@pytest.mark.parametrize("system", ["", THINKING])
@pytest.mark.parametrize("turns", [1, 2])
def test_conversation_equals_transformers_rendering_of_the_messages(folder, system, turns):
    """A follow-up on an -hf folder: the conversation as a transformers user gives it to
    apply_chat_template (the images in the first user turn, each answer an assistant turn)."""
    from transformers import PreTrainedTokenizerFast

    ref_tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), extra_special_tokens=EXTRA_SPECIAL)
    history = [("Is there a car in front?", "Yes, a white car."), ("What colour is it?", "White.")][:turns]

    def text(t):
        return [{"type": "text", "text": t}]

    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": [{"type": "image"}] * 2 + text(history[0][0])}]
    for i, (_, answer) in enumerate(history):
        messages += [{"role": "assistant", "content": text(answer)},
                     {"role": "user", "content": text(history[i + 1][0] if i + 1 < len(history) else QUESTION)}]
    rendered = ref_tok.apply_chat_template(messages, chat_template=HF_CHAT_TEMPLATE, add_generation_prompt=True,
                                           tokenize=False)
    expected = ref_tok(rendered.replace("<IMG_CONTEXT>", "<img>" + "<IMG_CONTEXT>" * 16 + "</img>"))["input_ids"]
    tok = Tokenizer(folder)
    p = Prompt(*build_template_prompt(tok, HF_CHAT_TEMPLATE, system, ["CAM_A", "CAM_B"], QUESTION, 16, history))
    first = Prompt(*build_template_prompt(tok, HF_CHAT_TEMPLATE, system, ["CAM_A", "CAM_B"], history[0][0], 16))
    assert list(p.input_ids) == expected
    assert p.question_span == first.question_span and p.image_spans == first.image_spans


def test_a_template_that_rewrites_the_first_turn_cannot_continue(folder):
    """Follow-ups reuse the first turn's rows: a template whose first turn changes once more turns
    follow (here: it numbers the user turns from the end) is refused, naming why."""
    from litevlm_runtime.errors import CheckpointError

    rewriting = HF_CHAT_TEMPLATE.replace(
        "{{'<|im_start|>' + message['role'] + '\\n'}}",
        "{{'<|im_start|>' + message['role'] + (messages|length - loop.index)|string + '\\n'}}",
    )
    assert rewriting != HF_CHAT_TEMPLATE
    tok = Tokenizer(folder)
    build_template_prompt(tok, rewriting, "", ["CAM_A"], QUESTION, 16)
    with pytest.raises(CheckpointError, match="first turn renders differently"):
        build_template_prompt(tok, rewriting, "", ["CAM_A"], QUESTION, 16, [("Is it red?", "No.")])


def test_reserved_token_in_question_is_refused(folder):
    with pytest.raises(InputError, match="reserved token"):
        build_template_prompt(Tokenizer(folder), HF_CHAT_TEMPLATE, "", ["CAM_FRONT"], "<IMG_CONTEXT> hi", 16)
