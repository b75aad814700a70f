"""Prompt layouts: the token ids the decoder sees for (system message, cameras, question), equal to
what upstream InternVL's `chat()` gives, built id by id.

Upstream builds one string with the `internvl2_5` template (conversation.py, separator style MPT)

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n

replaces each `<image>` in it, in order, by `<img>` + `<IMG_CONTEXT>` x (tokens per tile x tiles) +
`</img>`, and tokenizes it whole with `tokenizer(query)`, which adds what the tokenizer's own
configuration adds (InternLM2Tokenizer: `<s>`; Qwen2.5's tokenizer.json: nothing; see
`Tokenizer.added_around_text`). The user turn `{user}` is the layout's image lines, then the question:

    internvl   upstream's convention: one image `<image>\\n{question}` (what `chat()` prepends);
               several `Image-1: <image>\\nImage-2: <image>\\n...{question}` (the InternVL
               model card's multi-image convention, `num_patches_list` one entry per camera)
    cameras    `{camera}: <image>\\n` per camera: `CAM_FRONT: <img>..</img>\\nCAM_BACK: ...`
               (the project's models, the bundled one included, are trained with it)
    template   any other string: the text of one camera's line, with exactly one `<image>` and
               optionally `{camera}` (its name) and `{index}` (1, 2, ...); the lines come in camera
               order before the question. `Image-{index}: <image>\\n` is `internvl` for several
               cameras, `{camera}: <image>\\n` is `cameras`.

Frame sets over time (`frames` K > 1, a motion question; docs/motion.md): each camera's `<image>`
becomes its K frames, oldest first, the way upstream's video chat writes a video,

    Frame1: <image>\nFrame2: <image>\n...FrameK: <image>

(InternVL's README: `video_prefix = ''.join([f'Frame{i+1}: <image>\n' ...])`, one tile per frame;
transformers' InternVLProcessor expands a video the same way, `\n`-joined), so the image spans come
camera by camera, each camera's frames oldest first, the key frame last. One camera in the
`internvl` layout is then exactly upstream's video-chat prompt (`<image>\n` + question with the
image line replaced by the frames); several cameras are several videos, each under its own line
(`Image-1: Frame1: <image>\nFrame2: ...\nImage-2: Frame1: ...`, `CAM_FRONT: Frame1: <image>\n...`),
as an `-hf` folder's chat template writes one `{"type": "video"}` per camera (chat_template.py).
K = 1 is the single-frame prompt, id for id.

Which layout a model folder uses: the `prompt_layout` key of `litevlm.json` in the folder
(`{"prompt_layout": "internvl"}`), overridden by `PipelineOptions.prompt_layout` /
`litevlm prompt --layout`. A folder without litevlm.json gets `internvl` when it looks upstream
(a sentencepiece tokenizer.model, or tokenizer_config.json's `tokenizer_class` an InternLM2 or Qwen2
tokenizer) and `cameras` otherwise (the project's own byte-level BPE checkpoints).

Why id by id: tokenizers cut a text at special tokens before anything else, so the ids of the
whole string are the ids of each piece of text between two special tokens, tokenized on its own.
The pieces are tokenized (and cached) that way, the `<IMG_CONTEXT>` runs are written as ids, and
the string with thousands of `<IMG_CONTEXT>` is never built. Everything up to the last camera's
`</img>` depends only on (cameras, layout) and is cached; the question's piece is the text from
there to `<|im_end|>`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import unicodedata
from array import array
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import CheckpointError, InputError, LiteVLMError, read_json
from ..weights.hf_layout import is_hf_layout
from ..weights.tokenizer import SPECIAL_TOKENS, Tokenizer, read_tokenizer_config
from . import chat_template


def is_noncharacter(ch: str) -> bool:
    """Unicode's 66 noncharacters (U+FDD0..U+FDEF and the last two code points of every plane):
    never text, only what a broken encoder or a fuzzer sends."""
    cp = ord(ch)
    return 0xFDD0 <= cp <= 0xFDEF or (cp & 0xFFFE) == 0xFFFE


def is_blank(text: str) -> bool:
    """The one blank-question rule: nothing a reader could see, only whitespace, control and
    format characters (zero-width space, joiners, soft hyphen U+00AD, BOM, word joiner ... are
    category Cf, which str.strip() keeps), the replacement character U+FFFD (what a decoder writes
    for bytes it could not read) and noncharacters. The query server applies it before frames are
    matched; the pipeline's check_question applies it for direct callers."""
    return all(ch.isspace() or ch == "\ufffd" or is_noncharacter(ch)
               or unicodedata.category(ch) in ("Cc", "Cf", "Zs", "Zl", "Zp") for ch in text)

LAYOUTS = ("internvl", "cameras")
LAYOUT_FILE = "litevlm.json"
LAYOUT_KEY = "prompt_layout"
IMAGE = "<image>"
FRAME = "Frame{index}: "         # a frame's label within a camera's frames (upstream's video prefix)
PLACEHOLDERS = ("{camera}", "{index}")
# tokenizer_config.json classes of upstream InternVL2.5 checkpoints (InternLM2 for 2B/8B, Qwen2.5 for 1B/4B)
UPSTREAM_TOKENIZER_CLASSES = ("InternLM2Tokenizer", "InternLM2TokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast")


@dataclass(frozen=True)
class Prompt:
    input_ids: tuple[int, ...]                  # every id, `<IMG_CONTEXT>` placeholders included
    # per camera, and per frame set within it oldest first (K > 1): (index of its first <IMG_CONTEXT>, count)
    image_spans: tuple[tuple[int, int], ...]
    question_span: tuple[int, int]              # [start, end): the text after the last </img> up to <|im_end|>


def check_layout(layout, source: str = "prompt layout", error: type[LiteVLMError] = InputError) -> str:
    """`layout` if it is a layout name or a valid template, else `error` naming `source`."""
    if layout in LAYOUTS or layout == chat_template.LAYOUT:      # the latter: -hf folders (chat_template.py)
        return layout
    hint = f"a layout is {' or '.join(LAYOUTS)}, or a template with one {IMAGE} such as 'Image-{{index}}: <image>\\n'"
    if not isinstance(layout, str) or layout.count(IMAGE) != 1:
        raise error(f"{source} {layout!r}: {hint}")
    unknown = [p for p in re.findall(r"\{[^{}]*\}", layout) if p not in PLACEHOLDERS]
    if unknown:
        raise error(f"{source} {layout!r}: unknown placeholder {unknown[0]} (known: {', '.join(PLACEHOLDERS)})")
    reserved = [t for t in SPECIAL_TOKENS if t in layout]
    if reserved:
        raise error(f"{source} {layout!r}: contains the special token {reserved[0]!r} (the layout writes "
                    f"<img>...</img> itself where {IMAGE} stands)")
    return layout


def model_layout(folder: str | Path) -> tuple[str, str]:
    """The layout a model folder was trained with, and where that was read from."""
    folder = Path(folder)
    path = folder / LAYOUT_FILE
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
        if not isinstance(data, dict) or LAYOUT_KEY not in data:
            raise CheckpointError(f"{path}: no {LAYOUT_KEY!r} key")
        extra = sorted(set(data) - {LAYOUT_KEY})
        if extra:
            raise CheckpointError(f"{path}: unknown key {extra[0]!r} (known: {LAYOUT_KEY!r})")
        return check_layout(data[LAYOUT_KEY], f"{path}: {LAYOUT_KEY}", CheckpointError), str(path)
    if _is_hf_folder(folder):
        found = chat_template.find_chat_template(folder)
        if found is None:
            raise CheckpointError(f"{folder}: an InternVLForConditionalGeneration (-hf) folder without "
                                  f"{' or '.join(chat_template.TEMPLATE_FILES)} (its processor's chat template, "
                                  f"which decides its prompt); add the file or a {LAYOUT_FILE}")
        return chat_template.LAYOUT, f"no {LAYOUT_FILE}; an -hf folder: its processor's {found[1].name}"
    if (folder / "tokenizer.model").is_file():
        return "internvl", f"no {LAYOUT_FILE}; tokenizer.model (an upstream sentencepiece tokenizer)"
    tokenizer_class = read_tokenizer_config(folder).get("tokenizer_class")
    if tokenizer_class in UPSTREAM_TOKENIZER_CLASSES:
        return "internvl", f"no {LAYOUT_FILE}; tokenizer_class {tokenizer_class} (upstream)"
    return "cameras", f"no {LAYOUT_FILE}; a project tokenizer ({tokenizer_class or 'tokenizer.json'})"


def _is_hf_folder(folder: Path) -> bool:
    path = folder / "config.json"
    if not path.is_file():
        return False
    config = read_json(path, "model config")
    return isinstance(config, dict) and is_hf_layout(config)


def resolve_layout(override: str | None, folder: str | Path) -> tuple[str, str]:
    """`override` (an option) when given, else the model folder's layout; and where it came from."""
    if override is not None:
        return check_layout(override), "option"
    return model_layout(folder)


def write_layout(folder: str | Path, layout: str) -> None:
    """Record in a model folder the layout it was trained with."""
    path = Path(folder) / LAYOUT_FILE
    path.write_text(json.dumps({LAYOUT_KEY: check_layout(layout)}, ensure_ascii=False) + "\n")


def image_line(layout: str, n_cameras: int) -> str:
    """The template of one camera's line in the user turn."""
    if layout == "internvl":
        return IMAGE + "\n" if n_cameras == 1 else "Image-{index}: " + IMAGE + "\n"
    if layout == "cameras":
        return "{camera}: " + IMAGE + "\n"
    return layout


def build_prompt(tok: Tokenizer, system: str, layout: str, cameras: list[str] | tuple[str, ...], question: str,
                 tokens_per_camera: int, history: tuple[tuple[str, str], ...] = (), frames: int = 1) -> Prompt:
    """The full prompt for `cameras` (each `tokens_per_camera` visual tokens per frame set) and
    `question`; with `history` ((question, answer) of the earlier turns, oldest first), the
    conversation that `question` continues, as upstream's `chat(..., history=)` builds it: the
    images in the first user turn, each earlier answer an assistant turn (`later_turns`).
    `question_span` is always the first question's (the one the images came with: the token
    selector ranks against it). `frames` > 1: each camera's frame sets, oldest first, as a video
    (the module's docstring); the spans come camera by camera, frames within."""
    for text, what in [(question, "question"), *((t, f"history turn {i}") for i, turn in enumerate(history, 1)
                                                 for t in turn)]:
        reserved = [t for t in SPECIAL_TOKENS if t in text]
        if reserved:
            raise InputError(f"{what} contains reserved token {reserved[0]!r}", about="question")
    if layout == chat_template.LAYOUT:
        found = chat_template.folder_template(tok.folder)
        if found is None:
            raise CheckpointError(f"{tok.folder}: prompt layout {layout!r} but no "
                                  f"{' or '.join(chat_template.TEMPLATE_FILES)}")
        return Prompt(*chat_template.build_template_prompt(tok, found[0], system, cameras, question, tokens_per_camera,
                                                           tuple(history), frames))
    if not cameras:
        raise InputError("a prompt needs at least one camera", about="image")
    if frames < 1:
        raise InputError(f"a prompt needs at least one frame set (frames {frames})", about="image")
    head, spans, text_after_images = _head(tok, system, layout, tuple(cameras), tokens_per_camera, frames)
    first = history[0][0] if history else question
    question_ids = tok.encode_cached(text_after_images + first)
    rest = tuple(tok.encode(later_turns(history, question))) + tok.added_around_text[1] if history else _tail(tok)
    ids = head + question_ids + rest
    return Prompt(ids, spans, (len(head), len(head) + len(question_ids)))


def later_turns(history, question: str) -> str:
    """The conversation after the first question, as upstream's `conversation.py` writes it
    (template internvl2_5, separator style MPT: every message is role + message + `<|im_end|>\n`,
    and a message that is empty is its role alone, upstream's `if message:`), ending with the
    generation prompt. Tokenized whole: a tokenizer cuts it at its special tokens first, so its ids
    are those of the same text inside the whole conversation string."""
    user, assistant, sep = "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n"
    text = sep
    for index, (earlier_question, answer) in enumerate(history):
        if index:
            text += user + earlier_question + sep
        text += assistant + answer + sep if answer else assistant
    return text + user + question + sep + assistant


class _IdWriter:
    """Ids as a tokenizer cuts the string: text waits for the next special token (or the end),
    then is tokenized as one piece."""

    def __init__(self, tok: Tokenizer, ids=()):
        self.tok, self.ids, self.text = tok, list(ids), ""

    def flush(self) -> None:
        if self.text:
            self.ids.extend(self.tok.encode_cached(self.text))
            self.text = ""

    def special(self, token_id: int) -> None:
        self.flush()
        self.ids.append(token_id)


@lru_cache(maxsize=64)
def _head(tok: Tokenizer, system: str, layout: str, cameras: tuple[str, ...], tokens_per_camera: int,
          frames: int = 1) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], str]:
    """Ids up to the last camera's `</img>`, each camera's (and frame's) span, and the text that
    follows it."""
    line = image_line(check_layout(layout), len(cameras))
    w = _IdWriter(tok, tok.added_around_text[0])
    w.special(tok.im_start_id)
    w.text += f"system\n{system}"
    w.special(tok.im_end_id)
    w.text += "\n"
    w.special(tok.im_start_id)
    w.text += "user\n"
    spans = []
    for index, camera in enumerate(cameras, 1):
        text_before, text_after = line.replace("{camera}", camera).replace("{index}", str(index)).split(IMAGE)
        w.text += text_before
        for frame in range(1, frames + 1):
            if frames > 1:                          # a video: "Frame1: <image>\nFrame2: <image>..."
                w.text += ("\n" if frame > 1 else "") + FRAME.format(index=frame)
            w.special(tok.img_start_id)
            spans.append((len(w.ids), tokens_per_camera))
            w.ids.extend([tok.img_context_id] * tokens_per_camera)
            w.special(tok.img_end_id)
        w.text += text_after
    return tuple(w.ids), tuple(spans), w.text


@lru_cache(maxsize=64)
def _tail(tok: Tokenizer) -> tuple[int, ...]:
    """`<|im_end|>\\n<|im_start|>assistant\\n` after the question, then what the tokenizer adds at the end."""
    w = _IdWriter(tok)
    w.special(tok.im_end_id)
    w.text += "\n"
    w.special(tok.im_start_id)
    w.text += "assistant\n"
    w.flush()
    return tuple(w.ids) + tok.added_around_text[1]


def prompt_digest(ids) -> str:
    """sha256 of prompt ids as little-endian int32 (`<IMG_CONTEXT>` placeholders included): equal
    digests, equal prompts. Every Answer carries its prompt's; `litevlm prompt` prints it."""
    values = array("i", [int(i) for i in ids])
    if sys.byteorder == "big":
        values.byteswap()
    return hashlib.sha256(values.tobytes()).hexdigest()


def render(tok: Tokenizer, ids) -> str:
    """The prompt as text: special tokens (BOS included) written out, each run of `<IMG_CONTEXT>`
    collapsed to `<IMG_CONTEXT>*N`, the text between them decoded."""
    written_out = tok.special_ids | set(tok.added_around_text[0]) | set(tok.added_around_text[1])
    out: list[str] = []
    text: list[int] = []
    i = 0
    while i < len(ids):
        token_id = int(ids[i])
        if token_id not in written_out:
            text.append(token_id)
            i += 1
            continue
        if text:
            out.append(tok.decode(text))
            text = []
        n = 1
        while token_id == tok.img_context_id and i + n < len(ids) and int(ids[i + n]) == token_id:
            n += 1
        out.append(tok.id_to_token(token_id) + (f"*{n}" if n > 1 else ""))
        i += n
    if text:
        out.append(tok.decode(text))
    return "".join(out)
