"""`litevlm train tokens`: train the token selector (a copy of the decoder's layer 0) so that its
question->visual attention ranks visual tokens the way the full model uses them.

    litevlm train tokens --model DIR --data QA.json --frames ROOT [--steps 300] [--keep-ratio 0.8]
    torchrun --nproc_per_node=N -m litevlm_runtime.cli train tokens ...   # same command, DDP

Labels (the teacher is the full model, frozen): run it on prompt + reference answer (+ <|im_end|>);
in each layer of the deeper half, take the attention probabilities of the rows that generate the
answer (the last prompt row and every answer row but the last) to the visual columns; average
over those rows, heads and layers. That is how much each visual token feeds the answer. Per
camera, the masses are normalised into a target distribution t_c.

Student: the selector's own score (question rows -> visual columns, mean over heads, max or mean
over question rows, exactly what the pipeline ranks by), normalised per camera into p_c.

Loss: KL(t_c || p_c), averaged over cameras and samples. KL rather than a listwise ranking loss
because the target is itself a distribution (attention mass) and KL to it is the listwise
softmax loss (ListNet) with the teacher's masses as the target; it needs no top-r cut-off, so one
selector serves every keep ratio.

Metric: recall@r, the share of the target's top round(r * count) tokens of each camera that the
selector's top round(r * count) also keeps (random choice scores r), on held-out key frames;
plus, through the real pipeline, how often the answer with keep ratio r is token-for-token the
keep-all answer, and closed-form accuracy, for the untrained (layer-0 copy) and trained selector.

Output: <model>/token_selector/{model.safetensors, config.json} (settings, data hash, metrics).
Visual features are cached per key frame (frames x cameras x tokens x width floats in memory).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..cameras import CAMERAS
from ..errors import InputError
from ..models.decoder import attention_probs
from ..options import options_from_flat
from ..pipeline.pipeline import Pipeline, assemble_prompt, encode, preprocess
from ..stages.token_selector import TokenSelector, kept_count, save_token_selector
from ..weights.checkpoint import load_model
from ..weights.integrity import write_manifest
from ..weights.tokenizer import Tokenizer
from .distributed import Dist, setup, threads_per_rank
from .provenance import data_provenance
from .vlm_data import load_frames


def closed_form(answer: str) -> bool:
    """Answers scored by exact match: a choice letter (A-D) or yes/no."""
    a = answer.strip().rstrip(".").strip("()").lower()
    return a in ("a", "b", "c", "d", "yes", "no")


def same_answer(predicted: str, reference: str) -> bool:
    norm = lambda t: t.strip().rstrip(".").strip("()").strip().lower()  # noqa: E731
    return norm(predicted) == norm(reference)


@dataclass
class Sample:
    frame: int                     # index into the frame list (its cached visual tokens)
    question: str
    answer: str
    length: int = 0                # full prompt length
    question_span: tuple[int, int] = (0, 0)
    spans: list = None             # per camera (first row, count)
    target: torch.Tensor = None    # [V] teacher attention mass on the visual tokens (camera order)


# ---------------------------------------------------------------------------------------------
# Teacher labels
# ---------------------------------------------------------------------------------------------


def visual_rows_of(spans, device=None) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + c, device=device) for s, c in spans])


def answer_attention_to_visual(lm, embeds: torch.Tensor, prompt_len: int, visual_rows: torch.Tensor,
                               layers: range) -> torch.Tensor:
    """Mean attention probability from the answer-generating rows (prompt_len-1 .. T-2) to each
    visual row, over `layers`, heads and rows. embeds: prompt + answer embeddings [T, D]."""
    t = embeds.shape[0]
    rows = torch.arange(prompt_len - 1, t - 1, device=embeds.device)
    total = torch.zeros(visual_rows.numel(), dtype=torch.float32, device=embeds.device)
    allowed = torch.arange(t, device=embeds.device)[None, :] <= rows[:, None]

    def probe(layer, q, k):
        nonlocal total
        if layer in layers:
            probs = attention_probs(q[rows], k, allowed)
            total = total + probs[:, :, visual_rows].mean(dim=(0, 1))

    mask = torch.ones(t, t, dtype=torch.bool, device=embeds.device).tril()
    positions = torch.arange(t, device=embeds.device)
    lm.run_layers(embeds, positions, mask, layers=range(0, layers.stop), probe=probe)
    return total / len(layers)


def per_camera_distribution(mass: torch.Tensor, spans) -> list[torch.Tensor]:
    out, offset = [], 0
    for _, count in spans:
        m = mass[offset:offset + count]
        out.append(m / m.sum().clamp_min(1e-30))
        offset += count
    return out


# ---------------------------------------------------------------------------------------------
# Loss and metric
# ---------------------------------------------------------------------------------------------


class SelectorLoss(nn.Module):
    """Per-camera KL(target || selector) of one sample (the module DDP wraps)."""

    def __init__(self, selector: TokenSelector):
        super().__init__()
        self.selector = selector

    def forward(self, embeds, positions, sample: Sample) -> torch.Tensor:
        rows = visual_rows_of(sample.spans, embeds.device)
        score = self.selector.scores(embeds, positions, sample.question_span, rows)
        loss, offset = 0.0, 0
        for target in per_camera_distribution(sample.target.to(embeds.device), sample.spans):
            s = score[offset:offset + len(target)]
            log_p = torch.log(s.clamp_min(1e-30)) - torch.log(s.sum().clamp_min(1e-30))
            loss = loss + (target * (torch.log(target.clamp_min(1e-30)) - log_p)).sum()
            offset += len(target)
        return loss / len(sample.spans)


def recall_at(score: torch.Tensor, target: torch.Tensor, spans, keep_ratio: float) -> float:
    """Mean over cameras of |top-r(score) & top-r(target)| / |top-r(target)|."""
    hits, offset = [], 0
    for _, count in spans:
        k = kept_count(count, keep_ratio)
        mine = set(score[offset:offset + count].topk(k).indices.tolist())
        theirs = set(target[offset:offset + count].topk(k).indices.tolist())
        hits.append(len(mine & theirs) / k)
        offset += count
    return sum(hits) / len(hits)


# ---------------------------------------------------------------------------------------------
# Data preparation
# ---------------------------------------------------------------------------------------------


class Prepared:
    """Cached visual tokens per frame, prompts and teacher labels per sample."""

    def __init__(self, pipe: Pipeline, frames, samples: list[Sample], max_answer_tokens: int, log):
        self.pipe = pipe
        rt = pipe.rt
        lm = rt.lm
        layers = lm.cfg.num_hidden_layers
        self.teacher_layers = range(layers // 2, layers)      # the deeper half
        needed = sorted({s.frame for s in samples})
        self.visual: dict[int, torch.Tensor] = {}
        t0 = time.monotonic()
        with torch.no_grad():
            for i, f in enumerate(needed):
                pixels = preprocess(rt, frames[f].images, list(CAMERAS))
                self.visual[f] = torch.stack(encode(rt, pixels)).clone()
            log(f"  encoded {len(needed)} frames ({time.monotonic() - t0:.0f} s)")
            t0 = time.monotonic()
            for i, s in enumerate(samples):
                embeds = self.prompt(s)
                answer = rt.tok.encode(s.answer)[:max_answer_tokens] + [rt.tok.im_end_id]
                full = torch.cat([embeds, lm.embed(torch.tensor(answer, device=embeds.device))])
                rows = visual_rows_of(s.spans, embeds.device)
                s.target = answer_attention_to_visual(lm, full, s.length, rows, self.teacher_layers).cpu()
                if (i + 1) % 50 == 0 or i + 1 == len(samples):
                    log(f"  teacher labels {i + 1}/{len(samples)} ({time.monotonic() - t0:.0f} s)")
        self.samples = samples

    def prompt(self, s: Sample) -> torch.Tensor:
        """Full prompt embeddings of a sample (fills its layout fields), a fresh tensor."""
        layout = assemble_prompt(self.pipe.rt, list(CAMERAS), s.question, self.visual[s.frame])
        s.length, s.question_span, s.spans = layout.length, layout.question, layout.spans
        return self.pipe.rt.arena.prompt_embeds[:layout.length].clone()


def evaluate(selector: TokenSelector, data: Prepared, keep_ratio: float) -> dict:
    """Held-out KL loss and recall@r of the selector's ranking against the teacher's."""
    loss_fn = SelectorLoss(selector)
    losses, recalls = [], []
    with torch.no_grad():
        for s in data.samples:
            embeds = data.prompt(s)
            positions = torch.arange(s.length, device=embeds.device)
            losses.append(float(loss_fn(embeds, positions, s)))
            score = selector.scores(embeds, positions, s.question_span, visual_rows_of(s.spans, embeds.device))
            recalls.append(recall_at(score.cpu(), s.target, s.spans, keep_ratio))
    n = max(1, len(losses))
    return {"kl": sum(losses) / n, f"recall@{keep_ratio:g}": sum(recalls) / n, "samples": len(losses)}


@dataclass(frozen=True)
class AgreementRun:
    """How pipeline_agreement's pipelines answer: keep-all, and each selector at keep_ratio."""
    keep_ratio: float
    scope: str                  # tokens.scope
    max_new: int                # max_new_tokens
    device: str


def pipeline_agreement(model, tok_dir: Path, frames, samples: list[Sample], selectors: dict, run: AgreementRun,
                       log) -> dict:
    """Answers through the real pipeline: keep-all vs keep ratio r with each selector.
    Returns per selector: share of questions answered token-for-token as keep-all, and closed-form
    accuracy; plus keep-all's accuracy."""
    keep_ratio, scope, max_new, device = run.keep_ratio, run.scope, run.max_new, run.device
    tok = Tokenizer(tok_dir)
    base = Pipeline.from_model(model, tok, options_from_flat({"pipeline": "baseline", "device": device,
                                                               "max_new_tokens": max_new}))
    reference = [base.answer(frames[s.frame].images, s.question) for s in samples]
    closed = [i for i, s in enumerate(samples) if closed_form(s.answer)]

    def accuracy(answers):
        if not closed:
            return None
        return sum(same_answer(answers[i].text, samples[i].answer) for i in closed) / len(closed)

    out = {"questions": len(samples), "closed_form_questions": len(closed),
           "keep_all": {"accuracy": accuracy(reference), "kept_tokens": reference[0].kept_tokens if reference else 0}}
    for name, sel in selectors.items():
        pipe = Pipeline.from_model(model, tok, options_from_flat({
            "pipeline": "baseline", "device": device, "max_new_tokens": max_new, "tokens.mode": "selector",
            "tokens.keep_ratio": keep_ratio, "tokens.scope": scope}), token_selector=sel)
        answers = [pipe.answer(frames[s.frame].images, s.question) for s in samples]
        same = sum(a.token_ids == r.token_ids for a, r in zip(answers, reference))
        out[name] = {"identical_answers": same / max(1, len(samples)), "accuracy": accuracy(answers),
                     "kept_tokens": answers[0].kept_tokens if answers else 0}
        log(f"  pipeline keep {keep_ratio:g} with the {name} selector: {same}/{len(samples)} answers identical "
            f"to keep-all")
    return out


# ---------------------------------------------------------------------------------------------
# Training (one process, or one of N under torchrun)
# ---------------------------------------------------------------------------------------------


def train(args) -> dict | None:
    d = setup()
    if d.world > 1 and d.device.type == "cpu":
        torch.set_num_threads(threads_per_rank())     # the machine's cores are shared between the ranks
    if args.threads:
        torch.set_num_threads(args.threads)     # on a shared CPU, fewer threads avoid OpenMP spin contention
    try:
        return _train(args, d)
    finally:
        d.close()


def split_samples(frames, args, rng: random.Random, n_val_file: int = 0) -> tuple[list[Sample], list[Sample]]:
    """Training / held-out samples; the split is by key frame (held-out frames are never trained on).
    With --val, the last `n_val_file` frames are that file's and are the held-out set."""
    if n_val_file:
        val_frames = set(range(len(frames) - n_val_file, len(frames)))
    else:
        order = list(range(len(frames)))
        rng.shuffle(order)
        if len(frames) < 2:
            raise InputError("train tokens needs at least 2 key frames (one is held out for evaluation)")
        n_val = min(len(frames) - 1, max(1, int(round(args.holdout * len(frames)))))
        val_frames = set(order[:n_val])

    def samples_of(idx, limit):
        out = [Sample(i, qa.question, qa.answer) for i in idx for qa in frames[i].qa]
        rng.shuffle(out)
        return out[:limit] if limit else out

    train_idx = [i for i in range(len(frames)) if i not in val_frames]
    if args.max_frames:                     # fewer frames, more questions each: less vision encoding
        rng.shuffle(train_idx)
        train_idx = sorted(train_idx[:args.max_frames])
    return samples_of(train_idx, args.max_samples), samples_of(sorted(val_frames), args.eval_samples)


def _train(args, d: Dist) -> dict | None:
    """Teacher labels for this rank's shard, the KL loop, then rank 0 evaluates the untrained and
    trained selectors on held-out frames (and through the pipeline) and writes the selector."""
    t_start = time.monotonic()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    if not 0 < args.keep_ratio < 1:
        raise InputError(f"--keep-ratio must lie in (0, 1), got {args.keep_ratio}")
    frames, train_samples, val_samples = _data(args, rng, d)
    model, pipe, untrained, selector = _teacher_and_selectors(args, d)
    d.log("labels (training shard):")
    mine = train_samples[d.rank::d.world]          # each rank labels and trains on its own shard
    train_data = Prepared(pipe, frames, mine, args.max_answer_tokens, d.log)
    val_data = before = None
    if d.rank == 0:
        d.log("labels (held-out):")
        val_data = Prepared(pipe, frames, val_samples, args.max_answer_tokens, d.log)
        before = evaluate(untrained, val_data, args.keep_ratio)
        d.log(f"untrained (layer-0 copy): held-out KL {before['kl']:.4f}  recall@{args.keep_ratio:g} "
              f"{before[f'recall@{args.keep_ratio:g}']:.4f}")
    history, train_s = _optimize(args, d, selector, train_data, rng)
    if d.rank != 0:
        return None

    selector.eval()
    after = evaluate(selector, val_data, args.keep_ratio)
    key = f"recall@{args.keep_ratio:g}"
    d.log(f"trained: held-out KL {after['kl']:.4f}  {key} {after[key]:.4f}   "
          f"(untrained: KL {before['kl']:.4f}  {key} {before[key]:.4f}; random choice: {args.keep_ratio:g})")
    agreement = None
    if args.eval_questions:
        d.log("pipeline answers on held-out questions:")
        agreement = pipeline_agreement(model, Path(args.model), frames, val_samples[:args.eval_questions],
                                       {"untrained": untrained, "trained": selector},
                                       AgreementRun(args.keep_ratio, args.scope, args.max_new_tokens, str(d.device)),
                                       d.log)
    facts = RunFacts(len(train_samples), len(val_samples), round(train_s, 1), round(time.monotonic() - t_start, 1))
    record = _record(args, d.world, model,
                     {"untrained": before, "trained": after, "random_recall": args.keep_ratio, "pipeline": agreement},
                     history, facts)
    out = Path(args.out) if args.out else Path(args.model) / "token_selector"
    save_token_selector(selector, out, record)
    write_manifest(out)
    d.log(f"wrote {out}")
    if args.json:
        print(json.dumps(record["metrics"], indent=2))
    return record


def _data(args, rng: random.Random, d: Dist) -> tuple[list, list[Sample], list[Sample]]:
    """(key frames, training samples, held-out samples); --val's frames follow --data's."""
    frames = load_frames(args.data, args.frames)
    n_val_file = 0
    if args.val:
        val = load_frames(args.val, args.val_frames or args.frames)
        frames, n_val_file = frames + val, len(val)
    train_samples, val_samples = split_samples(frames, args, rng, n_val_file)
    d.log(f"data: {len(train_samples)} training QA, {len(val_samples)} held-out QA "
          f"({len(frames)} key frames; split by frame); world size {d.world}")
    return frames, train_samples, val_samples


def _teacher_and_selectors(args, d: Dist) -> tuple[torch.nn.Module, Pipeline, TokenSelector, TokenSelector]:
    """The frozen teacher (the full model, through the pipeline that encodes and lays out the
    prompts), the untrained layer-0 copy kept for comparison, and the selector to train (only its
    score parameters trainable)."""
    model = load_model(Path(args.model)).to(d.device)
    model.requires_grad_(False)
    pipe = Pipeline.from_model(model, Tokenizer(Path(args.model)), options_from_flat({
        "pipeline": "baseline", "device": str(d.device), "max_new_tokens": args.max_new_tokens}))
    untrained = TokenSelector.from_decoder(pipe.rt.lm, args.reduce).eval()
    selector = TokenSelector.from_decoder(pipe.rt.lm, args.reduce)
    selector.requires_grad_(False)
    trainable = selector.score_parameters()
    for param in trainable:
        param.requires_grad_(True)
    d.log(f"selector: copy of decoder layer 0 ({sum(p.numel() for p in trainable) / 1e6:.2f} M trainable parameters), "
          f"reduce {args.reduce}; teacher: answer->visual attention of layers "
          f"{model.cfg.llm.num_hidden_layers // 2}..{model.cfg.llm.num_hidden_layers - 1}")
    return model, pipe, untrained, selector


def _optimize(args, d: Dist, selector: TokenSelector, train_data: Prepared, rng: random.Random
              ) -> tuple[list[dict], float]:
    """AdamW with cosine decay to 0 over --steps; each step --batch samples drawn at random (each
    rank its share, from its own shard). Returns (loss history, seconds)."""
    trainable = selector.score_parameters()
    loss_module = d.wrap(SelectorLoss(selector))
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    per_rank = max(1, args.batch // d.world)
    history = []
    window, window_t0, train_t0 = [], time.monotonic(), time.monotonic()
    for step in range(args.steps):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))   # cosine decay to 0
        for g in opt.param_groups:
            g["lr"] = lr
        batch = [train_data.samples[rng.randrange(len(train_data.samples))] for _ in range(per_rank)]
        total = 0.0
        for j, s in enumerate(batch):
            embeds = train_data.prompt(s)
            # Under DDP, gradients are all-reduced once per step (on the last sample's backward) and
            # averaged over ranks: the gradient of the global batch mean.
            last = j == len(batch) - 1
            with loss_module.no_sync() if d.world > 1 and not last else contextlib.nullcontext():
                loss = loss_module(embeds, torch.arange(s.length, device=embeds.device), s) / per_rank
                loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(trainable, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(d.mean(total))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean_step = (time.monotonic() - train_t0) / (step + 1)
            d.log(f"step {step + 1:5d}/{args.steps}  loss {sum(window) / len(window):.4f}  lr {lr:.2e}  "
                  f"{(time.monotonic() - window_t0) / len(window):.2f} s/step  "
                  f"ETA {mean_step * (args.steps - step - 1):.0f} s")
            history.append({"step": step + 1, "loss": sum(window) / len(window)})
            window, window_t0 = [], time.monotonic()
    return history, time.monotonic() - train_t0


@dataclass(frozen=True)
class RunFacts:
    """What a training run counted and timed of itself (its record's figures beside the metrics)."""
    train_samples: int
    held_out_samples: int
    train_seconds: float
    total_seconds: float


def _record(args, world: int, model, metrics: dict, history: list[dict], facts: RunFacts) -> dict:
    """The selector's config.json: the command, settings, data hashes, metrics and loss history."""
    layers = model.cfg.llm.num_hidden_layers
    return {
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "world_size": world, "torch": torch.__version__,
        "model": str(Path(args.model)), "data": data_provenance(args.data),
        "val_data": data_provenance(args.val) if args.val else None,
        "teacher_layers": [layers // 2, layers - 1],
        "loss": "per-camera KL(teacher answer->visual attention || selector question->visual attention)",
        "train_samples": facts.train_samples, "held_out_samples": facts.held_out_samples,
        "metrics": metrics,
        "train_seconds": facts.train_seconds, "total_seconds": facts.total_seconds,
        "history": history,
    }
