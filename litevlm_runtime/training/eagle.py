"""`litevlm train eagle`: distill an EAGLE-2 draft head from the target model.

Data: the target's own greedy answers to the training questions (what the draft will be asked to
predict at run time), with the target's features over prompt + answer. Loss per position whose
next token is text: SmoothL1 between the draft's predicted feature and the target's next feature
(weight 1.0) + soft cross-entropy between the LM head on the prediction and on the target feature
(weight 0.1); uniform noise on the input features, as EAGLE trains. Metric: mean accepted length
(tokens per target pass) on held-out questions, untrained vs trained.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..decoding.greedy import greedy
from ..decoding.speculative import eagle2
from ..evaluation.data import frame_images, load_frames
from ..models.eagle import DraftHead
from ..options import options_from_flat
from ..pipeline.pipeline import Pipeline
from ..weights.checkpoint import load_model
from ..weights.draft_head import save_draft_head
from ..weights.integrity import write_manifest
from ..weights.tokenizer import Tokenizer
from .distributed import Dist, setup


@dataclass
class Sequence:
    embeds: torch.Tensor       # [L, D] input embeddings (visual spliced), prompt + answer
    features: torch.Tensor     # [L, D] target final-norm hidden states
    positions: torch.Tensor    # [L]
    text_next: torch.Tensor    # [L-1] bool: the next token (t+1) is text, so position t is trained


def load_samples(data: list[Path], frames_root: Path, limit: int | None, seed: int):
    """(images, question) pairs from DriveLM-format QA files."""

    pairs = []
    for path in data:
        for frame in load_frames(path):
            images = frame_images(frames_root, frame)
            pairs += [(images, q.question) for q in frame.questions]
    random.Random(seed).shuffle(pairs)
    return pairs[:limit] if limit else pairs


@torch.inference_mode()
def collect(pipe, pairs, progress=None) -> list[Sequence]:
    """Run the target greedily on each pair; keep its features over prompt + its own answer."""
    seqs = []
    for i, (images, question) in enumerate(pairs):
        imgs = {c: Path(p).read_bytes() if isinstance(p, (str, Path)) else p for c, p in images.items()}
        ans = pipe.answer(imgs, question, decoder=greedy)
        n = ans.input_tokens
        rt = pipe.rt
        a = rt.arena
        answer_ids = torch.tensor(ans.token_ids + [rt.tok.im_end_id], dtype=torch.long)
        embeds = torch.cat([a.embeds[:n], rt.lm.embed(answer_ids)])
        last = int(a.positions[n - 1])
        positions = torch.cat([a.positions[:n], last + 1 + torch.arange(len(answer_ids))])
        L = embeds.shape[0]
        hidden, _, _ = rt.lm(embeds, positions, torch.ones(L, L, dtype=torch.bool).tril())
        ids = torch.cat([a.token_ids[:n], answer_ids])
        text_next = ids[1:] != rt.tok.img_context_id
        seqs.append(Sequence(embeds.clone(), hidden.clone(), positions.clone(), text_next))
        if progress:
            progress(i + 1, len(pairs))
    return seqs


def draft_loss(draft, head, seq: Sequence, noise: float, gen: torch.Generator | None = None):
    L = seq.embeds.shape[0]
    feats = seq.features[:-1]
    if noise:
        feats = feats + (torch.rand(feats.shape, generator=gen) - 0.5) * 2 * noise
    pred, _, _ = draft(seq.embeds[1:], feats, seq.positions[:-1], torch.ones(L - 1, L - 1, dtype=torch.bool).tril())
    m = seq.text_next
    target = seq.features[1:][m]
    p = pred[m]
    feat_loss = F.smooth_l1_loss(p, target)
    with torch.no_grad():
        target_prob = torch.softmax(head(target), dim=-1)
    ce = -(target_prob * torch.log_softmax(head(p), dim=-1)).sum(-1).mean()
    return feat_loss + 0.1 * ce, feat_loss.detach(), ce.detach()


def mean_accepted_length(pipe, pairs) -> float:
    """Tokens per target pass after the first token, over `pairs`, decoding with EAGLE-2 (the
    configured fixed tree: the metric is the draft's, not the shape policy's)."""
    tokens = steps = 0
    for images, question in pairs:
        ans = pipe.answer(images, question, decoder=eagle2)
        tokens += max(len(ans.token_ids) - 1, 0)
        steps += ans.decode_steps
    return tokens / steps if steps else 1.0


@dataclass(frozen=True)
class EagleTraining:
    """How the draft head is distilled (`litevlm train eagle`'s flags)."""
    samples: int | None = 400           # training questions drawn (None: every one of the data)
    holdout: int = 20                   # questions held out for the acceptance metric
    epochs: int = 4
    lr: float = 1e-3
    noise: float = 0.05                 # on the target's features the draft learns from (draft_loss)
    seed: int = 0
    max_new_tokens: int = 48            # the target's answers, whose features the draft learns
    threads: int | None = None          # backend.threads (None: the default)
    tree: tuple[int, int, int] = (60, 6, 10)    # total, depth, topk of the draft tree for the held-out metric


def _pipeline_with_draft(model_dir: Path, settings: EagleTraining, tree: dict[str, int]) -> tuple[Pipeline, DraftHead]:
    """The target's baseline pipeline (every camera and token), with EAGLE-2 over a new draft
    head in the fixed `tree` for the acceptance metric; and that draft head, to be trained."""
    opts = options_from_flat({"pipeline": "baseline", "max_new_tokens": settings.max_new_tokens,
                              "backend.threads": settings.threads or 0,
                              "decoding.mode": "eagle", "decoding.eagle.policy": "fixed",
                              "decoding.eagle.total": tree["total"], "decoding.eagle.depth": tree["depth"],
                              "decoding.eagle.topk": tree["topk"]})
    model = load_model(model_dir)
    draft = DraftHead(model.cfg.llm)
    # Start the draft's layer from the target's last layer: same shapes, a better start than random.
    src = model.language_model.layers[-1].state_dict()
    draft.layer.load_state_dict({k: v for k, v in src.items() if k in draft.layer.state_dict()})
    return Pipeline.from_model(model, Tokenizer(model_dir), opts, draft=draft), draft


def _distill(draft: DraftHead, target_lm, seqs: list[Sequence], settings: EagleTraining, d: Dist, log,
             t0: float) -> None:
    """Train `draft` on the target's features `seqs` (draft_loss; AdamW, warm-up then cosine
    decay), the target `target_lm` frozen; `t0`: when training began (the log's elapsed time)."""
    epochs = settings.epochs
    for p in target_lm.parameters():
        p.requires_grad_(False)
    wrapped = d.wrap(draft.train())
    forward = wrapped if d.world == 1 else _DDPForward(wrapped)
    opt = torch.optim.AdamW(draft.parameters(), lr=settings.lr, weight_decay=0.0)
    total_steps = max(1, epochs * len(seqs))
    warmup = min(20, total_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))
    gen = torch.Generator().manual_seed(settings.seed + d.rank)
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(len(seqs), generator=gen).tolist()
        sums = [0.0, 0.0, 0.0]
        for j, i in enumerate(order):
            loss, feat_loss, ce = draft_loss(forward, target_lm.head, seqs[i], settings.noise, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            sums = [a + float(b) for a, b in zip(sums, (loss, feat_loss, ce))]
            if (j + 1) % 50 == 0 or j + 1 == len(order):
                k = (j % 50) + 1
                log(f"epoch {epoch + 1}/{epochs} step {step}/{total_steps} loss {sums[0] / k:.4f} "
                    f"(feature {sums[1] / k:.4f}, ce {sums[2] / k:.4f}) elapsed {time.time() - t0:.0f}s")
                sums = [0.0, 0.0, 0.0]


def train_eagle(model_dir: Path, data: list[Path], frames_root: Path, out: Path | None = None,
                settings: EagleTraining = EagleTraining(), log=print) -> dict:
    samples, holdout, epochs, lr, noise, seed = (settings.samples, settings.holdout, settings.epochs, settings.lr,
                                                 settings.noise, settings.seed)
    tree = dict(zip(("total", "depth", "topk"), settings.tree))
    d = setup("cpu")                   # the target and draft run on the CPU pipeline here
    torch.manual_seed(seed)
    pipe, draft = _pipeline_with_draft(model_dir, settings, tree)

    pairs = load_samples(data, frames_root, (samples + holdout) if samples else None, seed)
    pairs = [({c: Path(p).read_bytes() for c, p in im.items()}, q) for im, q in pairs]
    held, train_pairs = pairs[:holdout], pairs[holdout:]
    t0 = time.time()
    # Every rank takes the same number of steps (DDP's all-reduce pairs them up one to one).
    mine = d.shard(train_pairs[: len(train_pairs) - len(train_pairs) % d.world])
    log(f"[rank {d.rank}] collecting target features for {len(mine)} questions ...")
    seqs = collect(pipe, mine, progress=lambda i, n: log(f"  features {i}/{n}") if i % 25 == 0 or i == n else None)
    # Tensors made under inference_mode cannot enter autograd: take ordinary copies.
    seqs = [Sequence(*(t.clone() for t in (s.embeds, s.features, s.positions, s.text_next))) for s in seqs]

    untrained = mean_accepted_length(pipe, held) if d.main else float("nan")
    _distill(draft, pipe.rt.lm, seqs, settings, d, log, t0)
    draft.eval()
    trained = mean_accepted_length(pipe, held) if d.main else float("nan")
    record = {
        "command": " ".join(sys.argv), "data": [str(p) for p in data], "frames": str(frames_root),
        "samples": len(train_pairs), "holdout": holdout, "epochs": epochs, "lr": lr, "noise": noise,
        "seed": seed, "world_size": d.world, "loss_weights": {"feature_smooth_l1": 1.0, "soft_ce": 0.1},
        "tree": tree, "metrics": {"mean_accepted_length_untrained": untrained,
                                  "mean_accepted_length_trained": trained},
        "train_seconds": round(time.time() - t0, 1),
    }
    if d.main:
        out = Path(out or Path(model_dir) / "eagle")
        save_draft_head(draft, out, record)
        write_manifest(out)
        log(
            f"mean accepted length on {len(held)} held-out questions: untrained {untrained:.2f} -> "
            f"trained {trained:.2f}"
        )
        log(f"wrote {out}")
    d.close()
    return record


class _DDPForward:
    """Calls the draft through DDP's forward (so gradients sync) while exposing the draft's config."""

    def __init__(self, ddp):
        self.ddp, self.cfg = ddp, ddp.module.cfg

    def __call__(self, *args):
        return self.ddp(*args)
