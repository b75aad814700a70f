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

Camera x time: where the data has motion questions (items with "frames" K > 1, SynthDrive in motion),
the selector gets a time head (`--max-past-frames`, default the data's longest K - 1) trained with
cross-entropy on each question's past frame sets (K - 1; 0 for every other question), and its
fusion with the time cue (time_keyword_weight, time_threshold) is chosen on the validation frames
(`tune_time`); `evaluation.views.time_metrics` reports the share of motion questions given past
frame sets and of the others given none.

Splits are by key frame, three disjoint sets: evaluation frames (`--frames-holdout`, never
trained or tuned on), validation frames (`--val-frames`: `--fusion auto` picks the fusion rule
and its thresholds there, see `tune_fusion`) and training frames. Metrics: `selection_metrics`
(recall over tagged cameras, question recall, cameras kept), the same for every row compared.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from ..cameras import CAMERAS
from ..errors import InputError
from ..evaluation.views import (
    QARecord,
    compare,
    compare_time,
    cues_of,
    format_table,
    format_time_table,
    load_qa,
    selection_metrics,
    selections_of,
    time_choices,
    time_metrics,
)
from ..options import ANSWER_TAG_POLICIES
from ..stages.view_selector import (
    FUSION_RULES,
    TOKENIZER_FILE,
    Fusion,
    LoadedViewSelector,
    ViewSelector,
    ViewSelectorConfig,
    encode_batch,
    keyword_map,
    load_tokenizer,
    save_view_selector,
    tagged_cameras,
    train_tokenizer,
)
from ..weights.integrity import write_manifest
from .distributed import Dist, setup
from .provenance import data_provenance, reproduce_command

# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


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
            raise InputError(f"holding out {holdout} frames leaves no training frame "
                             f"(the data has {len(frames)} frames)")
        random.Random(seed).shuffle(frames)
        n_folds = len(frames) // n_eval
        if not 0 <= fold < n_folds:
            raise InputError(f"--fold {fold} out of range: {len(frames)} frames in blocks of {n_eval} "
                             f"give folds 0..{n_folds - 1}")
        held = set(frames[fold * n_eval : (fold + 1) * n_eval])
    kept = [r for r in records if (r.source, r.frame) not in held]
    held_out = [r for r in records if (r.source, r.frame) in held]
    return kept, held_out, sorted(f for _, f in held)


NO_TIME_LABEL = -100      # cross_entropy's ignore_index: a question whose file says nothing about time


def time_labels(records: list[QARecord], max_past_frames: int) -> list[int]:
    """Past frame sets each question needs: its item's frames - 1 (at most the head's range), for
    files in motion (some item carries "frames" > 1); none for the others: a single-frame file
    (real DriveLM, SynthDrive without --frames) asks "Is X moving?" without saying what it needs,
    and labelling that "no past frames" would teach the head the opposite of the motion files."""
    timed = {r.source for r in records if r.frames > 1}
    return [min(r.frames - 1, max_past_frames) if r.source in timed else NO_TIME_LABEL for r in records]


class QuestionDataset(Dataset):
    def __init__(self, records: list[QARecord], answer_tags: str = "cued", max_past_frames: int = 0):
        self.questions = [r.question for r in records]
        self.labels = torch.tensor([camera_labels(r, answer_tags) for r in records], dtype=torch.float32)
        self.past = torch.tensor(time_labels(records, max_past_frames), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.questions)

    def __getitem__(self, i):
        return self.questions[i], self.labels[i], self.past[i]


# ---------------------------------------------------------------------------------------------
# Choosing the fusion rule on validation frames
# ---------------------------------------------------------------------------------------------

GRID = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95,
        0.98)
# The module removes a camera only when confident it is not needed: at most a 30% probability.
# (Measured: with higher thresholds even the untrained module, near 0.5 everywhere, removes, and
# a validation frame cannot tell luck from skill there.)
REMOVE_GRID = tuple(t for t in GRID if t <= 0.3)


def in_motion(records: list[QARecord]) -> list[QARecord]:
    """The questions of files in motion (some item carries "frames" > 1): where time is labelled."""
    timed = {r.source for r in records if r.frames > 1}
    return [r for r in records if r.source in timed]


TIME_WEIGHTS = (0.0, 0.2, 0.4, 0.6)
TIME_THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7)


def tune_time(records: list[QARecord], probs: torch.Tensor) -> tuple[float, float, dict]:
    """(time_keyword_weight, time_threshold, their metrics) on validation questions: the setting
    that gives past frame sets to the most motion questions plus none to the most static ones
    (the first of equals in grid order: the cue weighed least, the threshold lowest)."""
    best = None
    for w in TIME_WEIGHTS:
        for t in TIME_THRESHOLDS:
            m = time_metrics(records, time_choices(records, probs, w, t))
            value = sum(v for v in (m["motion_with_past"], m["static_without_past"]) if v == v)  # (nan: none)
            if best is None or value > best[0] + 1e-12:
                best = (value, w, t, m)
    return best[1], best[2], best[3]


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
            out += [replace(base, rule=rule, add_threshold=a, remove_threshold=r)
                    for r in REMOVE_GRID for a in GRID if r < a]
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
    cues = cues_of(records)
    floor = selection_metrics(records, selections_of(cues, None, base))
    tried: dict[str, list] = {}
    for fusion in fusion_candidates(base, rules):
        m = selection_metrics(records, selections_of(cues, probs, fusion))
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
    try:
        return _train(args, d)
    finally:
        d.close()


@dataclass
class _Splits:
    """Three disjoint sets of key frames: training, validation (chooses the fusion rule and its
    thresholds) and evaluation (never trained or tuned on); plus --eval-data (other scenes)."""
    train: list[QARecord]
    val: list[QARecord]
    val_frames: list[str]
    eval: list[QARecord]
    eval_frames: list[str]
    extra_eval: list[QARecord]       # --eval-data files: never trained on


def _train(args, d: Dist) -> dict | None:
    """Data splits, tokenizer, model; the epochs; then rank 0 tunes the fusion rule on the
    validation frames, compares trained and untrained selectors, and writes the selector."""
    splits = _split_data(args, d)
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts them)
    tokenizer = _tokenizer_for(args, [r.question for r in splits.train], d.rank, d.world)
    cfg = _model_config(args, tokenizer.get_vocab_size(), _max_past_frames(args, splits.train))
    model = ViewSelector(cfg).to(d.device)
    initial_state = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
    start = time.monotonic()
    history = _train_epochs(args, d, model, tokenizer, cfg.max_len, splits.train, start)
    result = None
    if d.rank == 0:
        model.eval()
        tuning = _tune_on_validation(args, model, tokenizer, cfg, splits, d)
        if cfg.max_past_frames and in_motion(splits.val):
            val = in_motion(splits.val)
            probs = LoadedViewSelector(model, tokenizer, d.device).all_probs([r.question for r in val])[1]
            cfg.time_keyword_weight, cfg.time_threshold, chosen = tune_time(val, probs)
            d.log(f"time selection chosen on the validation frames: time cue weight {cfg.time_keyword_weight:g}, "
                  f"threshold {cfg.time_threshold:g}: {chosen}")
            if tuning is not None:
                tuning["time"] = {"time_keyword_weight": cfg.time_keyword_weight,
                                  "time_threshold": cfg.time_threshold, "metrics": chosen}
        untrained_model = ViewSelector(cfg)
        untrained_model.load_state_dict(initial_state)
        metrics = _compare(LoadedViewSelector(model, tokenizer, d.device),
                           LoadedViewSelector(untrained_model, tokenizer, d.device), splits)
        settings = _settings(args, splits, d.world, tuning, history, start)
        out_dir = Path(args.out) if args.out else Path(args.model) / "view_selector"
        save_view_selector(out_dir, model, tokenizer, {"training": settings, "metrics": metrics})
        write_manifest(out_dir)
        d.log(f"wrote {out_dir}/ (config.json, model.safetensors, tokenizer.json)")
        _report(args, metrics, splits, d.log)
        result = metrics
    if d.world > 1:
        dist.barrier()
    return result


def _split_data(args, d: Dist) -> _Splits:
    records = load_qa(args.data)
    rest, eval_records, eval_frames = split_by_frame(records, args.frames_holdout, args.fold, args.seed)
    train_records, val_records, val_frames = split_by_frame(rest, args.val_frames, 0, args.seed)
    if args.fusion == "auto" and not val_records:
        raise InputError("train views: --fusion auto chooses the rule on validation frames; "
                         "give --val-frames or a fixed --fusion")
    extra_eval = load_qa(args.eval_data) if args.eval_data else []
    d.log(
        f"view selector: {len(records)} questions from {len(args.data)} file(s); training on "
        f"{len(train_records)} ({len({r.frame for r in train_records})} frames), validating on "
        f"{len(val_records)} ({len(val_frames)} frames), evaluating on {len(eval_records)} "
        f"({len(eval_frames)} held-out frames); world size {d.world}, device {d.device}"
    )
    return _Splits(train_records, val_records, val_frames, eval_records, eval_frames, extra_eval)


def _max_past_frames(args, records: list[QARecord]) -> int:
    """--max-past-frames, else the training data's longest motion question's K - 1 (0: no time head)."""
    if args.max_past_frames is not None:
        return args.max_past_frames
    return max((r.frames - 1 for r in records), default=0)


def _model_config(args, vocab_size: int, max_past_frames: int = 0) -> ViewSelectorConfig:
    return ViewSelectorConfig(
        max_past_frames=max_past_frames,
        vocab_size=vocab_size,
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


def _train_epochs(args, d: Dist, model: ViewSelector, tokenizer, max_len: int, records: list[QARecord],
                  start: float) -> list[float]:
    """AdamW with linear warm-up then cosine decay (the usual schedule for a small transformer
    from scratch) on the per-camera BCE; every rank its shard under torchrun. Returns the mean
    loss of each epoch."""
    device = d.device
    ddp_model = d.wrap(model)
    dataset = QuestionDataset(records, args.answer_tags, model.cfg.max_past_frames)
    sampler = DistributedSampler(dataset, num_replicas=d.world, rank=d.rank, shuffle=True, seed=args.seed) \
        if d.world > 1 else None
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        generator=torch.Generator().manual_seed(args.seed),
        collate_fn=lambda batch: ([q for q, _, _ in batch], torch.stack([y for _, y, _ in batch]),
                                  torch.stack([t for _, _, t in batch])),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total_steps = args.epochs * len(loader)
    warmup = max(1, total_steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5
                                                 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps)))
    history = []
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        ddp_model.train()
        loss_sum = torch.zeros(2, device=device)  # (sum of per-question losses, questions)
        for questions, labels, past in loader:
            ids, pad = encode_batch(tokenizer, questions, max_len)
            logits, time_logits = ddp_model(ids.to(device), pad.to(device), with_time=True)
            # Per-camera BCE summed over cameras, averaged over questions; with a time head, plus the
            # cross-entropy of the past frame sets each question needs.
            loss = F.binary_cross_entropy_with_logits(logits, labels.to(device), reduction="none").sum(-1).mean()
            if time_logits is not None and bool((past != NO_TIME_LABEL).any()):
                loss = loss + args.time_weight * F.cross_entropy(time_logits, past.to(device),
                                                                 ignore_index=NO_TIME_LABEL)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            loss_sum += torch.stack([loss.detach() * len(questions),
                                     torch.tensor(float(len(questions)), device=device)])
        if d.world > 1:
            dist.all_reduce(loss_sum)
        epoch_loss = (loss_sum[0] / loss_sum[1]).item()
        history.append(round(epoch_loss, 5))
        if epoch == 0 or (epoch + 1) % max(1, args.epochs // 10) == 0 or epoch + 1 == args.epochs:
            d.log(f"  epoch {epoch + 1:>3}/{args.epochs}  loss {epoch_loss:.4f}  lr {schedule.get_last_lr()[0]:.2e}  "
                  f"{time.monotonic() - start:.1f}s")
    return history


def _tune_on_validation(args, model: ViewSelector, tokenizer, cfg: ViewSelectorConfig, splits: _Splits,
                        d: Dist) -> dict | None:
    """With validation frames: the best setting of each fusion rule (tune_fusion); --fusion auto
    writes the chosen one into cfg. Returns the tuning record (None without validation frames)."""
    if not splits.val:
        return None
    probs = LoadedViewSelector(model, tokenizer, d.device).module_probs([r.question for r in splits.val])
    rules = FUSION_RULES if args.fusion == "auto" else (args.fusion,)
    chosen, table, floor = tune_fusion(splits.val, probs, cfg.fusion(), rules, args.tune_tolerance)
    if args.fusion == "auto":
        cfg.fusion_rule, cfg.keyword_weight = chosen.rule, chosen.keyword_weight
        cfg.add_threshold, cfg.remove_threshold = chosen.add_threshold, chosen.remove_threshold
    d.log(f"\nvalidation ({', '.join(splits.val_frames)}): the best setting of each fusion rule whose recall is "
          f"at least the keyword map's")
    d.log(format_table({"keyword map only": floor, **{
        ("* " if rule == cfg.fusion_rule else "  ") + Fusion(**row["fusion"]).describe()
        + ("" if row["feasible"] else " (loses recall)"): row["metrics"] for rule, row in table.items()}}))
    return {"keyword map": floor, "rules": table, "chosen": asdict(cfg.fusion()), "tolerance": args.tune_tolerance}


def _compare(trained: LoadedViewSelector, untrained: LoadedViewSelector, splits: _Splits) -> dict:
    """Trained vs untrained (same fusion) vs the keyword map, on each split there is; with motion
    questions there, the time selection too (under "time", by split)."""
    metrics = {"train": compare(trained, untrained, splits.train)}
    if splits.val:
        metrics["val"] = compare(trained, untrained, splits.val)
    if splits.eval:
        metrics["eval"] = compare(trained, untrained, splits.eval)
    if splits.extra_eval:
        metrics["eval_data"] = compare(trained, untrained, splits.extra_eval)
    records = {"train": splits.train, "val": splits.val, "eval": splits.eval, "eval_data": splits.extra_eval}
    timed = {split: compare_time(trained, in_motion(records[split])) for split in metrics
             if in_motion(records[split])}
    if timed:
        metrics["time"] = timed
    return metrics


def _settings(args, splits: _Splits, world: int, tuning: dict | None, history: list[float], start: float) -> dict:
    """The training record written into the selector's config.json."""
    return {
        "command": reproduce_command(args, "views", repeated=("data", "eval_data")),
        "data_files": [str(p) for p in args.data],
        "data": [data_provenance(Path(p)) for p in args.data],  # hashes, and SynthDrive's generator settings
        "frames_holdout": args.frames_holdout,
        "fold": args.fold,
        "eval_frames": splits.eval_frames,
        "val_frames": splits.val_frames,
        "train_frames": len({(r.source, r.frame) for r in splits.train}),
        "train_questions": len(splits.train),
        "val_questions": len(splits.val),
        "eval_questions": len(splits.eval),
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


def _report(args, metrics: dict, splits: _Splits, log) -> None:
    for split, rows in metrics.get("time", {}).items():
        log(f"\ncamera x time, {split}:")
        log(format_time_table(rows))
    for split, rows in metrics.items():
        if split == "time":
            continue
        where = {
            "train": "training frames",
            "val": "validation frames " + ", ".join(splits.val_frames),
            "eval": "held-out frames " + ", ".join(splits.eval_frames),
            "eval_data": "--eval-data " + " ".join(str(p) for p in args.eval_data or []),
        }[split]
        log(f"\n{split} ({where}):")
        log(format_table(rows))
