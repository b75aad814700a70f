"""EAGLE-2 speculative decoding over the static KV cache, with a tree shape chosen per round from
the device's measured costs (spec_policy.py).

One round: the draft head extends a dynamic tree from the last emitted token (the root): the
top-k children of the k best frontier nodes by cumulative log-probability, level after level; the
best `total` nodes are kept (an ancestor-closed set), and the target decoder verifies them in one
pass under the ancestor mask with depth position ids, written into scratch slots after the
accepted prefix. The longest path whose every token is the target's own choice is accepted, plus
the target's next token (the bonus); the accepted KV rows are copied down into place. With greedy
verification the output is token for token what plain greedy decoding gives, whatever the shape.

The shape policy (spec_policy.py) decides, from warm-up measurements of what a draft level and a
verification of T rows cost on this device and backend, and from running acceptance statistics:
how deep to draft (stop when another level is not expected to pay), how many nodes to verify
(the T that maximises expected tokens per millisecond) and whether to draft at all (a plain
greedy step when no tree is expected to beat it). Greedy steps keep the draft's pending pairs, so
the draft catches up in one call when trees pay again.

Draft cache slot s holds the pair (embedding of x_(s+1), target feature f_s), mirroring the target
cache: slots below the accepted length are real pairs, slots above are tree scratch. Every tensor
lives on the runtime's device; the only host reads per round are the policy's few scalars and
the accepted path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..options import DecodingMode, TreePolicy
from .greedy import Decoded, Prompt, QueryDecoding, choose, step_one
from .spec_policy import TreePolicyState


@dataclass
class DraftTree:
    tokens: torch.Tensor       # [T] long, node 0 = the root (the last emitted token)
    parents: torch.Tensor      # [T] long, -1 for the root; parents come before their children
    depths: torch.Tensor       # [T] long
    scores: torch.Tensor       # [T] float: cumulative draft log-probability (root 0)
    # Sampling mode only: per kept node, the draft distribution q and its i.i.d. samples.
    draft_probs: dict[int, torch.Tensor] | None = None
    samples: dict[int, list[int]] | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def tree_ancestors(parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[T, T] bool: row i marks node i and its ancestors (what node i may attend to in the tree).
    One vectorised update per depth level (parents precede children)."""
    t = parents.shape[0]
    anc = torch.eye(t, dtype=torch.bool, device=parents.device)
    parent = parents.clamp(min=0)
    for d in range(1, max_depth + 1):
        at_d = (depths == d)[:, None]
        anc = torch.where(at_d, anc | anc[parent], anc)
    return anc


def best_nodes(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
               total: int) -> tuple[DraftTree, torch.Tensor]:
    """The root and the best `total` candidate nodes by cumulative score, as a DraftTree (parents
    renumbered), and each candidate's index in it ([N] long, -1: not kept). Candidates are in
    creation order (a node's id is larger than its parent's), node 0 the root. A child's score
    never exceeds its parent's (log-probabilities are <= 0) and a stable sort breaks ties by id,
    parent first: the kept set is ancestor-closed."""
    dev = tokens.device
    order = torch.sort(scores[1:], descending=True, stable=True).indices[:total] + 1
    keep = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), torch.sort(order).values])   # parents first
    index = torch.full((tokens.shape[0],), -1, dtype=torch.long, device=dev)
    index[keep] = torch.arange(len(keep), device=dev)
    kept_parent = torch.where(parents[keep] >= 0, index[parents[keep].clamp(min=0)], parents[keep])
    return DraftTree(tokens=tokens[keep], parents=kept_parent, depths=depths[keep], scores=scores[keep]), index


def accepted_path(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor,
                  target_tokens: torch.Tensor) -> list[int]:
    """Greedy verification: the longest root path whose every node is the target's choice at its
    parent (target_tokens[i] = the target's argmax after node i). Siblings carry distinct tokens,
    so at most one node per depth qualifies and the deepest qualifying node defines the path."""
    correct = tokens == target_tokens[parents.clamp(min=0)]
    correct[0] = True
    on_path = ~(anc & ~correct[None, :]).any(1)                 # every ancestor (and itself) correct
    deepest = int(torch.argmax(torch.where(on_path, depths, -1)))
    path = anc[deepest].nonzero().flatten()
    return path[torch.argsort(depths[path])].tolist()


def speculative_sample(children: dict[tuple[int, int], int], samples: dict[int, list[int]],
                       draft_probs: dict[int, torch.Tensor], target_probs: torch.Tensor,
                       gen: torch.Generator | None) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling over a draft tree (SpecInfer's multi-step rejection
    sampling): at each node with target distribution p, walk the draft's i.i.d. samples from q in
    draw order; accept sample s with probability min(1, r(s)/q(s)), else set the residual
    r <- norm(max(r - q, 0)) and try the next; if none is accepted, draw from r. Every emitted
    token is then distributed exactly as the target's own sampling would give.

    Returns (accepted tree path starting at the root 0, the next token): the next token is the
    accepted sample that has no node in the tree, the residual draw, or a draw from p at a leaf.
    Runs on the CPU (target_probs and q are CPU tensors): a handful of scalar draws per node.
    """
    path = [0]
    while True:
        node = path[-1]
        r = target_probs[node]
        draws = samples.get(node) if samples else None
        if not draws:
            return path, int(torch.multinomial(r, 1, generator=gen))
        q = draft_probs[node]
        for s in draws:
            if float(torch.rand(1, generator=gen, device=r.device)) < float(r[s]) / float(q[s]):      # u < r(s)/q(s)
                child = children.get((node, s))
                if child is None:
                    return path, s
                path.append(child)
                break
            residual = torch.clamp(r - q, min=0)
            total = float(residual.sum())
            if total > 1e-12:        # total == 0 only when r == q, where the draw is always accepted
                r = residual / total
        else:
            return path, int(torch.multinomial(r, 1, generator=gen))


@dataclass
class Progress:
    """Where one answer's EAGLE-2 decoding stands between rounds."""
    root: int                       # the last emitted token: not in the cache yet (the next tree's root)
    length: int                     # target cache rows accepted so far: the root goes to this slot
    position: int                   # the root's RoPE position
    drafted: int                    # draft cache rows done: the pairs of slots [drafted, length) are pending
    pending_embeds: torch.Tensor    # [length - drafted, D] each pending pair's next-token embedding
    pending_features: torch.Tensor  # [length - drafted, D] each pending pair's target feature
    tokens: list[int]               # the answer so far (the root last)
    steps: int = 0                  # target decoder passes
    rounds: list = field(default_factory=list)    # per pass: (depth, tree size, accepted) or "greedy"
    ended: bool = False             # the end token ended the answer


class Eagle2:
    """One answer's EAGLE-2 decoding over the runtime `rt` (arena, engines, draft head), for the
    query whose decoding state is `q` (its KV region, temperature, generator, constraint)."""

    def __init__(self, rt, q: QueryDecoding, policy: TreePolicyState):
        self.rt, self.q, self.a, self.policy = rt, q, rt.arena, policy
        tree = rt.options.decoding.eagle
        self.max_total, self.max_depth, self.topk = tree.total, tree.depth, tree.topk
        self.temperature = q.temperature
        self.gen = q.sampler
        a = self.a
        if self.max_total + 1 > a.limits.tree_tokens or (self.max_depth - 1) * self.topk > a.limits.tree_tokens:
            raise ValueError(f"tree (total {self.max_total}, depth {self.max_depth}, top-k {self.topk}) exceeds "
                             f"the arena's {a.limits.tree_tokens} tree slots")
        self.device = q.region.k.device
        k = self.topk
        self.eye_k = torch.eye(k, dtype=torch.bool, device=self.device)
        self.level_ids = torch.arange(k, device=self.device)

    # ------------------------------------------------------------------ draft
    def draft_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.rt.engines.head.run(hidden).float(), dim=-1)

    def draft_pending(self, s: Progress) -> torch.Tensor:
        """The draft over the pairs of slots [drafted, length) it has not seen (the prompt in round
        one): returns its predicted features [length - drafted, D]; the last row predicts the root's."""
        a, d0, p = self.a, s.drafted, s.length
        rows = p - d0
        return self.rt.engines.draft.step(s.pending_embeds, s.pending_features, a.positions[d0:p], a.slots[d0:p],
                                          a.all_visible(rows, d0), a.causal_mask(rows))

    def build_tree(self, h_root: torch.Tensor, root: int, p: int, root_pos: int, remaining: int) -> DraftTree:
        """Expand the tree level by level while the policy expects the next level to pay; keep
        the nodes the policy chooses. `p` is the accepted length (draft scratch starts there).

        Candidates live in flat tensors in creation order (a node's id is larger than its
        parent's), so reranking and ancestor bookkeeping are a few tensor ops per level."""
        a, k, dev = self.a, self.topk, self.device
        embed = self.rt.lm.embed
        sampling = self.temperature > 0
        q_of: dict[int, torch.Tensor] = {}
        samples_of: dict[int, list[int]] = {}
        lp, child = self.propose(self.draft_logprobs(h_root), [0], q_of, samples_of)
        tok = [torch.tensor([root], device=dev), child[0]]
        score = [torch.zeros(1, device=dev), lp[0]]
        parent = [torch.full((1,), -1, dtype=torch.long, device=dev), torch.zeros(k, dtype=torch.long, device=dev)]
        depth = [torch.zeros(1, dtype=torch.long, device=dev), torch.ones(k, dtype=torch.long, device=dev)]
        count = 1 + k
        # The frontier: nodes to expand next, with their parent's feature estimate and the draft
        # scratch slots of their expanded ancestors.
        f_ids, f_tok, f_score = self.level_ids + 1, child[0], lp[0]
        f_feat = h_root.expand(k, -1)
        scratch = (self.max_depth - 1) * k
        f_anc = torch.zeros(k, scratch, dtype=torch.bool, device=dev)
        max_depth = min(self.max_depth, remaining)
        level = 1
        while level < max_depth and (
            not self.policy.adaptive or self.policy.expand(torch.cat(score[1:]), f_score, level)
        ):
            level += 1
            used = (level - 2) * k                       # scratch slots taken by earlier levels
            f_anc[:, used:used + k] = self.eye_k
            mask_cache = a.all_visible(k, p + used)
            mask_cache[:, p:] = f_anc[:, :used]
            slots = a.slots[p + used:p + used + k]
            positions = a.positions[p + used:p + used + k]
            positions.fill_(root_pos + level - 2)
            t0 = time.perf_counter()
            h = self.rt.engines.draft.step(embed(f_tok), f_feat, positions, slots, mask_cache, self.eye_k)
            lp, child = self.propose(self.draft_logprobs(h), f_ids.tolist() if sampling else None, q_of, samples_of)
            self.policy.observe_draft(k, time.perf_counter() - t0)
            child_score = (f_score[:, None] + lp).flatten()
            tok.append(child.flatten()), score.append(child_score)
            parent.append(f_ids.repeat_interleave(k)), depth.append(torch.full((k * k,), level, device=dev))
            best = child_score.topk(k).indices
            f_ids = count + best
            f_tok, f_score = child.flatten()[best], child_score[best]
            f_feat, f_anc = h[best // k], f_anc[best // k]
            count += k * k
        tok, score, parent, depth = (torch.cat(x) for x in (tok, score, parent, depth))
        # Keep the root and the best `total` nodes by cumulative score (an ancestor-closed set).
        total = self.policy.choose_total(score[1:], self.max_total)
        tree, index = best_nodes(tok, score, parent, depth, total)
        if sampling:
            ids = index.tolist()
            tree.draft_probs = {ids[g]: q for g, q in q_of.items() if ids[g] >= 0}
            tree.samples = {ids[g]: v for g, v in samples_of.items() if ids[g] >= 0}
        return tree

    def propose(self, logprobs: torch.Tensor, node_ids: list[int] | None, q_of: dict, samples_of: dict):
        """Children of each expanded node: (log-prob under the draft, token), each [rows, k].

        Greedy: the top-k tokens. Sampling: k i.i.d. draws from the temperature-scaled draft
        distribution q (what multi-candidate rejection sampling requires); a token drawn twice
        becomes one node, its repeats get score -inf so they are never kept.
        """
        if self.temperature <= 0:
            return logprobs.topk(self.topk, dim=-1)
        q = torch.softmax(logprobs / self.temperature, dim=-1).cpu()
        draws = torch.multinomial(q, self.topk, replacement=True, generator=self.gen)     # [rows, k]
        lp = torch.log(q.gather(1, draws))
        for r, g in enumerate(node_ids):
            q_of[g], samples_of[g] = q[r], draws[r].tolist()
            seen = set()
            for j, t in enumerate(samples_of[g]):
                if t in seen:
                    lp[r, j] = float("-inf")
                seen.add(t)
        return lp.to(self.device), draws.to(self.device)

    # ------------------------------------------------------------------ verify + accept
    def verify(self, tree: DraftTree, p: int, root_pos: int) -> tuple[list[int], int, torch.Tensor]:
        """One target pass over the tree: (accepted path of tree indices from the root, the bonus
        token, the tree's final-norm features)."""
        rt, a = self.rt, self.a
        t = len(tree)
        a.positions[p:p + t] = tree.depths + root_pos
        anc = tree_ancestors(tree.parents, tree.depths, self.max_depth)
        hidden = self.q.region.decoder.step(rt.lm.embed(tree.tokens), a.positions[p:p + t], a.slots[p:p + t],
                                            a.all_visible(t, p), anc)
        logits = rt.engines.head.run(hidden)
        constraint = self.q.constraint
        if constraint is not None:            # each node's row under the grammar state of its own path
            logits = constraint.mask_tree(tree.tokens, tree.parents, logits)
        if self.temperature > 0:
            probs = torch.softmax(logits.float() / self.temperature, dim=-1).cpu()
            tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            children = {(par, tokens[i]): i for i, par in enumerate(parents) if par >= 0}
            path, bonus = speculative_sample(children, tree.samples, tree.draft_probs, probs, self.gen)
        else:
            pred = logits.argmax(-1)
            path = accepted_path(tree.tokens, tree.parents, tree.depths, anc, pred)
            bonus = int(pred[path[-1]])
        if constraint is not None:
            constraint.advance_all(tree.tokens[path[1:]].tolist() + [bonus])
        return path, bonus, hidden

    def accept(self, path: list[int], p: int, root_pos: int) -> None:
        """Copy the accepted rows' KV from their tree slots down into place (src index >= dst)."""
        a, region = self.a, self.q.region
        n = len(path)
        if path != list(range(n)):
            src = torch.tensor(path, device=self.device) + p
            region.k[:, :, p:p + n] = region.k[:, :, src]
            region.v[:, :, p:p + n] = region.v[:, :, src]
        a.positions[p:p + n] = a.slots[:n] + root_pos

    def plain_step(self, s: Progress) -> list[int]:
        """One target step for the root, no tree (the policy expects none to pay): the root enters
        the cache and its pair joins the draft's pending ones. Returns [the next token]."""
        rt, a = self.rt, self.a
        t0 = time.perf_counter()
        hidden = step_one(rt, s.root, s.length, s.position, self.q.region)
        nxt = choose(self.q, rt.engines.head.run(hidden))
        self.policy.observe_step(time.perf_counter() - t0)
        a.token_ids[s.length + 1] = nxt
        s.pending_embeds = torch.cat([s.pending_embeds, rt.lm.embed(a.token_ids[s.length + 1:s.length + 2])])
        s.pending_features = torch.cat([s.pending_features, hidden])
        s.length, s.root, s.position = s.length + 1, nxt, s.position + 1
        s.steps += 1
        s.rounds.append("greedy")
        return [nxt]

    def tree_round(self, s: Progress, remaining: int) -> list[int]:
        """One speculative round: the draft catches up on its pending pairs, grows a tree from the
        root, the target verifies it in one pass, the accepted rows' KV moves into place. Returns
        the accepted tokens and the bonus (the target's own next token), which is the next root."""
        rt, a = self.rt, self.a
        t0 = time.perf_counter()
        draft_features = self.draft_pending(s)
        self.policy.observe_pending(s.length - s.drafted, time.perf_counter() - t0)
        tree = self.build_tree(draft_features[-1:], s.root, s.length, s.position, remaining)
        t1 = time.perf_counter()
        path, bonus, hidden = self.verify(tree, s.length, s.position)
        self.policy.observe_round(tree, len(path) - 1, time.perf_counter() - t1, time.perf_counter() - t0)
        self.accept(path, s.length, s.position)
        s.steps += 1
        s.rounds.append((int(tree.depths.max()), len(tree), len(path) - 1))
        accepted = tree.tokens[path[1:]]
        # The accepted rows (root included) are the draft's next pending pairs; the bonus is the next root.
        s.drafted, s.length = s.length, s.length + len(path)
        a.token_ids[s.drafted + 1:s.length] = accepted
        a.token_ids[s.length] = bonus
        s.pending_embeds = rt.lm.embed(a.token_ids[s.drafted + 1:s.length + 1])
        s.pending_features = hidden[path]
        s.root, s.position = bonus, s.position + len(path)
        return accepted.tolist() + [bonus]

    def decode(self, prompt: Prompt, max_new: int, on_tokens=None, stop=None) -> Decoded:
        """The answer from the prompt: per pass, a tree round or a plain step (the policy's
        choice), its tokens emitted up to the end token or `max_new`. `stop()`, checked after each
        pass, ends the answer early with `Decoded.resume` set (greedy steps carry on from there,
        token for token what speculation would give)."""
        rt, a = self.rt, self.a
        eos = rt.tok.eos_ids
        if prompt.first in eos or max_new <= 0:
            return Decoded([], 0, 1.0)
        p = prompt.length
        a.token_ids[p] = prompt.first
        # Pending draft pairs: each prompt row's next input embedding (visual rows: their visual
        # embedding) with its feature.
        s = Progress(root=prompt.first, length=p, position=prompt.next_pos, drafted=0,
                     pending_embeds=torch.cat([a.embeds[1:p], rt.lm.embed(a.token_ids[p:p + 1])]),
                     pending_features=prompt.hidden, tokens=[prompt.first])
        if on_tokens is not None:
            on_tokens(s.tokens)
        self.policy.start(p)
        while len(s.tokens) < max_new:
            new = self.tree_round(s, max_new - len(s.tokens)) if self.policy.draft_now() else self.plain_step(s)
            emitted = len(s.tokens)
            for token in new:
                if token in eos or len(s.tokens) == max_new:
                    s.ended = token in eos
                    break
                s.tokens.append(token)
            if on_tokens is not None and len(s.tokens) > emitted:
                on_tokens(s.tokens)
            if s.ended or len(s.tokens) >= max_new:
                break
            if stop is not None and stop():
                return Decoded(s.tokens, s.steps, (len(s.tokens) - 1) / s.steps, s.rounds,
                               resume=(s.root, s.length, s.position))
        # Tokens the decode passes produced (after the first, which prefill chose), the EOS that
        # ended the answer included: greedy decoding makes exactly one per pass.
        emitted = len(s.tokens) - 1 + int(s.ended)
        return Decoded(s.tokens, s.steps, emitted / s.steps if s.steps else 1.0, s.rounds)


def speculates(rt) -> bool:
    """EAGLE-2 for this runtime's answers: configured, and (adaptive policy) able to beat a plain
    step on this device by the measured costs; else the answers decode greedily."""

    d = rt.options.decoding
    if d.mode != DecodingMode.EAGLE:
        return False
    return d.eagle.policy == TreePolicy.FIXED or rt.costs.speculate_this_answer(d.eagle.depth)


def eagle2(rt, q: QueryDecoding, prompt: Prompt, max_new: int, on_tokens=None, stop=None) -> Decoded:
    """EAGLE-2 decoding of one answer (greedy-lossless; exact sampling at a temperature)."""
    return Eagle2(rt, q, rt.costs.policy(rt.options.decoding.eagle)).decode(prompt, max_new, on_tokens, stop)
