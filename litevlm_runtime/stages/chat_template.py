"""Prompts of `-hf` folders: the folder's own processor chat template, rendered as transformers'
InternVLProcessor renders it, with one image per camera.

transformers' `processor.apply_chat_template(messages, add_generation_prompt=True)` renders the
template (chat_template.jinja, else chat_template.json's "chat_template") in a sandboxed Jinja
environment with trim_blocks and lstrip_blocks; the InternVL processor then replaces each image
placeholder it finds (the tokenizer's context image token, `<IMG_CONTEXT>`) by `<img>` +
`<IMG_CONTEXT>` x (image_seq_length x tiles) + `</img>` and tokenizes the text. The messages here
are one user turn, an `{"type": "image"}` entry per camera then the question as `{"type": "text"}`,
after a system turn only when the folder's config sets a system message (the -hf templates have no
default one: upstream's -hf prompt has no system turn). A conversation (follow-up questions) is the
same first user turn, then each earlier answer as an assistant turn and each later question as a
user turn, both `[{"type": "text", "text": ...}]`, as a transformers user writes the messages.

Ids are written as prompt.py writes them (the text between special tokens tokenized piece by piece,
the visual runs as ids), which equals tokenizing the expanded string whole: a tokenizer cuts a text
at its added tokens before anything else.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import CheckpointError, InputError, read_json
from ..weights.tokenizer import IMG_CONTEXT, Tokenizer

LAYOUT = "chat_template"
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
QUESTION_MARK = "\x00question\x00"      # where the question goes in the rendered text (no template emits it)
VIDEO = "<video>"                          # transformers' InternVL video token, what a template renders a video as
FRAME = "Frame{index}: "                   # each frame's label in the processor's video expansion


def find_chat_template(folder: str | Path) -> tuple[str, Path] | None:
    """The processor's chat template of `folder` and its file, as transformers' processors load it."""
    folder = Path(folder)
    jinja = folder / TEMPLATE_FILES[0]
    if jinja.is_file():
        return jinja.read_text(), jinja
    path = folder / TEMPLATE_FILES[1]
    if path.is_file():
        data = read_json(path, "chat template")
        template = data.get("chat_template") if isinstance(data, dict) else None
        if not isinstance(template, str):
            raise CheckpointError(f"{path}: no \"chat_template\" string")
        return template, path
    return None


@lru_cache(maxsize=8)
def folder_template(folder: Path) -> tuple[str, Path] | None:
    """find_chat_template, read once per folder (the pipeline builds a prompt per query)."""
    return find_chat_template(folder)


def _raise_exception(message):
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compiled(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                 ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def messages_of(system: str, n_images: int, question: str, history=(), video: bool = False) -> list[dict]:
    """The chat messages of a query: the images (`video`: videos) in the first user turn, earlier
    turns as text."""
    def text(t):
        return [{"type": "text", "text": t}]

    messages = [{"role": "system", "content": system}] if system else []
    first = history[0][0] if history else question
    kind = "video" if video else "image"
    messages.append({"role": "user", "content": [{"type": kind} for _ in range(n_images)] + text(first)})
    for index, (_, answer) in enumerate(history):
        messages.append({"role": "assistant", "content": text(answer)})
        later = history[index + 1][0] if index + 1 < len(history) else question
        messages.append({"role": "user", "content": text(later)})
    return messages


def render_text(template: str, system: str, n_images: int, question: str, history=(), video: bool = False) -> str:
    """The rendered chat template (image or video placeholders not yet expanded)."""
    try:
        return _compiled(template).render(messages=messages_of(system, n_images, question, history, video),
                                          add_generation_prompt=True)
    except TemplateError as exc:
        raise CheckpointError(f"chat template failed to render {len(history) + 1} user turn(s) with {n_images} "
                              f"{'video' if video else 'image'}(s): {exc}") from None


@lru_cache(maxsize=64)
def template_pieces(tok: Tokenizer, template: str, system: str, n_images: int, history=(),
                    video: bool = False) -> tuple[list[str], str]:
    """The rendered text around the images (videos): n_images + 1 pieces (the last holds
    QUESTION_MARK), checked to hold exactly one placeholder per image and the question once."""
    text = render_text(template, system, n_images, QUESTION_MARK, history, video)
    placeholder = VIDEO if video else IMG_CONTEXT
    pieces = text.split(placeholder)
    if len(pieces) != n_images + 1 or text.count(QUESTION_MARK) != 1 or QUESTION_MARK not in pieces[-1]:
        raise CheckpointError(f"chat template: {n_images} {'video' if video else 'image'}(s) and a question render "
                              f"with {len(pieces) - 1} {placeholder} placeholder(s) and the question "
                              f"{'not ' if QUESTION_MARK not in pieces[-1] else ''}after them; unsupported template")
    return pieces, text


def build_template_prompt(
    tok: Tokenizer, template: str, system: str, cameras, question: str, tokens_per_camera: int, history=(),
    frames: int = 1,
) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, int]]:
    """The fields of prompt.Prompt (input_ids, image_spans, question_span) for `cameras` (one image
    each) and `question`, by the folder's chat template; prompt.py builds the Prompt from them
    (returned as a tuple because prompt.py imports this module, not the other way round). With
    `history` ((question, answer) of earlier turns), the conversation; its question_span is the
    first question's, and the first turn must render as a prefix of it (checked: a template that
    rewrote the first turn once others follow could not continue a conversation's cache)."""
    if not cameras:
        raise InputError("a prompt needs at least one camera", about="image")
    if any(IMG_CONTEXT in t or QUESTION_MARK in t for t in (question, *(t for turn in history for t in turn))):
        raise InputError(f"question contains reserved token {IMG_CONTEXT!r}", about="question")
    ids, spans, question_span = _template_ids(tok, template, system, cameras, question, tokens_per_camera,
                                              tuple(history), frames)
    if not history:
        return ids, spans, question_span
    first_ids, first_spans, first_question = _template_ids(tok, template, system, cameras, history[0][0],
                                                           tokens_per_camera, (), frames)
    if spans != first_spans or ids[:first_question[1] + 1] != first_ids[:first_question[1] + 1]:
        raise CheckpointError("chat template: the first turn renders differently once later turns follow it; "
                              "follow-up questions are not supported with this template")
    return ids, spans, first_question


def _template_ids(tok: Tokenizer, template: str, system: str, cameras, question: str, tokens_per_camera: int,
                  history: tuple, frames: int = 1
                  ) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, int]]:
    """Ids, image spans and the span of the last question (the one QUESTION_MARK stands for)."""
    pieces, _ = template_pieces(tok, template, system, len(cameras), history, frames > 1)
    ids = list(tok.added_around_text[0])
    spans = []
    for piece in pieces[:-1]:
        text = piece                    # the text up to the next special token (<img>), tokenized as one piece
        for frame in range(1, frames + 1):
            if frames > 1:              # the processor's video expansion: "\n"-joined "Frame{i}: <img>...</img>"
                text += ("\n" if frame > 1 else "") + FRAME.format(index=frame)
            ids.extend(tok.encode_cached(text))
            text = ""
            ids.append(tok.img_start_id)
            spans.append((len(ids), tokens_per_camera))
            ids.extend([tok.img_context_id] * tokens_per_camera)
            ids.append(tok.img_end_id)
    before, after = pieces[-1].split(QUESTION_MARK)
    # The question's piece runs from the last special token before it to the next one (the text after
    # the last </img> up to <|im_end|> in the -hf templates), as prompt.py's question_span.
    specials = [tok.id_to_token(i) for i in tok.special_ids]
    cut = max((before.rfind(t) + len(t) for t in specials if t in before), default=0)
    ids.extend(tok.encode_cached(before[:cut]) if not history else tok.encode(before[:cut]))
    tail = tok.encode(before[cut:] + question + after)
    start = len(ids)
    question_end = next((i for i, t in enumerate(tail) if t in tok.special_ids), len(tail))
    ids.extend(tail)
    ids.extend(tok.added_around_text[1])
    return tuple(ids), tuple(spans), (start, start + question_end)
