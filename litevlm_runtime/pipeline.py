"""The LiteVLM pipeline for one query, top to bottom:

    view select -> preprocess -> vision -> token select -> prefill -> decode

Each stage reads and writes arena buffers (fixed tensors sized at start-up), is timed, and is
reported in the Answer. The policies of the selection and decoding stages are pluggable: the
defaults keep every camera and every visual token and decode greedily.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .answer import Answer
from .arena import Arena, Limits
from .cameras import CAMERAS
from .checkpoint import load_model, read_config
from .engines import make_engines
from .models.eagle import load_draft_head
from .speculative import Eagle2Decoder
from .errors import InputError
from .preprocess import Normalizer, load_image, to_tiles_uint8
from .timing import StageTimer
from .tokenizer import SPECIAL_TOKENS, Tokenizer, chat_segments, segment_ids

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class PipelineOptions:
    device: str = "cpu"
    dtype: str = "float32"
    tiles_per_camera: int = 1           # 1 or 2 tiles of S x S per camera (2 = the paper's 12-tile rig)
    max_question_tokens: int = 256
    max_new_tokens: int = 64
    cameras: tuple[str, ...] = CAMERAS  # the rig this pipeline serves
    backend: str = "torch"              # stage engines: torch | onnxruntime | tensorrt
    decoding: str = "greedy"            # greedy | eagle (EAGLE-2 draft tree, lossless under greedy)
    eagle_dir: str | None = None        # draft head folder (default: <model>/eagle)
    eagle_total: int = 60               # draft tree nodes verified per step (paper default 60)
    eagle_depth: int = 6                # draft levels (paper 5 to 7)
    eagle_topk: int = 10                # children expanded per node (paper 10)
    threads: int | None = None          # torch intra-op threads (None: torch's default). On a shared
                                        # CPU, fewer threads than cores avoids OpenMP spin contention.
    extra: dict = field(default_factory=dict)

    def limits(self, template_tokens: int) -> Limits:
        return Limits(
            cameras=len(self.cameras),
            tiles_per_camera=self.tiles_per_camera,
            text_tokens=template_tokens + self.max_question_tokens,
            new_tokens=self.max_new_tokens,
            tree_tokens=max(64, self.eagle_total + 1, (self.eagle_depth - 1) * self.eagle_topk),
            draft_layers=1 if self.decoding == "eagle" else 0,
        )


class Pipeline:
    def __init__(self, model, tokenizer: Tokenizer, options: PipelineOptions, name: str = "model", draft=None):
        self.name = name
        self.options = options
        if options.threads:
            torch.set_num_threads(options.threads)
        self.device = torch.device(options.device)
        self.dtype = DTYPES[options.dtype]
        self.model = model.to(self.device, self.dtype).eval()
        self.cfg = model.cfg
        self.tok = tokenizer
        self.lm = self.model.language_model
        self.tile = self.cfg.force_image_size
        self.tiles_per_camera = options.tiles_per_camera
        self.tokens_per_camera = options.tiles_per_camera * self.cfg.tokens_per_tile
        # Everything in the prompt except the visual tokens and the question, for the worst case.
        template_ids, _ = segment_ids(tokenizer, chat_segments(self.cfg.system_message, list(options.cameras), ""),
                                      [0] * len(options.cameras))
        self.arena = Arena(self.cfg, options.limits(len(template_ids) + 8), self.dtype, self.device)
        self.lm.init_rope(self.arena.max_len)
        self.lm.to(self.device)
        self.normalize = Normalizer(self.dtype, self.device)
        with torch.inference_mode():
            grid = self.cfg.patches_per_side
            self.pos_embed = self.model.vision_model.embeddings.position_embedding_for(grid, grid)
        self.engines = make_engines(self, options.backend)
        self.eagle = None
        if options.decoding == "eagle":
            if draft is None:
                raise InputError("decoding='eagle' needs an EAGLE-2 draft head (train one: litevlm train eagle)")
            draft.init_rope(self.arena.max_len)
            self.eagle = Eagle2Decoder(self, draft.to(self.device, self.dtype),
                                       options.eagle_total, options.eagle_depth, options.eagle_topk)
        elif options.decoding != "greedy":
            raise InputError(f"unknown decoding {options.decoding!r} (greedy | eagle)")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, options: PipelineOptions | None = None) -> "Pipeline":
        options = options or PipelineOptions()
        read_config(model_dir)  # fail fast on a bad folder before loading weights
        model = load_model(model_dir, DTYPES[options.dtype])
        draft = None
        if options.decoding == "eagle":
            draft = load_draft_head(Path(options.eagle_dir or Path(model_dir) / "eagle"), model.cfg.llm,
                                    4096, DTYPES[options.dtype])
        pipe = cls(model, Tokenizer(model_dir), options, name=Path(model_dir).name, draft=draft)
        pipe.model_dir = Path(model_dir)
        return pipe

    # ---------------------------------------------------------------- the query, top to bottom
    @torch.inference_mode()
    def answer(self, images: dict, question: str, max_new_tokens: int | None = None) -> Answer:
        question_ids = self.check_question(question)
        max_new = min(max_new_tokens or self.options.max_new_tokens, self.arena.limits.new_tokens)
        timer = StageTimer(self.device)

        with timer("view_select"):
            cameras = self.select_views(question)
        missing = [c for c in cameras if c not in images or images[c] is None]
        if missing:
            raise InputError(f"no image for camera(s) {', '.join(missing)}")

        with timer("preprocess"):
            pixels = self.preprocess(images, cameras)
        with timer("vision"):
            visual = self.encode(pixels)                       # [cams, tokens_per_camera, D]
        with timer("token_select"):
            keep = self.select_tokens(visual, question_ids)   # per camera: kept token indices
        with timer("prefill"):
            prompt_len, first_pos, next_id = self.prefill(cameras, question, visual, keep)
        with timer("decode"):
            decode = self.eagle.decode if self.eagle is not None else self.decode
            out_ids, steps, accepted = decode(next_id, prompt_len, first_pos, max_new)

        kept = sum(len(k) for k in keep)
        return Answer(
            question=question,
            text=self.tok.decode(out_ids).strip(),
            token_ids=out_ids,
            stage_ms=timer.milliseconds(),
            cameras=list(cameras),
            visual_tokens=len(cameras) * self.tokens_per_camera,
            kept_tokens=kept,
            input_tokens=prompt_len,
            decode_steps=steps,
            accepted_length=accepted,
        )

    # ---------------------------------------------------------------- stages
    def check_question(self, question: str) -> list[int]:
        if not isinstance(question, str) or not question.strip():
            raise InputError("empty question")
        bad = [t for t in SPECIAL_TOKENS if t in question]
        if bad:
            raise InputError(f"question contains reserved token {bad[0]!r}")
        ids = self.tok.encode(question)
        if len(ids) > self.options.max_question_tokens:
            raise InputError(f"question too long: {len(ids)} tokens > {self.options.max_question_tokens}")
        return ids

    def select_views(self, question: str) -> list[str]:
        return list(self.options.cameras)

    def preprocess(self, images: dict, cameras: list[str]) -> torch.Tensor:
        tpc, s = self.tiles_per_camera, self.tile
        for i, cam in enumerate(cameras):
            img = load_image(images[cam], cam, (s * tpc, s))
            to_tiles_uint8(img, s, tpc, self.arena.pixels_u8[i * tpc:(i + 1) * tpc])
        n = len(cameras) * tpc
        return self.normalize(self.arena.pixels_u8[:n], self.arena.pixels[:n])

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        n_cams = pixels.shape[0] // self.tiles_per_camera
        out = self.arena.visual[:pixels.shape[0]]
        out.copy_(self.engines.vision.run(pixels=pixels))
        return out.view(n_cams, self.tokens_per_camera, -1)

    def select_tokens(self, visual: torch.Tensor, question_ids: list[int]) -> list[torch.Tensor]:
        return [self.arena.slots[:visual.shape[1]] for _ in range(visual.shape[0])]

    @torch.inference_mode()
    def reference_inputs(self, images: dict, question: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [1, T] with `<IMG_CONTEXT>` placeholders, pixels [tiles, 3, S, S]) of the query
        as this pipeline would see it, for feeding a reference implementation the same inputs."""
        cameras = self.select_views(question)
        ids, _ = self.prompt_ids(cameras, question)
        return torch.tensor([ids]), self.preprocess(images, cameras).clone()

    def prompt_ids(self, cameras: list[str], question: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The full prompt's token ids with `<IMG_CONTEXT>` placeholders, and each camera's (start, count)."""
        return segment_ids(self.tok, chat_segments(self.cfg.system_message, cameras, question),
                           [self.tokens_per_camera] * len(cameras))

    def prefill(self, cameras, question, visual, keep) -> tuple[int, int, int]:
        """Build [template, <img> kept visual </img> per camera, question] as ids + embeddings
        directly in the arena, run the decoder over it, and return (length, next position, first token).

        Kept visual tokens keep their original position ids: the prompt is laid out as if every
        visual token were present, and only the kept ones are written.
        """
        a = self.arena
        full_ids, spans = self.prompt_ids(cameras, question)
        n = 0
        cursor = 0
        visual_rows = []          # (arena row, camera, kept token indices)
        full = torch.tensor(full_ids, dtype=torch.long)
        for cam_index, (start, count) in enumerate(spans):
            text = slice(cursor, start)
            m = start - cursor
            a.token_ids[n:n + m].copy_(full[text])
            a.positions[n:n + m] = torch.arange(cursor, start)
            n += m
            k = keep[cam_index]
            a.token_ids[n:n + len(k)] = self.tok.img_context_id
            a.positions[n:n + len(k)] = k + start
            visual_rows.append((n, cam_index, k))
            n += len(k)
            cursor = start + count
        m = len(full_ids) - cursor
        a.token_ids[n:n + m].copy_(full[cursor:])
        a.positions[n:n + m] = torch.arange(cursor, len(full_ids))
        n += m

        embeds = a.embeds[:n]
        torch.index_select(self.lm.embed.weight, 0, a.token_ids[:n], out=embeds)
        for row, cam_index, k in visual_rows:
            embeds[row:row + len(k)] = visual[cam_index, k]
        hidden = self.run_decoder(embeds, a.positions[:n], a.slots[:n], a.causal_mask(n))
        self.prefill_hidden = hidden          # target features of the prompt (EAGLE-2 draft input)
        next_id = int(self.engines.head.run(hidden=hidden[n - 1:n]).argmax(-1))
        return n, len(full_ids), next_id

    def run_decoder(self, embeds, positions, slots, mask) -> torch.Tensor:
        a = self.arena
        return self.engines.decoder.run(embeds=embeds, positions=positions, slots=slots, mask=mask,
                                        k_cache=a.k_cache, v_cache=a.v_cache)

    def decode(self, next_id: int, prompt_len: int, next_pos: int, max_new: int) -> tuple[list[int], int, float]:
        """Plain greedy decoding over the static cache: one decoder pass per token.
        Returns (answer ids, decoder passes, mean tokens accepted per pass = 1)."""
        a = self.arena
        out: list[int] = []
        steps = 0
        slot = prompt_len
        while next_id not in self.tok.eos_ids and len(out) < max_new:
            out.append(next_id)
            if len(out) == max_new:
                break
            a.token_ids[slot] = next_id
            a.positions[slot] = next_pos
            mask = a.mask[:1, :slot + 1]
            mask.fill_(True)
            emb = self.lm.embed(a.token_ids[slot:slot + 1])
            hidden = self.run_decoder(emb, a.positions[slot:slot + 1], a.slots[slot:slot + 1], mask)
            next_id = int(self.engines.head.run(hidden=hidden).argmax(-1))
            steps += 1
            slot += 1
            next_pos += 1
        return out, steps, 1.0
