"""`litevlm train views`: train the view selector on DriveLM-format QA, and evaluate it.

    litevlm train views --data QA.json [--data more.json ...] --out DIR
    torchrun --nproc_per_node=N -m litevlm_runtime.cli train views ...   # same command, DDP

Data: DriveLM v1.1 layout `{scene: {key_frames: {frame: {QA: {perception|prediction|planning|
behavior: [{Q, A, ...}]}}}}}` (DriveLM-nuScenes and SynthDrive both use it).

Labels (per camera, CAMERAS order; see `camera_labels`): cameras named in object tags
`<cN,CAM_X,x,y>` in the question, the cameras the keyword map is certain of (score 1.0), and
cameras tagged in the answer (by default only when the question itself has a cue). A question
with no camera is labelled "all cameras": from its text alone nothing says which view is enough,
which is exactly the selector's no-cue rule. The selector itself only ever sees the question.

Evaluation splits by key frame (held-out frames are never trained on). Metrics:
- recall: over every (question, camera tagged in its Q or A) pair, the fraction whose camera is
  kept; question recall: the fraction of tagged questions whose tagged cameras are all kept;
- mean cameras kept over all questions (of 6).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ..cameras import CAMERAS
from ..errors import InputError
from ..integrity import write_manifest
from .distributed import setup
from ..view_selector import (
    TOKENIZER_FILE,
    LoadedViewSelector,
    ViewSelector,
    ViewSelectorConfig,
    encode_batch,
    fuse,
    keyword_map,
    load_tokenizer,
    save_view_selector,
    tagged_cameras,
    train_tokenizer,
)

# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


@dataclass
class QARecord:
    source: str      # data file
    scene: str
    frame: str       # key frame token: the unit of the train/eval split
    category: str    # perception | prediction | planning | behavior
    question: str
    answer: str


def load_qa(paths: list[str | Path]) -> list[QARecord]:
    """Every QA pair of the given DriveLM-format files, in file order."""
    records: list[QARecord] = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise InputError(f"{path}: no such QA file")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise InputError(f"{path}: expected a DriveLM object {{scene: {{key_frames: ...}}}}")
        before = len(records)
        for scene, scene_data in data.items():
            frames = scene_data.get("key_frames") if isinstance(scene_data, dict) else None
            if not isinstance(frames, dict):
                raise InputError(f"{path}: scene {scene!r} has no 'key_frames' object (not DriveLM layout)")
            for frame, frame_data in frames.items():
                qa = frame_data.get("QA", {}) if isinstance(frame_data, dict) else None
                if not isinstance(qa, dict):
                    raise InputError(f"{path}: frame {frame!r} has no 'QA' object")
                for category, items in qa.items():
                    for i, item in enumerate(items):
                        q, a = item.get("Q"), item.get("A", "")
                        if not isinstance(q, str) or not q.strip():
                            raise InputError(f"{path}: frame {frame} {category}[{i}] has no question 'Q'")
                        records.append(QARecord(str(path), scene, frame, category, q, a if isinstance(a, str) else ""))
        if len(records) == before:
            raise InputError(f"{path}: no QA pairs found")
    return records


ANSWER_TAG_POLICIES = ("cued", "always", "never")


def camera_labels(record: QARecord, answer_tags: str = "cued") -> list[float]:
    """Training target per camera (1 = the question needs this view).

    Always: cameras tagged in the question and cameras the keyword map is certain of (1.0).
    Cameras tagged only in the answer, by `answer_tags`:
      "cued"   (default) added when the question itself has a cue (a tag or a spatial phrase);
               a question with no cue is labelled all cameras. Why: from "What is the priority
               of the objects?" alone no text says where the objects are; answer tags there
               teach the module where objects happened to be in the training scenes, which
               does not carry over to other scenes (measured: see the README/report).
      "always" always added (the literal "tags in Q and A" labelling).
      "never"  ignored.
    A question left with no camera is labelled all cameras (nothing says which view is enough,
    which is the selector's no-cue rule).
    """
    if answer_tags not in ANSWER_TAG_POLICIES:
        raise InputError(f"answer-tag policy {answer_tags!r}: expected one of {', '.join(ANSWER_TAG_POLICIES)}")
    keyword = keyword_map(record.question)
    question_tags = set(tagged_cameras(record.question))
    needed = question_tags | {c for c, s in keyword.items() if s >= 1.0}
    has_cue = bool(question_tags) or any(s > 0 for s in keyword.values())
    if answer_tags == "always" or (answer_tags == "cued" and has_cue):
        needed |= set(tagged_cameras(record.answer))
    if not needed:
        return [1.0] * len(CAMERAS)
    return [1.0 if c in needed else 0.0 for c in CAMERAS]


def split_by_frame(records: list[QARecord], holdout: float, fold: int, seed: int):
    """(train, eval, eval_frames). holdout < 1: fraction of frames; >= 1: number of frames.

    Frames are shuffled with `seed` and cut into consecutive blocks of the holdout size; `fold`
    picks the block, so folds 0..k-1 with holdout 1/k are a k-fold cross-validation.
    """
    frames = sorted({(r.source, r.frame) for r in records})
    if holdout <= 0:
        return records, [], []
    n_eval = int(holdout) if holdout >= 1 else max(1, round(holdout * len(frames)))
    if n_eval >= len(frames):
        raise InputError(f"--frames-holdout {holdout} leaves no training frame (the data has {len(frames)} frames)")
    random.Random(seed).shuffle(frames)
    n_folds = len(frames) // n_eval
    if not 0 <= fold < n_folds:
        raise InputError(f"--fold {fold} out of range: {len(frames)} frames in blocks of {n_eval} give folds 0..{n_folds - 1}")
    eval_frames = set(frames[fold * n_eval : (fold + 1) * n_eval])
    train = [r for r in records if (r.source, r.frame) not in eval_frames]
    evaluation = [r for r in records if (r.source, r.frame) in eval_frames]
    return train, evaluation, sorted(f for _, f in eval_frames)


class QuestionDataset(Dataset):
    def __init__(self, records: list[QARecord], answer_tags: str = "cued"):
        self.questions = [r.question for r in records]
        self.labels = torch.tensor([camera_labels(r, answer_tags) for r in records], dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.questions)

    def __getitem__(self, i):
        return self.questions[i], self.labels[i]


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


def evaluate(
    selector: LoadedViewSelector | None,
    records: list[QARecord],
    keyword_weight: float | None = None,
    threshold: float | None = None,
) -> dict:
    """Recall of tagged cameras (Q and A tags; the selector sees only Q) and mean cameras kept.

    selector=None evaluates the keyword map alone (tags + spatial phrases, threshold applied to
    the keyword score).
    """
    if not records:
        raise InputError("evaluate: no questions")
    kw_w = keyword_weight if keyword_weight is not None else (selector.cfg.keyword_weight if selector else 0.0)
    thr = threshold if threshold is not None else (selector.cfg.threshold if selector else 0.4)
    probs = selector.module_probs([r.question for r in records]) if selector else None
    pairs = recalled = tagged_q = tagged_q_ok = kept_total = all_kept = 0
    for i, r in enumerate(records):
        module = dict(zip(CAMERAS, probs[i].tolist())) if probs is not None else None
        sel = fuse(keyword_map(r.question), module, tagged_cameras(r.question), kw_w, thr)
        kept_total += len(sel.cameras)
        all_kept += len(sel.cameras) == len(CAMERAS)
        truth = set(tagged_cameras(r.question)) | set(tagged_cameras(r.answer))
        if truth:
            tagged_q += 1
            hits = sum(c in sel.cameras for c in truth)
            pairs += len(truth)
            recalled += hits
            tagged_q_ok += hits == len(truth)
    return {
        "questions": len(records),
        "tagged_questions": tagged_q,
        "recall": recalled / pairs if pairs else float("nan"),
        "question_recall": tagged_q_ok / tagged_q if tagged_q else float("nan"),
        "mean_cameras_kept": kept_total / len(records),
        "all_cameras_fraction": all_kept / len(records),
    }


def format_table(rows: dict[str, dict]) -> str:
    head = f"{'selector':<28} {'questions':>9} {'tagged':>6} {'recall':>7} {'q-recall':>8} {'cams kept':>9} {'all 6':>6}"
    lines = [head, "-" * len(head)]
    for name, m in rows.items():
        lines.append(
            f"{name:<28} {m['questions']:>9d} {m['tagged_questions']:>6d} {m['recall']:>7.4f} "
            f"{m['question_recall']:>8.4f} {m['mean_cameras_kept']:>9.3f} {m['all_cameras_fraction']:>6.3f}"
        )
    return "\n".join(lines)


def compare(trained: LoadedViewSelector, untrained: LoadedViewSelector, records: list[QARecord]) -> dict[str, dict]:
    """Trained vs untrained (same architecture at its random initialisation) vs keyword map only."""
    return {
        "trained (fused)": evaluate(trained, records),
        "untrained (fused)": evaluate(untrained, records),
        f"keyword map only (thr {trained.cfg.threshold:g})": evaluate(None, records, threshold=trained.cfg.threshold),
    }


# ---------------------------------------------------------------------------------------------
# Training (one process, or one of N under torchrun)
# ---------------------------------------------------------------------------------------------


def _tokenizer_for(args, questions: list[str], rank: int, world: int):
    """The selector's tokenizer: given (--tokenizer) or trained on the training questions.

    Rank 0 builds it and broadcasts the JSON so that every rank has the identical vocabulary.
    """
    from tokenizers import Tokenizer

    payload = [None]
    if rank == 0:
        if args.tokenizer:
            path = Path(args.tokenizer)
            tok = load_tokenizer(path / TOKENIZER_FILE if path.is_dir() else path)
        else:
            tok = train_tokenizer(questions)
        payload = [tok.to_str()]
    if world > 1:
        dist.broadcast_object_list(payload, src=0)
    return Tokenizer.from_str(payload[0])


def train(args) -> dict | None:
    # The selector is tiny: intra-op threads gain little, and on a busy CPU OpenMP spin-waiting
    # makes them far slower (measured on a loaded 2-core machine: 2 s vs 35 s per epoch).
    torch.set_num_threads(args.threads)
    d = setup(args.device)
    rank, world, device = d.rank, d.world, d.device
    try:
        return _train(args, rank, world, device, d.log)
    finally:
        d.close()


def _train(args, rank: int, world: int, device: torch.device, log) -> dict | None:
    out_dir = Path(args.out) if args.out else Path(args.model) / "view_selector"
    records = load_qa(args.data)
    train_records, eval_records, eval_frames = split_by_frame(records, args.frames_holdout, args.fold, args.seed)
    # Separate evaluation files (other scenes, another data set) are never trained on.
    extra_eval = load_qa(args.eval_data) if args.eval_data else []
    log(
        f"view selector: {len(records)} questions from {len(args.data)} file(s); training on "
        f"{len(train_records)} ({len({r.frame for r in train_records})} frames), evaluating on "
        f"{len(eval_records)} ({len(eval_frames)} held-out frames); world size {world}, device {device}"
    )

    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts them)
    tokenizer = _tokenizer_for(args, [r.question for r in train_records], rank, world)
    cfg = ViewSelectorConfig(
        vocab_size=tokenizer.get_vocab_size(),
        width=args.width,
        layers=args.layers,
        heads=args.heads,
        ffn=args.width * 2,
        max_len=args.max_len,
        keyword_weight=args.keyword_weight,
        threshold=args.threshold,
    )
    model = ViewSelector(cfg).to(device)
    initial_state = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) if world > 1 else model

    dataset = QuestionDataset(train_records, args.answer_tags)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed) if world > 1 else None
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        generator=torch.Generator().manual_seed(args.seed),
        collate_fn=lambda batch: ([q for q, _ in batch], torch.stack([y for _, y in batch])),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(loader)
    warmup = max(1, total_steps // 20)
    # Linear warm-up then cosine decay: the usual schedule for a small transformer from scratch.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps)),
    )

    start = time.monotonic()
    history = []
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        ddp_model.train()
        loss_sum = torch.zeros(2, device=device)  # (sum of per-question losses, questions)
        for questions, labels in loader:
            ids, pad = encode_batch(tokenizer, questions, cfg.max_len)
            logits = ddp_model(ids.to(device), pad.to(device))
            # Per-camera BCE summed over cameras, averaged over questions.
            loss = F.binary_cross_entropy_with_logits(logits, labels.to(device), reduction="none").sum(-1).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            loss_sum += torch.stack([loss.detach() * len(questions), torch.tensor(float(len(questions)), device=device)])
        if world > 1:
            dist.all_reduce(loss_sum)
        epoch_loss = (loss_sum[0] / loss_sum[1]).item()
        history.append(round(epoch_loss, 5))
        if epoch == 0 or (epoch + 1) % max(1, args.epochs // 10) == 0 or epoch + 1 == args.epochs:
            log(f"  epoch {epoch + 1:>3}/{args.epochs}  loss {epoch_loss:.4f}  lr {schedule.get_last_lr()[0]:.2e}  {time.monotonic() - start:.1f}s")

    result = None
    if rank == 0:
        trained = LoadedViewSelector(model, tokenizer, device)
        untrained_model = ViewSelector(cfg)
        untrained_model.load_state_dict(initial_state)
        untrained = LoadedViewSelector(untrained_model, tokenizer, device)
        metrics = {"train": compare(trained, untrained, train_records)}
        if eval_records:
            metrics["eval"] = compare(trained, untrained, eval_records)
        if extra_eval:
            metrics["eval_data"] = compare(trained, untrained, extra_eval)
        settings = {
            "data_files": [str(p) for p in args.data],
            "frames_holdout": args.frames_holdout,
            "fold": args.fold,
            "eval_frames": eval_frames,
            "train_questions": len(train_records),
            "eval_questions": len(eval_records),
            "eval_data_files": [str(p) for p in args.eval_data or []],
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "seed": args.seed,
            "world_size": world,
            "labels": "tags in Q + keyword cameras with score 1.0 + tags in A (policy answer_tags); none -> all cameras",
            "answer_tags": args.answer_tags,
            "loss_history": history,
            "train_seconds": round(time.monotonic() - start, 2),
            "tokenizer_source": args.tokenizer or "trained on the training questions",
        }
        save_view_selector(out_dir, model, tokenizer, {"training": settings, "metrics": metrics})
        write_manifest(out_dir)
        log(f"wrote {out_dir}/ (config.json, model.safetensors, tokenizer.json)")
        for split, rows in metrics.items():
            where = {
                "train": "training frames",
                "eval": "held-out frames " + ", ".join(eval_frames),
                "eval_data": "--eval-data " + " ".join(str(p) for p in args.eval_data or []),
            }[split]
            log(f"\n{split} ({where}):")
            log(format_table(rows))
        result = metrics
    if world > 1:
        dist.barrier()
    return result


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "views",
        help="train the view selector on DriveLM-format QA (runs under torchrun for DDP)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data", action="append", required=True, metavar="QA.json", help="DriveLM-format QA file (repeatable)")
    p.add_argument("--out", help="output folder (default: <--model>/view_selector)")
    p.add_argument("--model", help="VLM folder; the selector is written beside it in <model>/view_selector")
    p.add_argument("--tokenizer", help="tokenizer.json (or a folder holding one) to use instead of training one")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames-holdout", type=float, default=0.25,
                   help="key frames held out for evaluation: a fraction (<1) or a count (>=1); 0 trains on all")
    p.add_argument("--eval-data", action="append", metavar="QA.json",
                   help="also evaluate on this DriveLM-format file, never trained on (repeatable)")
    p.add_argument("--fold", type=int, default=0, help="which block of held-out frames (k-fold cross-validation)")
    p.add_argument("--answer-tags", choices=ANSWER_TAG_POLICIES, default="cued",
                   help="when cameras tagged only in the answer become labels (see camera_labels)")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-len", type=int, default=160, help="question tokens kept (longer ones are truncated)")
    p.add_argument("--keyword-weight", type=float, default=0.4, help="fusion weight w of the keyword map")
    p.add_argument("--threshold", type=float, default=0.4, help="fused-score threshold for keeping a camera")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--device", help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if not args.out and not args.model:
        raise InputError("train views: give --out DIR or --model DIR (output goes to <model>/view_selector)")
    if args.model and not Path(args.model).is_dir():
        raise InputError(f"train views: --model {args.model} is not a folder")
    if not 0 <= args.keyword_weight <= 1 or not 0 < args.threshold <= 1:
        raise InputError("train views: --keyword-weight must be in [0, 1] and --threshold in (0, 1]")
    train(args)
    return 0


if __name__ == "__main__":
    from ..cli import main

    sys.exit(main(["train", "views", *sys.argv[1:]]))
