"""One query as it was asked: built once where it enters, checked once, carried unchanged.

    request = QueryRequest("Is there a truck behind us?", query_id="q7", budget_ms=150.0)
    request = request.checked(rt)            # InputError naming the field, or the checked request
    answer = pipeline.answer(images, request)

Every entry point builds one (the ROS `Query` message: ros/convert.py; `litevlm ask`; `bag eval`;
the fleet; the benchmarks and training, as `QueryRequest(question)`), and every layer after it
(the query server, the pipeline, the batch decoder) reads its fields and passes the object on: a
new per-query field is added here, to Query.msg under the same name, and where it is used (the
message is converted to and from a request field by field: ros/convert.py).

`checked(rt)` is the one validation of a question (blank, length in characters and in tokens,
reserved tokens, sampling ranges, the constraint compiled against the tokenizer, the follow-up
reference and history); it returns a copy that remembers the runtime it was checked for, so that
the pipeline, given a request the server checked, does not check it again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..decoding.constrain import ConstraintGrammar, compile_constraint
from ..errors import InputError
from ..stages.prompt import is_blank
from ..weights.tokenizer import SPECIAL_TOKENS

# A query's own sampling temperature, at most (the range of the decoding.temperature setting).
MAX_TEMPERATURE = 10.0
# Priorities a query may carry (Query.msg): higher is served first; equal ones in arrival order.
PRIORITIES = range(0, 256)
# The metadata of a field the Query message does not carry (ros/convert.py maps the others).
LOCAL = {"message": False}


@dataclass(frozen=True)
class QueryRequest:
    question: str
    query_id: str = ""                  # the caller's id ("" : the query server numbers it q<N>)
    stamp_ns: int = 0                   # when the question was asked (0: when it arrived)
    deadline_ns: int = 0                # answered deadline_passed if still queued then (0: none)
    budget_ms: float = 0.0              # latency budget (0: serving.latency_budget_ms)
    choices: tuple[str, ...] = ()       # constrained answer: exactly one of these ...
    answer_schema: str = ""             # ... or JSON valid for this schema (constrain.py)
    temperature: float = 0.0            # sampling temperature (0: decoding.temperature)
    seed: int = 0                       # its generator's seed (0: decoding.seed)
    follow_up_of: str = ""              # the answered query whose conversation this continues
    priority: int = 0                   # 0-255, higher first (the queue and the batch decoder)
    explain: bool = False               # take what its explanation reads (Answer.trace; pipeline/explanation.py)
    # Frame sets to answer from (0: temporal.frames; 1: the newest only; K: the newest and the K - 1
    # before it, temporal.stride_s apart): the upper bound, the time selector may use fewer (Query.frames;
    # the node's frame store matches each past set by its stamps: serving/frame_store.py).
    frames: int = 0
    # Python callers' only (not in the Query message):
    history: tuple[tuple[str, str], ...] = field(
        default=(), metadata=LOCAL
    )  # earlier (question, answer) turns, oldest first
    max_new_tokens: int = field(default=0, metadata=LOCAL)   # answer cap (0: the configured max_new_tokens)
    keep_turn: bool = field(default=False, metadata=LOCAL)  # keep the answered turn under query_id for follow-ups
    grammar: ConstraintGrammar | None = field(
        default=None, compare=False, repr=False, metadata=LOCAL
    )  # set by checked()
    checked_for: object = field(default=None, compare=False, repr=False, metadata=LOCAL)   # the runtime checked for

    def __post_init__(self):
        # (callers pass lists; the request keeps tuples, so that it stays immutable and comparable)
        object.__setattr__(self, "choices", tuple(self.choices or ()))
        object.__setattr__(self, "history", tuple(tuple(t) if isinstance(t, (list, tuple)) else t
                                                  for t in self.history))

    @classmethod
    def of(cls, request: QueryRequest | str) -> QueryRequest:
        """A request, or the plain request of a question given as text."""
        return request if isinstance(request, QueryRequest) else cls(request)

    def with_id(self, query_id: str, stamp_ns: int) -> QueryRequest:
        """This request as the query server accepted it: its id (numbered when it had none) and
        stamp (the arrival time when it had none); kept for follow-ups under that id."""
        return replace(self, query_id=query_id, stamp_ns=self.stamp_ns or stamp_ns, keep_turn=True)

    def checked(self, rt, max_chars: int = 0) -> QueryRequest:
        """This request checked against runtime `rt`'s rules (and `max_chars`, the server's limit on
        the question's characters; 0: none): InputError whose `about` is "question" or "follow_up"
        and whose message names the field. Checked once: a request already checked for `rt` is
        returned as it is."""
        if self.checked_for is rt:
            return self
        check_question(rt, self.question, max_chars)
        if not math.isfinite(self.budget_ms) or self.budget_ms < 0:
            raise InputError(f"budget_ms {self.budget_ms!r}: must be a finite number >= 0 (0: the node's default)",
                             about="question")
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InputError(f"temperature {self.temperature!r}: must be a finite number from 0 to "
                             f"{MAX_TEMPERATURE:g} (0: the node's decoding.temperature)", about="question")
        if self.seed < 0:
            raise InputError(f"seed {self.seed!r}: must be >= 0 (0: the node's decoding.seed)", about="question")
        if self.max_new_tokens < 0:
            raise InputError(f"max_new_tokens {self.max_new_tokens!r}: must be >= 0 (0: the configured cap)",
                             about="question")
        most = rt.options.temporal.max_frames
        if not isinstance(self.frames, int) or isinstance(self.frames, bool) or not 0 <= self.frames <= most:
            raise InputError(f"frames {self.frames!r}: must be from 1 to temporal.max_frames {most} (0: the "
                             f"node's temporal.frames)", about="question")
        if self.priority not in PRIORITIES:
            raise InputError(f"priority {self.priority!r}: must be from 0 to {PRIORITIES[-1]}", about="question")
        check_history(rt, self)
        if self.follow_up_of:
            rt.conversations.follow(self.follow_up_of)      # InputError(about="follow_up") naming it
        grammar = compile_constraint(rt, list(self.choices), self.answer_schema)
        return replace(self, grammar=grammar, checked_for=rt)


def check_question(rt, question: str, max_chars: int = 0) -> None:
    if not isinstance(question, str) or is_blank(question):
        raise InputError("empty question (only whitespace, invisible, replacement (U+FFFD) or non-characters)",
                         about="question")
    if max_chars and len(question) > max_chars:
        raise InputError(f"question has {len(question)} characters; max_question_chars is {max_chars}",
                         about="question")
    bad = [t for t in SPECIAL_TOKENS if t in question]
    if bad:
        raise InputError(f"question contains reserved token {bad[0]!r}", about="question")
    count = len(rt.tok.encode(question))
    if count > rt.options.max_question_tokens:
        raise InputError(f"question too long: {count} tokens > {rt.options.max_question_tokens}", about="question")


def check_history(rt, request: QueryRequest) -> None:
    """Earlier turns given in one go ((question, answer), oldest first), checked as questions are;
    at most serving.max_turns turns with the new question; not beside follow_up_of (a follow-up's
    history is the turn it follows')."""
    if request.follow_up_of and request.history:
        raise InputError("history and follow_up_of: a follow-up's history is the turn it follows'", about="question")
    if len(request.history) + 1 > rt.options.serving.max_turns:
        raise InputError(f"a conversation of {len(request.history) + 1} turns; serving.max_turns is "
                         f"{rt.options.serving.max_turns}", about="question")
    for turn in request.history:
        if not (isinstance(turn, tuple) and len(turn) == 2):
            raise InputError(f"history turn {turn!r} is not a (question, answer) pair", about="question")
        check_question(rt, turn[0])
        if not isinstance(turn[1], str):
            raise InputError(f"history answer {turn[1]!r} is not text", about="question")
