"""The result of one query: what the pipeline says and what it cost, stage by stage."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The stages of one query, in execution order. Every Answer reports all of them.
STAGES = ("view_select", "preprocess", "vision", "token_select", "prefill", "decode")


@dataclass
class Answer:
    question: str
    text: str
    token_ids: list[int]
    stage_ms: dict[str, float]          # stage name -> milliseconds, in STAGES order
    cameras: list[str]                  # cameras the view selector kept, rig order
    visual_tokens: int                  # visual tokens produced by the vision encoder
    kept_tokens: int                    # visual tokens left after token selection
    input_tokens: int                   # prompt length fed to prefill (text + kept visual)
    decode_steps: int                   # decoder forward passes after prefill
    accepted_length: float = 1.0        # mean tokens accepted per decode step (EAGLE-2; 1 for greedy)
    pipeline: str = ""                  # which pipeline served: "baseline" or "litevlm[views,tokens@0.8,eagle]"
    reused_cameras: list[str] = field(default_factory=list)   # visual features from an earlier query's frames
    degraded: list[str] = field(default_factory=list)         # what a latency budget cut ("views 3->1", ...)
    budget_ms: float = 0.0              # the latency budget planned for (0: none)
    turn: int = 1                       # its turn in a conversation (1: a first question; follow-ups 2, 3, ...)
    reused_tokens: int = 0              # prompt rows whose KV came from the turn it follows (prefill ran input_tokens after them)
    prompt_sha256: str = ""             # of its prompt's ids (stages/prompt.py prompt_digest; `litevlm prompt` prints it)
    extra: dict = field(default_factory=dict)

    @property
    def budget_met(self) -> bool:
        return not self.budget_ms or self.total_ms <= self.budget_ms

    @property
    def total_ms(self) -> float:
        return sum(self.stage_ms.values())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["total_ms"] = self.total_ms
        d["budget_met"] = self.budget_met
        return d
