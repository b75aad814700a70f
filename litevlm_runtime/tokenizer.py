"""Tokenizer loading (tokenizer.json via `tokenizers`, or tokenizer.model via `sentencepiece`) and
the `internvl2_5` chat template as a list of token-id segments.

The prompt is never built as one string with thousands of `<IMG_CONTEXT>` tokens: it is a list of
text segments split at special tokens (exactly where a tokenizer would split anyway), each
tokenized on its own and cached, with the visual tokens spliced in as embeddings.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from .errors import CheckpointError, read_json

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IMG_START, IMG_END, IMG_CONTEXT = "<img>", "</img>", "<IMG_CONTEXT>"
SPECIAL_TOKENS = [
    "<unk>", "<s>", "</s>", IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT,
    "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>",
]


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.folder = folder
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            path = folder / "tokenizer.json"
            try:
                self._tok = HFTokenizer.from_file(str(path))
            except Exception as exc:  # tokenizers raises a bare Exception ("EOF while parsing a value ...")
                raise CheckpointError(f"{path}: not a readable tokenizers file ({exc})") from None
            self._encode = lambda s: self._tok.encode(s, add_special_tokens=False).ids
            self._vocab = self._tok.get_vocab(with_added_tokens=True)
            self._decode_one = None
        elif (folder / "tokenizer.model").is_file():
            import sentencepiece as spm

            path = folder / "tokenizer.model"
            try:
                self._sp = spm.SentencePieceProcessor(model_file=str(path))
            except (OSError, RuntimeError) as exc:
                raise CheckpointError(f"{path}: not a readable sentencepiece model ({exc})") from None
            added = _added_tokens(folder)
            self._vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}
            self._vocab.update(added)
            self._special_re = re.compile("(" + "|".join(re.escape(t) for t in added) + ")")
            self._encode = self._encode_sentencepiece
        else:
            raise CheckpointError(f"{folder}: no tokenizer.json or tokenizer.model")
        missing = [t for t in (IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT) if t not in self._vocab]
        if missing:
            raise CheckpointError(f"{folder}: tokenizer lacks special token(s) {missing}")
        self.im_start_id, self.im_end_id = self._vocab[IM_START], self._vocab[IM_END]
        self.img_start_id, self.img_end_id = self._vocab[IMG_START], self._vocab[IMG_END]
        self.img_context_id = self._vocab[IMG_CONTEXT]
        self.eos_ids = {self.im_end_id} | ({self._vocab["</s>"]} if "</s>" in self._vocab else set())
        self.special_ids = {self._vocab[t] for t in SPECIAL_TOKENS if t in self._vocab}
        self.encode_cached = lru_cache(maxsize=256)(lambda s: tuple(self._encode(s)))

    @property
    def vocab_size(self) -> int:
        return max(self._vocab.values()) + 1

    def _encode_sentencepiece(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._special_re.split(text):
            if piece in self._vocab and self._special_re.fullmatch(piece):
                ids.append(self._vocab[piece])
            elif piece:
                ids.extend(self._sp.encode(piece))
        return ids

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if int(i) not in self.special_ids]
        if hasattr(self, "_tok"):
            return self._tok.decode(ids, skip_special_tokens=True)
        return self._sp.decode(ids)


def _added_tokens(folder: Path) -> dict[str, int]:
    cfg = folder / "tokenizer_config.json"
    if not cfg.is_file():
        return {}
    data = read_json(cfg, "tokenizer config")
    decoder = data.get("added_tokens_decoder", {}) if isinstance(data, dict) else None
    if not isinstance(decoder, dict):
        raise CheckpointError(f"{cfg}: added_tokens_decoder must be an object of id -> {{content, ...}}")
    added = {}
    for k, v in decoder.items():
        if not (k.isdigit() and isinstance(v, dict) and isinstance(v.get("content"), str)):
            raise CheckpointError(f"{cfg}: added_tokens_decoder[{k!r}] must map a token id to "
                                  f"{{\"content\": str, ...}}, got {v!r}")
        added[v["content"]] = int(k)
    return added


def chat_segments(system: str, cameras: list[str], question: str) -> list[str | int]:
    """The `internvl2_5` template for several images, as text segments and image slots.

    Each int is the index of an image (camera) whose `<img> <IMG_CONTEXT>*n </img>` goes there.
    Layout: <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{CAM}: <img>..</img>\\n ...
    {question}<|im_end|>\\n<|im_start|>assistant\\n
    """
    segs: list[str | int] = [IM_START, f"system\n{system}", IM_END, "\n", IM_START, "user\n"]
    for i, cam in enumerate(cameras):
        segs += [f"{cam}: ", i, "\n"]
    segs += [question, IM_END, "\n", IM_START, "assistant\n"]
    return segs


def segment_ids(tok: Tokenizer, segments: list[str | int], tokens_per_image: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of a chat, `<IMG_CONTEXT>` placeholders included, and each image's (start, count).

    Adjacent text is merged between special tokens so that the ids equal what tokenizing the
    whole prompt string would give (tokenizers split at special tokens the same way).
    """
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    specials = {IM_START: tok.im_start_id, IM_END: tok.im_end_id}
    text = ""

    def flush():
        nonlocal text
        if text:
            ids.extend(tok.encode_cached(text))
            text = ""

    for seg in segments:
        if isinstance(seg, int):
            flush()
            ids.append(tok.img_start_id)
            spans.append((len(ids), tokens_per_image[seg]))
            ids.extend([tok.img_context_id] * tokens_per_image[seg])
            ids.append(tok.img_end_id)
        elif seg in specials:
            flush()
            ids.append(specials[seg])
        else:
            text += seg
    flush()
    return ids, spans


def train_bpe_tokenizer(texts, vocab_size: int, out_file: Path) -> None:
    """A byte-level BPE tokenizer for the project's own small checkpoints (any text encodes)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out_file))
