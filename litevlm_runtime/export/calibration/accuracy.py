"""The accuracy a quantized bundle gives up, on questions calibration never saw.

Held-out questions (disjoint from the calibration questions) are answered by the unquantized and
the quantized bundle through ONNX Runtime; reported: greedy token agreement with the unquantized
model (the primary measure here, clearly labelled as such) and, where the questions have ground
truth, the DriveLM accuracy of both. `mix_bundles` makes the bundles that measure one stage's
share of the loss (an FP8 bundle with the float vision graphs, say).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...engines.bundle import read_manifest, write_manifest
from ...errors import InputError, LiteVLMError
from ...evaluation.metrics import ACCURACY, Question, derive_tags, score
from ...pipeline.pipeline import Pipeline
from ...weights.integrity import sha256_file
from .traffic import Query


@dataclass
class AccuracyReport:
    questions: int = 0
    identical_answers: int = 0
    token_agreement: float = 0.0            # matching tokens / reference tokens, position by position
    reference_tokens: int = 0
    drivelm: dict = field(default_factory=dict)

    def lines(self, precision: str) -> list[str]:
        out = [f"evaluation on {self.questions} held-out questions (quantized vs unquantized fp32 model, both "
               f"through ONNX Runtime):",
               f"  token agreement with the fp32 model: {self.token_agreement:.4f} "
               f"({self.reference_tokens} fp32 answer tokens, greedy, position by position)",
               f"  answers identical to the fp32 model's: {self.identical_answers}/{self.questions}"]
        if self.drivelm:
            for name, v in self.drivelm.items():
                out.append(f"  DriveLM {name}: fp32 {v['fp32']}  {precision} {v[precision]}  delta {v['delta']}")
        return out


def token_agreement(ref: list[int], got: list[int]) -> int:
    return sum(a == b for a, b in zip(ref, got))


def drivelm_accuracy(queries: list[Query], answers: dict[str, list[str]]) -> dict:
    """DriveLM accuracy (exact match on its multiple-choice / yes-no questions) of each set of
    answers, scored by litevlm_runtime.evaluation; {} when no held-out question is of that kind."""
    picked = [(i, q) for i, q in enumerate(queries) if ACCURACY in derive_tags(q.request.question, q.reference)]
    if not picked:
        return {}
    qs = [Question(q.request.query_id, q.request.query_id, q.request.question, q.reference, (ACCURACY,),
                   "calibration") for _, q in picked]
    return {name: (score(qs, {q.id: texts[i] for (i, _), q in zip(picked, qs)}).accuracy, len(qs))
            for name, texts in answers.items()}


def evaluate(model_dir: Path, options, fp32_bundle: Path, quant_bundle: Path, precision: str,
             queries: list[Query], progress=print) -> AccuracyReport:
    """`queries` answered through ONNX Runtime by the float bundle and the quantized one (a query
    either refuses is left out of both, said)."""
    report = AccuracyReport(questions=0)
    if not queries:
        return report
    on_ort = lambda b: replace(options, backend=replace(options.backend, name="onnxruntime", bundle=str(b)))
    ref = Pipeline.from_pretrained(model_dir, on_ort(fp32_bundle))
    quant = Pipeline.from_pretrained(model_dir, on_ort(quant_bundle))
    texts = {"fp32": [], precision: []}
    answered = []
    agree = 0
    for i, q in enumerate(queries):
        try:
            a, b = ref.answer(q.images, q.request), quant.answer(q.images, q.request)
        except InputError as exc:
            progress(f"  skipped {q.request.query_id}: {exc}")
            continue
        answered.append(q)
        texts["fp32"].append(a.text)
        texts[precision].append(b.text)
        agree += token_agreement(a.token_ids, b.token_ids)
        report.reference_tokens += len(a.token_ids)
        report.identical_answers += int(a.token_ids == b.token_ids)
        report.questions += 1
        progress(f"[evaluate {i + 1}/{len(queries)}] {'same' if a.token_ids == b.token_ids else 'differs'}  "
                 f"{q.request.question[:50]}")
    report.token_agreement = agree / max(1, report.reference_tokens)
    if answered and all(q.reference for q in answered):
        acc = drivelm_accuracy(answered, texts)
        if acc:
            (a32, n), (aq, _) = acc["fp32"], acc[precision]
            report.drivelm = {f"accuracy ({n} multiple-choice/yes-no questions)": {
                "fp32": f"{a32:.4f}", precision: f"{aq:.4f}", "delta": f"{aq - a32:+.4f}"}}
    return report


def mix_bundles(base: Path, donor: Path, stages: tuple[str, ...], out: Path) -> dict:
    """A bundle in `out`: `base`'s graphs, with those of `stages` taken from `donor` (both made from
    the same export: e.g. an FP8 bundle with the float export's vision graphs, to measure what FP8
    vision costs on its own). The manifest says which graph came from where."""
    a, b = read_manifest(base), read_manifest(donor)
    if a["model"].get("checkpoint_sha256") != b["model"].get("checkpoint_sha256") or a["arena"] != b["arena"]:
        raise LiteVLMError(f"{base} and {donor} were not exported from the same checkpoint and arena")
    theirs = {(g["stage"], g["bucket"]): g for g in b["graphs"]}
    out.mkdir(parents=True, exist_ok=True)
    graphs, weights = [], {}
    for g in a["graphs"]:
        src, entry = (donor, theirs[(g["stage"], g["bucket"])]) if g["stage"] in stages else (base, g)
        shutil.copy2(src / entry["file"], out / entry["file"])
        files = [entry["weights"]] if entry.get("weights") else []
        files += [f.name for f in src.glob(entry["file"] + ".data")]
        for f in files:
            shutil.copy2(src / f, out / f)
            weights[f] = sha256_file(out / f)
        graphs.append(dict(entry, source=str(src)))
    precisions = sorted({g.get("precision") or a["dtype"] for g in graphs})
    manifest = dict(a, graphs=graphs, weights=weights, engines={}, precision="+".join(precisions),
                    mixed={"base": str(base), "donor": str(donor), "stages": list(stages)})
    write_manifest(out, manifest)
    return manifest

