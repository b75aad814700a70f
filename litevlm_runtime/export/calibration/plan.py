"""What one calibration run is to do, stated once and checked before any of it runs.

    plan = CalibrationPlan(model_dir, options, data=Path("qa.json"), out=Path("cal"), precision="fp8",
                           stages=("prefill", "decoder", "decoder_batch"))
    plan = plan.checked()            # InputError naming the flag, or the plan with its defaults resolved
    manifest, report = calibrate(plan)

`litevlm calibrate` builds the plan from its flags and checks it before a model is loaded or a
question answered: a bad --stages, --method or --data is refused in a second, not after minutes
of recorded traffic. Every step of calibration (calibrate.py) reads its settings from the checked
plan. Nothing here imports torch: the command's parser reads the choices below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from ...errors import InputError
from ...options import PipelineOptions

PRECISIONS = ("int8", "fp8", "int4")
METHODS = ("entropy", "max")
# The activation-range method each Q/DQ precision calibrates with unless told (int4 is weight-only:
# no activation ranges).
DEFAULT_METHOD = {"int8": "entropy", "fp8": "max"}
# Stages quantized from recorded traffic. The LM head stays in the export's precision, as
# ModelOpt's LLM PTQ configurations leave `lm_head` unquantized (greedy decoding reads its argmax
# directly); graphs of stages the PyTorch pipeline runs itself (EAGLE draft, view selector) are
# carried over unchanged.
QUANTIZED_STAGES = ("vision", "prefill", "decoder", "decoder_batch")
BAG_SUFFIXES = (".mcap", ".db3")
# A bundle's manifest (engines/bundle.MANIFEST: named here, as importing engines/ would load torch).
MANIFEST = "manifest.json"


def data_kind(data: Path) -> str:
    """"qa" (a DriveLM QA .json) or "bag" (a rosbag2: a folder, .mcap or .db3); InputError else."""
    data = Path(data)
    if data.suffix == ".json":
        return "qa"
    if data.is_dir() or data.suffix in BAG_SUFFIXES:
        return "bag"
    raise InputError(f"--data {data}: expected a DriveLM QA .json or a rosbag2 (folder, .mcap or .db3)", path=data)


@dataclass(frozen=True)
class CalibrationPlan:
    # The model, and the pipeline settings its traffic is recorded with (the backend is replaced:
    # torch for the traffic, onnxruntime for the accuracy of both bundles).
    model_dir: Path
    options: PipelineOptions
    # The questions: a DriveLM QA .json (its images beside it, or under frames_root) or a rosbag2.
    data: Path
    # Where the new bundle goes: out/<name or precision>; the float export is out/fp32 unless `bundle`.
    out: Path | None = None
    frames_root: Path | None = None
    calib_questions: int = 16           # answered to record traffic
    eval_questions: int = 16            # held out (disjoint), answered by both bundles for the accuracy change
    samples_per_graph: int = 16         # recorded calls kept per graph (reservoir sample)
    # What is quantized, and how.
    precision: str = "int8"             # PRECISIONS
    method: str = ""                    # METHODS; "": DEFAULT_METHOD of the precision
    stages: tuple[str, ...] = QUANTIZED_STAGES   # int8/fp8: the stages whose graphs are quantized
    keep_float: str = ""                # a regular expression: weight products whose names it matches stay float
    fp8_decode: bool = False            # fp8: the one-row decode step in FP8 too (ModelOpt leaves GEMVs float)
    quantized: Path | None = None       # int4: weights stored by `litevlm quantize --symmetric` (else ModelOpt AWQ)
    bundle: Path | None = None          # the float export to quantize (default: export one to out/fp32)
    buckets: str = ""                   # that export's buckets (`litevlm export --buckets`), without `bundle`
    name: str = ""                      # the new bundle's folder under out (default: the precision)

    def __post_init__(self):
        # (callers pass lists; the plan keeps a tuple, so that it stays immutable)
        object.__setattr__(self, "stages", tuple(self.stages))

    @property
    def source_bundle(self) -> Path:
        """The float bundle calibrated from."""
        return Path(self.bundle) if self.bundle else Path(self.out) / "fp32"

    @property
    def quant_dir(self) -> Path:
        """The bundle this plan writes."""
        return Path(self.out) / (self.name or self.precision)

    def checked(self) -> CalibrationPlan:
        """This plan with its defaults resolved (method), or InputError naming the flag at fault.
        Reads no model and no question: only the plan and what exists on disk."""
        if self.precision not in PRECISIONS:
            raise InputError(f"--precision {self.precision!r}: one of {', '.join(PRECISIONS)}")
        method = self._method()
        unknown = [s for s in self.stages if s not in QUANTIZED_STAGES]
        if unknown or not self.stages:
            raise InputError(f"--stages {','.join(unknown) or '(none)'}: give some of {', '.join(QUANTIZED_STAGES)}")
        if self.precision == "int4" and self.stages != QUANTIZED_STAGES:
            raise InputError("--stages is for int8/fp8 (int4 quantizes the decoder's weights: every decoder graph)")
        if self.fp8_decode and self.precision != "fp8":
            raise InputError(f"--fp8-decode is for --precision fp8 ({self.precision} quantizes the one-row step "
                             f"already)")
        try:
            re.compile(self.keep_float)
        except re.error as exc:
            raise InputError(f"--keep-float {self.keep_float!r}: not a regular expression ({exc})") from None
        for flag, value, least in (("--calib-questions", self.calib_questions, 1),
                                   ("--eval-questions", self.eval_questions, 0),
                                   ("--samples", self.samples_per_graph, 1)):
            if value < least:
                raise InputError(f"{flag} {value}: at least {least}")
        self._check_paths()
        return replace(self, method=method, data=Path(self.data), out=Path(self.out))

    def _method(self) -> str:
        if self.precision == "int4":
            if self.method:
                raise InputError(f"--method {self.method}: int4 is weight-only (no activation ranges to calibrate)")
            return ""
        method = self.method or DEFAULT_METHOD[self.precision]
        if method not in METHODS:
            raise InputError(f"--method {method!r}: one of {', '.join(METHODS)}")
        return method

    def _check_paths(self) -> None:
        if self.out is None:
            raise InputError("--out is required (the folder the quantized bundle is written to)")
        if not Path(self.data).exists():
            raise InputError(f"--data {self.data}: no such file or folder", path=self.data)
        data_kind(self.data)
        if self.frames_root is not None and not Path(self.frames_root).is_dir():
            raise InputError(f"--frames-root {self.frames_root}: no such folder", path=self.frames_root)
        if self.quantized is not None:
            if self.precision != "int4":
                raise InputError(f"--quantized is for --precision int4 (the stored INT4 weights), not "
                                 f"{self.precision}")
            if not Path(self.quantized).is_dir():
                raise InputError(f"--quantized {self.quantized}: no such folder", path=self.quantized)
        if self.bundle is not None:
            if not (Path(self.bundle) / MANIFEST).is_file():
                raise InputError(f"--bundle {self.bundle}: no {MANIFEST} (not an export bundle; run "
                                 f"`litevlm export` first)", path=self.bundle)
            if self.buckets:
                raise InputError("--buckets is for the export made without --bundle (the bundle has its buckets)")
        if Path(self.name).name != self.name or self.name in (".", ".."):
            raise InputError(f"--name {self.name!r}: a folder name under --out, not a path")
