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
from .fastv import FastV
from .token_selector import SCOPES, PromptLayout, check_keep_ratio, load_token_selector
from .preprocess import Normalizer, load_image, to_tiles_uint8
from .timing import StageTimer
from .prompt import Prompt, build_prompt, resolve_layout
from .tokenizer import SPECIAL_TOKENS, Tokenizer

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
    view_selection: str = "all"         # all | selector (text-only view selector, <model>/view_selector)
    view_selector_dir: str | None = None
    view_keyword_weight: float | None = None   # override the selector's saved fusion weight
    view_threshold: float | None = None        # override the selector's saved threshold
    decoding: str = "greedy"            # greedy | eagle (EAGLE-2 draft tree, lossless under greedy)
    eagle_dir: str | None = None        # draft head folder (default: <model>/eagle)
    eagle_total: int = 60               # draft tree nodes verified per step (paper default 60)
    eagle_depth: int = 6                # draft levels (paper 5 to 7)
    eagle_topk: int = 10                # children expanded per node (paper 10)
    temperature: float = 0.0            # 0: greedy; > 0: sampling (EAGLE-2 verifies by rejection sampling)
    seed: int = 0                       # sampling generator seed
    token_keep_ratio: float = 1.0       # token selector: keep this fraction of visual tokens (1.0 = all,
                                        # selector off; paper 0.8 FP16, 0.9 FP8)
    token_selector: str | None = None   # selector folder (default: <model>/token_selector if present);
                                        # "layer0" = the untrained copy of the decoder's first layer
    token_reduce: str | None = None     # over question tokens: max | mean (None: the selector's own)
    token_scope: str = "camera"         # top r of each camera (camera) or of all visual tokens (global)
    fastv_k: int = 2                    # FastV baseline: prune inside the decoder from layer K on
    fastv_ratio: float = 0.0            # FastV drop ratio R (0 = off; the paper's "FastV r=0.3" keeps
                                        # 0.3 of the visual tokens, i.e. R = 0.7)
    prompt_layout: str | None = None    # internvl | cameras | a template with <image> (prompt.py); None:
                                        # the model folder's (litevlm.json, else guessed from its tokenizer)
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
    def __init__(self, model, tokenizer: Tokenizer, options: PipelineOptions, name: str = "model", draft=None,
                 token_selector=None, model_dir: str | Path | None = None):
        self.name = name
        self.model_dir = Path(model_dir) if model_dir else None
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
        self.prompt_layout, _ = resolve_layout(options.prompt_layout, self.model_dir or tokenizer.folder)
        # Everything in the prompt except the visual tokens and the question, for the worst case.
        template = self.prompt(list(options.cameras), "")
        template_tokens = len(template.input_ids) - len(options.cameras) * self.tokens_per_camera
        self.arena = Arena(self.cfg, options.limits(template_tokens + 8), self.dtype, self.device)
        self.lm.init_rope(self.arena.max_len)
        self.lm.to(self.device)
        self.normalize = Normalizer(self.dtype, self.device)
        with torch.inference_mode():
            grid = self.cfg.patches_per_side
            self.pos_embed = self.model.vision_model.embeddings.position_embedding_for(grid, grid)
        self.engines = make_engines(self, options.backend)
        self.view_selector = None
        if options.view_selection == "selector":
            from .view_selector import load_view_selector

            folder = options.view_selector_dir or (Path(self.model_dir) / "view_selector" if self.model_dir else None)
            if folder is None:
                raise InputError("view_selection='selector' needs view_selector_dir")
            self.view_selector = load_view_selector(folder, keyword_weight=options.view_keyword_weight,
                                                    threshold=options.view_threshold)
        elif options.view_selection != "all":
            raise InputError(f"unknown view_selection {options.view_selection!r} (all | selector)")
        self.sampler = torch.Generator().manual_seed(options.seed)
        self.eagle = None
        if options.decoding == "eagle":
            if draft is None:
                raise InputError("decoding='eagle' needs an EAGLE-2 draft head (train one: litevlm train eagle)")
            draft.init_rope(self.arena.max_len)
            self.eagle = Eagle2Decoder(self, draft.to(self.device, self.dtype),
                                       options.eagle_total, options.eagle_depth, options.eagle_topk,
                                       options.temperature, self.sampler)
        elif options.decoding != "greedy":
            raise InputError(f"unknown decoding {options.decoding!r} (greedy | eagle)")
        self.token_selector = None        # token selection stage (None: keep every visual token)
        check_keep_ratio(options.token_keep_ratio)
        if options.token_scope not in SCOPES:
            raise InputError(f"token_scope must be one of {SCOPES}, got {options.token_scope!r}")
        if options.token_keep_ratio < 1.0:
            self.token_selector = token_selector or load_token_selector(None, self.lm, options.token_reduce)
            self.token_selector.to(self.device, self.dtype).init_rope(self.arena.max_len)
        self.fastv = None
        if options.fastv_ratio > 0:
            if options.backend != "torch":
                raise InputError("FastV prunes inside the decoder: it needs backend 'torch'")
            if self.eagle is not None:
                raise InputError("FastV and EAGLE-2 decoding are separate ablation rows; choose one")
            self.fastv = FastV(self.lm, self.arena, options.fastv_k, options.fastv_ratio)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, options: PipelineOptions | None = None) -> "Pipeline":
        options = options or PipelineOptions()
        read_config(model_dir)  # fail fast on a bad folder before loading weights
        model = load_model(model_dir, DTYPES[options.dtype])
        draft = None
        if options.decoding == "eagle":
            draft = load_draft_head(Path(options.eagle_dir or Path(model_dir) / "eagle"), model.cfg.llm,
                                    4096, DTYPES[options.dtype])
        selector = None
        if options.token_keep_ratio < 1.0 and options.token_selector != "layer0":
            folder = Path(options.token_selector or Path(model_dir) / "token_selector")
            if options.token_selector is not None or folder.is_dir():
                selector = load_token_selector(folder, model.language_model, options.token_reduce,
                                               DTYPES[options.dtype])
        return cls(model, Tokenizer(model_dir), options, name=Path(model_dir).name, draft=draft,
                   token_selector=selector, model_dir=model_dir)

    # ---------------------------------------------------------------- the query, top to bottom
    @torch.inference_mode()
    def answer(self, images: dict, question: str, max_new_tokens: int | None = None) -> Answer:
        self.check_question(question)
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
            prompt = self.assemble_prompt(cameras, question, visual)   # full prompt, in the arena
            keep = self.select_tokens(prompt)                  # per camera: kept token indices
        with timer("prefill"):
            prompt_len, first_pos, next_id = self.prefill(prompt, keep)
        with timer("decode"):
            decode = self.eagle.decode if self.eagle is not None else self.decode
            out_ids, steps, accepted = decode(next_id, prompt_len, first_pos, max_new)

        input_tokens, kept = self.prefill_counts
        return Answer(
            question=question,
            text=self.tok.decode(out_ids).strip(),
            token_ids=out_ids,
            stage_ms=timer.milliseconds(),
            cameras=list(cameras),
            visual_tokens=len(cameras) * self.tokens_per_camera,
            kept_tokens=kept,
            input_tokens=input_tokens,
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
        if self.view_selector is None:
            return list(self.options.cameras)
        return [c for c in self.view_selector.select(question) if c in self.options.cameras] or list(self.options.cameras)

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

    def assemble_prompt(self, cameras: list[str], question: str, visual: torch.Tensor) -> PromptLayout:
        """Write the full prompt, [template, <img> every visual token </img> per camera, question],
        as ids + embeddings into the arena once: the token selector reads it, prefill gathers the
        kept rows from it. Row index = original position id."""
        a = self.arena
        prompt = self.prompt(cameras, question)
        n = len(prompt.input_ids)
        a.prompt_ids[:n].copy_(torch.tensor(prompt.input_ids, dtype=torch.long))
        embeds = a.prompt_embeds[:n]
        torch.index_select(self.lm.embed.weight, 0, a.prompt_ids[:n], out=embeds)
        for cam_index, (start, count) in enumerate(prompt.image_spans):
            embeds[start:start + count] = visual[cam_index]
        return PromptLayout(n, list(prompt.image_spans), prompt.question_span)

    def select_tokens(self, prompt: PromptLayout) -> list[torch.Tensor]:
        """Per camera, the indices of the visual tokens to keep (ascending)."""
        a = self.arena
        if self.token_selector is None:
            return [a.slots[:count] for _, count in prompt.spans]
        n = prompt.length
        return self.token_selector.select(a.prompt_embeds[:n], a.slots[:n], prompt,
                                          self.options.token_keep_ratio, self.options.token_scope)

    @torch.inference_mode()
    def reference_inputs(self, images: dict, question: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [1, T] with `<IMG_CONTEXT>` placeholders, pixels [tiles, 3, S, S]) of the query
        as this pipeline would see it, for feeding a reference implementation the same inputs."""
        cameras = self.select_views(question)
        ids, _ = self.prompt_ids(cameras, question)
        return torch.tensor([ids]), self.preprocess(images, cameras).clone()

    def prompt_ids(self, cameras: list[str], question: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The full prompt's token ids with `<IMG_CONTEXT>` placeholders, and each camera's (start, count)."""
        prompt = self.prompt(cameras, question)
        return list(prompt.input_ids), list(prompt.image_spans)

    def prompt(self, cameras: list[str], question: str) -> Prompt:
        """The full prompt in this model's layout (prompt.py): ids, camera spans, question span."""
        return build_prompt(self.tok, self.cfg.system_message, self.prompt_layout, cameras, question,
                            self.tokens_per_camera)

    def prefill(self, prompt: PromptLayout, keep: list[torch.Tensor]) -> tuple[int, int, int]:
        """Gather [template, <img> kept visual </img> per camera, question] from the assembled full
        prompt into the arena, run the decoder over it, and return (length, next position, first token).

        Kept visual tokens keep their original position ids: a row's position is its index in the
        full prompt, as if every visual token were present.
        """
        a = self.arena
        rows = a.kept_rows                    # full-prompt row of each prefill row
        n = cursor = 0
        visual_ranges = []                    # (first prefill row, count) of each camera's kept tokens
        for (start, count), k in zip(prompt.spans, keep):
            m = start - cursor
            rows[n:n + m] = a.slots[cursor:start]
            n += m
            rows[n:n + len(k)] = k + start
            visual_ranges.append((n, len(k)))
            n += len(k)
            cursor = start + count
        m = prompt.length - cursor
        rows[n:n + m] = a.slots[cursor:prompt.length]
        n += m
        rows = rows[:n]
        torch.index_select(a.prompt_ids[:prompt.length], 0, rows, out=a.token_ids[:n])
        torch.index_select(a.prompt_embeds[:prompt.length], 0, rows, out=a.embeds[:n])
        a.positions[:n].copy_(rows)
        embeds, positions, slots, mask = a.embeds[:n], a.positions[:n], a.slots[:n], a.causal_mask(n)
        kept = sum(c for _, c in visual_ranges)
        if self.fastv is not None:
            visual_rows = torch.cat([a.slots[s:s + c] for s, c in visual_ranges])
            hidden, fastv_rows, kept = self.fastv.prefill(embeds, positions, slots, mask, visual_rows)
            self.prefill_counts = (len(fastv_rows), kept)     # rows the layers >= K see
        else:
            hidden = self.run_decoder(embeds, positions, slots, mask)
            self.prefill_counts = (n, kept)
        self.prefill_hidden = hidden          # target features of the prompt (EAGLE-2 draft input)
        next_id = self.choose(self.engines.head.run(hidden=hidden[-1:]))
        return n, prompt.length, next_id

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from one row of logits: argmax, or a draw at the configured temperature."""
        if self.options.temperature <= 0:
            return int(logits.argmax(-1))
        probs = torch.softmax(logits[-1].float() / self.options.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.sampler))

    def run_decoder(self, embeds, positions, slots, mask) -> torch.Tensor:
        a = self.arena
        if self.fastv is not None:            # per-layer masks: dropped visual slots hidden from layers >= K
            return self.fastv.run(embeds, positions, slots, mask)
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
            next_id = self.choose(self.engines.head.run(hidden=hidden))
            steps += 1
            slot += 1
            next_pos += 1
        return out, steps, 1.0
