"""Tokenizer loading (tokenizer.json via `tokenizers`, or tokenizer.model via `sentencepiece`),
and what the tokenizer's own configuration adds around a whole text (BOS), which prompt.py puts
around every prompt.

Prompts are built in prompt.py, id by id: text pieces between special tokens are tokenized on
their own (`encode_cached`) and the visual tokens spliced in as ids, so that no string with
thousands of `<IMG_CONTEXT>` tokens is ever tokenized.
"""

from __future__ import annotations

import re
from functools import cached_property, lru_cache
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..errors import CheckpointError, read_json

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
            path = folder / "tokenizer.json"
            try:
                self._tok = HFTokenizer.from_file(str(path))
            except Exception as exc:  # tokenizers raises a bare Exception ("EOF while parsing a value ...")
                raise CheckpointError(f"{path}: not a readable tokenizers file ({exc})") from None
            self._encode = lambda s: self._tok.encode(s, add_special_tokens=False).ids
            self._vocab = self._tok.get_vocab(with_added_tokens=True)
            self._decode_one = None
        elif (folder / "tokenizer.model").is_file():
            # Imported here: only a sentencepiece folder (InternLM2's tokenizer.model) needs it; the
            # project's own checkpoints and Qwen2.5's are tokenizer.json.
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

    def id_to_token(self, token_id: int) -> str:
        return self._tokens_by_id[int(token_id)]

    @cached_property
    def _tokens_by_id(self) -> dict[int, str]:
        return {i: t for t, i in self._vocab.items()}

    @cached_property
    def added_around_text(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ids before, ids after) that this tokenizer adds around a whole text when it tokenizes
        with special tokens, as upstream's `tokenizer(prompt)` does: InternLM2's `<s>`, nothing
        for Qwen2.5.

        A sentencepiece tokenizer.model follows tokenizer_config.json: `add_bos_token` (default
        true, as in InternLM2Tokenizer and LlamaTokenizer) with its `bos_token`, `add_eos_token`
        (default false) with its `eos_token`. A tokenizer.json follows its post-processor, as
        transformers 5 does (it drops the config's flags when there is a tokenizer.json); a config
        flag that says otherwise is an error, since transformers 4's Llama tokenizers obeyed it.
        """
        config = read_tokenizer_config(self.folder)
        if hasattr(self, "_sp"):
            before = self._config_token_id(config, "bos_token") if config.get("add_bos_token", True) else None
            after = self._config_token_id(config, "eos_token") if config.get("add_eos_token", False) else None
            return tuple(i for i in (before,) if i is not None), tuple(i for i in (after,) if i is not None)
        before, after = self._post_processor_ids()
        for key, ids, where in (("add_bos_token", before, "before"), ("add_eos_token", after, "after")):
            if key in config and bool(config[key]) != bool(ids):
                raise CheckpointError(
                    f"{self.folder / 'tokenizer_config.json'}: {key} is {config[key]} but tokenizer.json's "
                    f"post_processor adds {ids or 'nothing'} {where} a text; make them agree")
        return before, after

    def _config_token_id(self, config: dict, key: str) -> int | None:
        """The id of tokenizer_config.json's `bos_token` / `eos_token` (a string or an AddedToken
        dict); absent: the sentencepiece model's own (InternLM2Tokenizer's is `sp_model.bos_id()`)."""
        if key not in config:
            sp_id = self._sp.bos_id() if key == "bos_token" else self._sp.eos_id()
            return sp_id if sp_id >= 0 else None
        token = config[key].get("content") if isinstance(config[key], dict) else config[key]
        if token is None:
            return None
        if token not in self._vocab:
            raise CheckpointError(f"{self.folder / 'tokenizer_config.json'}: {key} {token!r} is not in the vocabulary")
        return self._vocab[token]

    def _post_processor_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # The post-processor (TemplateProcessing, RobertaProcessing, ByteLevel, a Sequence of them)
        # is asked through `tokenizers` itself: where a probe's own ids land among the ids it
        # returns with special tokens says what it puts before and after.
        probe = "a"
        plain = self._tok.encode(probe, add_special_tokens=False).ids
        full = self._tok.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if plain and full[start:start + len(plain)] == plain:
                return tuple(full[:start]), tuple(full[start + len(plain):])
        raise CheckpointError(f"{self.folder / 'tokenizer.json'}: its post_processor does not keep a text's "
                              f"own ids ({plain} -> {full}); unsupported")


def read_tokenizer_config(folder: Path) -> dict:
    path = Path(folder) / "tokenizer_config.json"
    return read_json(path, "tokenizer config") if path.is_file() else {}


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


def train_bpe_tokenizer(texts, vocab_size: int, out_file: Path) -> None:
    """A byte-level BPE tokenizer for the project's own small checkpoints (any text encodes)."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out_file))
