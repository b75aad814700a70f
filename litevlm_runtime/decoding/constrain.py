"""Constrained answers: the answer is exactly one of `choices`, or JSON valid for `answer_schema`.

Decoding masks the logits of every answer position with the tokens a grammar allows next
(xgrammar: a grammar compiled once per constraint against this tokenizer's vocabulary; its
matcher advances token by token and rolls back, which EAGLE-2 verification needs):

    grammar = compile_constraint(rt, choices=["yes", "no"])  # or answer_schema='{"type": "object", ...}'
    c = grammar.start()                                      # one query's matcher
    c.mask(logits [1, V]) -> masked logits ; c.advance(token)          greedy, sampling, batched rows
    c.mask_tree(tokens [T], parents [T], logits [T, V]) -> masked      EAGLE-2: each tree node under its own path

Once the grammar is complete only the tokenizer's end tokens are allowed, so the answer ends there.
Why xgrammar: it is what TensorRT-LLM, vLLM and SGLang use (one engine here and on the car), a
compiled grammar masks a 1k-150k vocabulary in microseconds on the CPU with a bitmask, choices and
JSON schemas are one mechanism, and it installs beside the pinned CPU torch (llguidance and
outlines-core would do too; outlines-core has no rollback, llguidance no torch bitmask helper for
the CPU in the version available).
"""

from __future__ import annotations

import importlib
import json
from functools import lru_cache

import torch

from ..errors import InputError


def _xgrammar():
    """xgrammar, imported on the first constrained query: its import takes seconds (it loads its
    FFI runtime and transformers), which every unconstrained process would otherwise pay."""
    return importlib.import_module("xgrammar")


@lru_cache(maxsize=4)
def _compiler(tokenizer_file: str, vocab_size: int, stop_ids: tuple[int, ...]):
    from transformers import PreTrainedTokenizerFast  # (with xgrammar: see _xgrammar)

    xgr = _xgrammar()

    hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
    return xgr.GrammarCompiler(info, max_threads=1)


def choices_grammar(choices: list[str]) -> str:
    """EBNF: one optional leading space, then exactly one of the choices (the Answer's text is
    stripped)."""
    return 'root ::= " "? (' + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices) + ")"


class ConstraintGrammar:
    """A constraint compiled against one tokenizer's vocabulary: immutable, checked and compiled
    once with the query's request (request.py); each answer decodes under a matcher of its own."""

    def __init__(self, compiled, vocab_size: int, what: str):
        self.compiled, self.vocab_size, self.what = compiled, vocab_size, what

    def start(self) -> "Constraint":
        return Constraint(self.compiled, self.vocab_size, self.what)


class Constraint:
    """One answer's grammar state (a matcher: advances token by token, rolls back)."""

    def __init__(self, compiled, vocab_size: int, what: str):
        self.xgr = xgr = _xgrammar()
        self.what = what
        self.vocab_size = vocab_size
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._tree_bitmask = None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V] -> a float32 copy with every token the grammar forbids next at -inf."""
        out = logits.float().clone()
        if self.matcher.is_terminated():          # ended: nothing the model says may follow
            out.fill_(float("-inf"))
            return out
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self.xgr.apply_token_bitmask_inplace(out, self.bitmask.to(out.device), vocab_size=self.vocab_size)
        return out

    @property
    def complete(self) -> bool:
        """The grammar ended (its end token accepted): the answer is a whole choice / JSON value."""
        return self.matcher.is_terminated()

    def advance(self, token: int) -> None:
        """The answer's next token (chosen under `mask`, so the grammar accepts it)."""
        if not self.matcher.is_terminated() and not self.matcher.accept_token(int(token)):
            raise RuntimeError(f"constraint ({self.what}): token {token} was chosen but the grammar forbids it")

    def advance_all(self, tokens) -> None:
        for t in tokens:
            self.advance(t)

    def mask_tree(self, tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """logits [T, V] of a draft tree (node 0 the root, already accepted) -> float32 copy where
        row i allows what the grammar allows after the path root..i; a node whose own token the
        grammar forbids gets a row of -inf (it can never be on the accepted path)."""
        t = int(tokens.shape[0])
        if self._tree_bitmask is None or self._tree_bitmask.shape[0] < t:
            self._tree_bitmask = self.xgr.allocate_token_bitmask(t, self.vocab_size)
        bits = self._tree_bitmask[:t]
        toks, pars = tokens.tolist(), parents.tolist()
        valid = [True] * t
        for i in range(t):
            path, j = [], i
            while j > 0:
                path.append(toks[j])
                j = pars[j]
            path.reverse()
            accepted = 0
            for tok in path:
                if self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                    valid[i] = False
                    break
                accepted += 1
            if valid[i] and not self.matcher.is_terminated():
                self.matcher.fill_next_token_bitmask(bits, i)
            elif valid[i]:
                valid[i] = False          # its path ended the grammar (a stop token): nothing may follow
            if accepted:
                self.matcher.rollback(accepted)
        out = logits.float().clone()
        self.xgr.apply_token_bitmask_inplace(out, bits.to(out.device), vocab_size=self.vocab_size)
        bad = [i for i, ok in enumerate(valid) if not ok]
        if bad:
            out[bad] = float("-inf")
        return out


def compile_constraint(rt, choices: list[str] | None = None, answer_schema: str = "") -> ConstraintGrammar | None:
    """The compiled constraint of one query, or None without one. A bad schema or choice list is
    an InputError naming it."""
    choices = [c for c in (choices or [])]
    if not choices and not answer_schema:
        return None
    if any(not isinstance(c, str) or not c.strip() for c in choices):
        raise InputError(f"choices: every choice must be a non-empty string, got {choices!r}")
    tok_file = rt.tok.folder / "tokenizer.json"
    if not tok_file.is_file():
        raise InputError(f"constrained answers need a tokenizer.json tokenizer ({rt.tok.folder} has none)")
    vocab = rt.cfg.llm.vocab_size
    compiler = _compiler(str(tok_file), vocab, tuple(sorted(rt.tok.eos_ids)))
    if choices:
        if answer_schema:
            check_choices_fit(compiler, choices, answer_schema)
        return ConstraintGrammar(compiler.compile_grammar(choices_grammar(choices)), vocab, f"choices {choices}")
    try:
        json.loads(answer_schema)
        compiled = compiler.compile_json_schema(answer_schema, any_whitespace=False)   # no runs of blanks
    except (ValueError, RuntimeError) as exc:
        raise InputError(f"answer_schema is not a usable JSON schema: {exc}") from None
    return ConstraintGrammar(compiled, vocab, "answer_schema")


def check_choices_fit(compiler, choices: list[str], schema: str) -> None:
    """With both choices and a schema, every choice must be valid JSON for the schema."""
    xgr = _xgrammar()
    try:
        compiled = compiler.compile_json_schema(schema, any_whitespace=False)
    except (ValueError, RuntimeError) as exc:
        raise InputError(f"answer_schema is not a usable JSON schema: {exc}") from None
    for c in choices:
        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        if not (m.accept_string(c) and m.is_terminated()):
            raise InputError(f"choice {c!r} is not valid for answer_schema")
