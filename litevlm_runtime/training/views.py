"""`litevlm train views`: train the view selector on DriveLM-format QA, choose its fusion rule, and evaluate it.

    litevlm train views --data QA.json [--data more.json ...] --out DIR
    torchrun --nproc_per_node=N -m litevlm_runtime.cli train views ...   # same command, DDP

Data: DriveLM v1.1 layout `{scene: {key_frames: {frame: {QA: {perception|prediction|planning|
behavior: [{Q, A, ...}]}}}}}` (DriveLM-nuScenes and SynthDrive both use it; several files train
together, e.g. real DriveLM frames and SynthDrive).

Labels (per camera, CAMERAS order; see `camera_labels`): cameras named in object tags
`<cN,CAM_X,x,y>` in the question, the cameras the keyword map is certain of (score 1.0), and
cameras tagged in the answer (by default only when the question itself has a cue). A question
with no camera is labelled "all cameras": from its text alone nothing says which view is enough,
which is exactly the keyword map's no-cue rule. The selector itself only ever sees the question.

Splits are by key frame, three disjoint sets: evaluation frames (`--frames-holdout`, never
trained or tuned on), validation frames (`--val-frames`: `--fusion auto` picks the fusion rule
and its thresholds there, see `tune_fusion`) and training frames. Metrics: `selection_metrics`
(recall over tagged cameras, question recall, cameras kept), the same for every row compared.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ..cameras import CAMERAS
from ..errors import InputError
from ..weights.integrity import write_manifest
from .distributed import setup
from ..stages.view_selector import (
    FUSION_RULES,
    TOKENIZER_FILE,
    Fusion,
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


def frame_spec(text: str) -> float | list[str]:
    """--frames-holdout / --val-frames: a fraction (< 1) or count (>= 1) of frames, or frame tokens."""
    try:
        value = float(text)
    except ValueError:
        tokens = [t.strip() for t in text.split(",") if t.strip()]
        if not tokens:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction, a count or frame tokens") from None
        return tokens
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a frame fraction or count cannot be negative")
    return value


def split_by_frame(records: list[QARecord], holdout: float | list[str], fold: int, seed: int):
    """(kept, held_out, held_out_frames). holdout: frame tokens, a fraction (< 1) or a count (>= 1).

    A number of frames: they are shuffled with `seed` and cut into consecutive blocks of that
    size; `fold` picks the block, so folds 0..k-1 with holdout 1/k are a k-fold cross-validation.
    """
    frames = sorted({(r.source, r.frame) for r in records})
    if isinstance(holdout, list):
        known = {f for _, f in frames}
        missing = [t for t in holdout if t not in known]
        if missing:
            raise InputError(f"frames {', '.join(missing)} are not among the {len(known)} key frames of the data")
        held = {(src, f) for src, f in frames if f in set(holdout)}
        if len(held) == len(frames):
            raise InputError(f"holding out frames {', '.join(holdout)} leaves no frame to train on")
    elif holdout <= 0:
        return records, [], []
    else:
        n_eval = int(holdout) if holdout >= 1 else max(1, round(holdout * len(frames)))
        if n_eval >= len(frames):
            raise InputError(f"holding out {holdout} frames leaves no training frame (the data has {len(frames)} frames)")
        random.Random(seed).shuffle(frames)
        n_folds = len(frames) // n_eval
        if not 0 <= fold < n_folds:
            raise InputError(f"--fold {fold} out of range: {len(frames)} frames in blocks of {n_eval} give folds 0..{n_folds - 1}")
        held = set(frames[fold * n_eval : (fold + 1) * n_eval])
    kept = [r for r in records if (r.source, r.frame) not in held]
    held_out = [r for r in records if (r.source, r.frame) in held]
    return kept, held_out, sorted(f for _, f in held)


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


def selection_metrics(records: list[QARecord], selections: list[list[str]]) -> dict:
    """The metrics every selector is compared by, on the same questions.

    Truth for a question: the cameras tagged `<cN,CAM_X,x,y>` in its question or its answer (the
    selector sees only the question). A question with no tag has no camera truth: it counts in
    the cameras kept (its cost) but not in recall.
    - recall: over every (question, truth camera) pair, the fraction whose camera is kept;
    - question_recall: the fraction of tagged questions whose truth cameras are all kept;
    - mean_cameras_kept: cameras kept per question over all questions (of 6);
    - all_cameras_fraction: the fraction of questions that keep all six.
    """
    if not records:
        raise InputError("evaluate: no questions")
    pairs = recalled = tagged_q = tagged_q_ok = 0
    for r, kept in zip(records, selections, strict=True):
        truth = set(tagged_cameras(r.question)) | set(tagged_cameras(r.answer))
        if truth:
            hits = sum(c in kept for c in truth)
            tagged_q += 1
            pairs += len(truth)
            recalled += hits
            tagged_q_ok += hits == len(truth)
    return {
        "questions": len(records),
        "tagged_questions": tagged_q,
        "recall": recalled / pairs if pairs else float("nan"),
        "question_recall": tagged_q_ok / tagged_q if tagged_q else float("nan"),
        "mean_cameras_kept": sum(len(s) for s in selections) / len(records),
        "all_cameras_fraction": sum(len(s) == len(CAMERAS) for s in selections) / len(records),
    }


def _cues(records: list[QARecord]) -> list[tuple[dict, list[str]]]:
    return [(keyword_map(r.question), tagged_cameras(r.question)) for r in records]


def _selections(cues, probs: torch.Tensor | None, fusion: Fusion) -> list[list[str]]:
    rows = probs.tolist() if probs is not None else [None] * len(cues)
    return [
        fuse(keyword, dict(zip(CAMERAS, p)) if p is not None else None, tagged, fusion).cameras
        for (keyword, tagged), p in zip(cues, rows)
    ]


def evaluate(selector: LoadedViewSelector | None, records: list[QARecord], fusion: Fusion | None = None) -> dict:
    """selection_metrics of a selector under its own fusion (or `fusion`); selector=None is the
    keyword map alone, cut at fusion.threshold (default 0.4)."""
    if not records:
        raise InputError("evaluate: no questions")
    fusion = fusion or (selector.fusion if selector else Fusion())
    probs = selector.module_probs([r.question for r in records]) if selector else None
    return selection_metrics(records, _selections(_cues(records), probs, fusion))


def format_table(rows: dict[str, dict]) -> str:
    width = max([28] + [len(name) for name in rows])
    head = f"{'selector':<{width}} {'questions':>9} {'tagged':>6} {'recall':>7} {'q-recall':>8} {'cams kept':>9} {'all 6':>6}"
    lines = [head, "-" * len(head)]
    for name, m in rows.items():
        lines.append(
            f"{name:<{width}} {m['questions']:>9d} {m['tagged_questions']:>6d} {m['recall']:>7.4f} "
            f"{m['question_recall']:>8.4f} {m['mean_cameras_kept']:>9.3f} {m['all_cameras_fraction']:>6.3f}"
        )
    return "\n".join(lines)


def compare(trained: LoadedViewSelector, untrained: LoadedViewSelector, records: list[QARecord]) -> dict[str, dict]:
    """The selector vs the same architecture at its random initialisation (same fusion) vs the
    keyword map alone (at the selector's keyword threshold, and with only its certain cameras)
    vs all six cameras, on the same questions."""
    thr = trained.fusion.threshold
    return {
        f"selector ({trained.fusion.describe()})": evaluate(trained, records),
        "untrained (same fusion)": evaluate(untrained, records, trained.fusion),
        f"keyword map only (thr {thr:g})": evaluate(None, records, Fusion(threshold=thr)),
        "keyword map, certain cues only": evaluate(None, records, Fusion(threshold=1.0)),
        "all six cameras": selection_metrics(records, [list(CAMERAS)] * len(records)),
    }


# ---------------------------------------------------------------------------------------------
# Choosing the fusion rule on validation frames
# ---------------------------------------------------------------------------------------------

GRID = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.98)
# The module removes a camera only when confident it is not needed: at most a 30% probability.
# (Measured: with higher thresholds even the untrained module, near 0.5 everywhere, removes, and
# a validation frame cannot tell luck from skill there.)
REMOVE_GRID = tuple(t for t in GRID if t <= 0.3)


def fusion_candidates(base: Fusion, rules: tuple[str, ...] = FUSION_RULES) -> list[Fusion]:
    """Every setting tried per rule, the most cautious first (the one that keeps the most
    cameras wins a tie): low thresholds add more and remove less; a high keyword weight leaves
    the module less say."""
    out = []
    for rule in rules:
        if rule == "add":
            out += [replace(base, rule=rule, add_threshold=t) for t in GRID]
        elif rule == "remove":
            out += [replace(base, rule=rule, remove_threshold=t) for t in REMOVE_GRID]
        elif rule == "add_remove":
            out += [replace(base, rule=rule, add_threshold=a, remove_threshold=r) for r in REMOVE_GRID for a in GRID if r < a]
        else:
            out += [replace(base, rule=rule, keyword_weight=w) for w in sorted(GRID, reverse=True)]
    return out


def tune_fusion(records: list[QARecord], probs: torch.Tensor, base: Fusion, rules: tuple[str, ...] = FUSION_RULES,
                tolerance: float = 0.02):
    """(chosen Fusion, {rule: {"fusion", "metrics", "feasible"}}, keyword-map metrics) on validation questions.

    Feasible: recall and question recall at least the keyword map's (at base.threshold) on the
    same questions. Per rule, the most cautious feasible setting within `tolerance` cameras per
    question of that rule's fewest; then, of the rules, the first in FUSION_RULES order within
    `tolerance` of the fewest. Why the tolerance: a validation frame has a few dozen tagged
    questions, and a setting that saves one camera on one of them more than a cautious one is
    noise, not evidence. "add" never loses recall, so some setting is always feasible.
    """
    cues = _cues(records)
    floor = selection_metrics(records, _selections(cues, None, base))
    tried: dict[str, list] = {}
    for fusion in fusion_candidates(base, rules):
        m = selection_metrics(records, _selections(cues, probs, fusion))
        ok = m["recall"] >= floor["recall"] and m["question_recall"] >= floor["question_recall"]
        tried.setdefault(fusion.rule, []).append((fusion, m, ok))

    def pick(rows):  # rows in cautious-first order; the first within tolerance of the fewest cameras
        fewest = min(m["mean_cameras_kept"] for _, m, _ in rows)
        return next(row for row in rows if row[1]["mean_cameras_kept"] <= fewest + tolerance)

    table = {}
    for rule, rows in tried.items():
        feasible = [row for row in rows if row[2]]
        f, m, ok = pick(feasible) if feasible else max(rows, key=lambda row: row[1]["recall"])
        table[rule] = {"fusion": asdict(f), "metrics": m, "feasible": ok}
    best = [(Fusion(**row["fusion"]), row["metrics"], True) for row in table.values() if row["feasible"]]
    chosen = pick(best)[0] if best else base
    return chosen, table, floor


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
    # Three disjoint sets of key frames: evaluation (never trained or tuned on), validation
    # (chooses the fusion rule and its thresholds) and training.
    rest, eval_records, eval_frames = split_by_frame(records, args.frames_holdout, args.fold, args.seed)
    train_records, val_records, val_frames = split_by_frame(rest, args.val_frames, 0, args.seed)
    if args.fusion == "auto" and not val_records:
        raise InputError("train views: --fusion auto chooses the rule on validation frames; give --val-frames or a fixed --fusion")
    # Separate evaluation files (other scenes, another data set) are never trained on.
    extra_eval = load_qa(args.eval_data) if args.eval_data else []
    log(
        f"view selector: {len(records)} questions from {len(args.data)} file(s); training on "
        f"{len(train_records)} ({len({r.frame for r in train_records})} frames), validating on "
        f"{len(val_records)} ({len(val_frames)} frames), evaluating on {len(eval_records)} "
        f"({len(eval_frames)} held-out frames); world size {world}, device {device}"
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
        fusion_rule="add" if args.fusion == "auto" else args.fusion,  # "auto": replaced once validated
        keyword_weight=args.keyword_weight,
        threshold=args.threshold,
        add_threshold=args.add_threshold,
        remove_threshold=args.remove_threshold,
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
        from .vlm import data_provenance

        model.eval()
        tuning = None
        if val_records:
            probs = LoadedViewSelector(model, tokenizer, device).module_probs([r.question for r in val_records])
            rules = FUSION_RULES if args.fusion == "auto" else (args.fusion,)
            chosen, table, floor = tune_fusion(val_records, probs, cfg.fusion(), rules, args.tune_tolerance)
            if args.fusion == "auto":
                cfg.fusion_rule, cfg.keyword_weight = chosen.rule, chosen.keyword_weight
                cfg.add_threshold, cfg.remove_threshold = chosen.add_threshold, chosen.remove_threshold
            tuning = {"keyword map": floor, "rules": table, "chosen": asdict(cfg.fusion()), "tolerance": args.tune_tolerance}
            log(f"\nvalidation ({', '.join(val_frames)}): the best setting of each fusion rule whose recall is at least the keyword map's")
            log(format_table({"keyword map only": floor, **{
                ("* " if rule == cfg.fusion_rule else "  ") + Fusion(**row["fusion"]).describe()
                + ("" if row["feasible"] else " (loses recall)"): row["metrics"] for rule, row in table.items()}}))
        trained = LoadedViewSelector(model, tokenizer, device)
        untrained_model = ViewSelector(cfg)
        untrained_model.load_state_dict(initial_state)
        untrained = LoadedViewSelector(untrained_model, tokenizer, device)
        metrics = {"train": compare(trained, untrained, train_records)}
        if val_records:
            metrics["val"] = compare(trained, untrained, val_records)
        if eval_records:
            metrics["eval"] = compare(trained, untrained, eval_records)
        if extra_eval:
            metrics["eval_data"] = compare(trained, untrained, extra_eval)
        settings = {
            "command": reproduce_command(args),
            "data_files": [str(p) for p in args.data],
            "data": [data_provenance(Path(p)) for p in args.data],  # hashes, and SynthDrive's generator settings
            "frames_holdout": args.frames_holdout,
            "fold": args.fold,
            "eval_frames": eval_frames,
            "val_frames": val_frames,
            "train_frames": len({(r.source, r.frame) for r in train_records}),
            "train_questions": len(train_records),
            "val_questions": len(val_records),
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
            "fusion": args.fusion,
            "fusion_tuning": tuning,
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
                "val": "validation frames " + ", ".join(val_frames),
                "eval": "held-out frames " + ", ".join(eval_frames),
                "eval_data": "--eval-data " + " ".join(str(p) for p in args.eval_data or []),
            }[split]
            log(f"\n{split} ({where}):")
            log(format_table(rows))
        result = metrics
    if world > 1:
        dist.barrier()
    return result


def reproduce_command(args) -> str:
    """The `litevlm train views` command line that repeats this run (every setting spelled out)."""
    parts = ["litevlm", "train", "views"]
    for k, v in vars(args).items():
        if k in ("func", "command", "trainer") or v is None or v is False:
            continue
        for item in v if k in ("data", "eval_data") else [v]:
            if isinstance(item, list):
                item = ",".join(item)
            parts += [f"--{k.replace('_', '-')}", shlex.quote(str(item))]
    return " ".join(parts)


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
    p.add_argument("--frames-holdout", "--holdout-frames", type=frame_spec, default=0.25,
                   help="key frames held out for evaluation, never trained or tuned on: a fraction (<1), a count "
                        "(>=1) or comma-separated frame tokens; 0: none")
    p.add_argument("--val-frames", type=frame_spec, default=0.25,
                   help="of the other key frames, those that choose the fusion rule and thresholds (not trained on): "
                        "a fraction, a count or frame tokens; 0: none (then give a fixed --fusion)")
    p.add_argument("--eval-data", action="append", metavar="QA.json",
                   help="also evaluate on this DriveLM-format file, never trained on (repeatable)")
    p.add_argument("--fold", type=int, default=0, help="which block of held-out frames (k-fold cross-validation)")
    p.add_argument("--answer-tags", choices=ANSWER_TAG_POLICIES, default="cued",
                   help="when cameras tagged only in the answer become labels (see camera_labels)")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-len", type=int, default=160, help="question tokens kept (longer ones are truncated)")
    p.add_argument("--fusion", choices=("auto",) + FUSION_RULES, default="auto",
                   help="how the module and the keyword map combine (see view_selector.Fusion); auto: the rule and "
                        "thresholds with the fewest cameras on the validation frames at no less recall than the keyword map")
    p.add_argument("--tune-tolerance", type=float, default=0.02,
                   help="auto: a setting must save more than this many cameras per validation question to beat a more cautious one")
    p.add_argument("--threshold", type=float, default=0.4,
                   help="keyword map: keep a camera whose keyword score reaches this (weighted: the fused-score threshold)")
    p.add_argument("--keyword-weight", type=float, default=0.4, help="weighted fusion: weight w of the keyword map")
    p.add_argument("--add-threshold", type=float, default=0.5,
                   help="add / add_remove: module probability at which a camera is added (a fixed --fusion; auto tunes it)")
    p.add_argument("--remove-threshold", type=float, default=0.1,
                   help="remove / add_remove: module probability below which an uncertain camera is removed")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--device", help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if not args.out and not args.model:
        raise InputError("train views: give --out DIR or --model DIR (output goes to <model>/view_selector)")
    if args.model and not Path(args.model).is_dir():
        raise InputError(f"train views: --model {args.model} is not a folder")
    for name in ("keyword_weight", "threshold", "add_threshold", "remove_threshold"):
        if not 0 <= getattr(args, name) <= 1:
            raise InputError(f"train views: --{name.replace('_', '-')} must be in [0, 1]")
    if args.threshold == 0:
        raise InputError("train views: --threshold 0 would keep every camera")
    train(args)
    return 0


if __name__ == "__main__":
    from ..cli import main

    sys.exit(main(["train", "views", *sys.argv[1:]]))
