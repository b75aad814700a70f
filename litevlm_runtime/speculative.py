"""EAGLE-2 speculative decoding over the static KV cache.

One round: the draft head extends a dynamic tree from the last emitted token (top-k children of
the k best nodes by cumulative log-probability, `depth` levels, reranked to `total` nodes); the
target decoder verifies the whole tree in one pass under an ancestor mask with depth position
ids, written into scratch slots after the accepted prefix; the longest path whose every token is
the target's own choice is accepted, plus the target's next token (the bonus); the accepted KV
rows are copied down into place. With greedy verification the output is token for token what
plain greedy decoding gives.

Draft cache slot s holds the pair (embedding of x_(s+1), target feature f_s), mirroring the
target cache: slots below the accepted length are real pairs, slots above are tree scratch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: list[int]        # node 0 is the root (the last emitted token)
    parents: list[int]       # parent index per node (-1 for the root)
    depths: list[int]
    # Sampling mode only: per expanded tree node, the draft distribution q and the i.i.d. samples
    # drawn from it (duplicates kept: the verification walks the samples in draw order).
    draft_probs: dict[int, torch.Tensor] | None = None
    samples: dict[int, list[int]] | None = None


def tree_ancestors(tree: DraftTree) -> torch.Tensor:
    """[T, T] bool: row i marks node i and its ancestors (what node i may attend to in the tree)."""
    t = len(tree.tokens)
    anc = torch.eye(t, dtype=torch.bool)
    parents, depths = torch.tensor(tree.parents), torch.tensor(tree.depths)
    for d in range(1, int(depths.max()) + 1):            # parents are complete before their children
        rows = (depths == d).nonzero().flatten()
        anc[rows] |= anc[parents[rows]]
    return anc


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
            if float(torch.rand(1, generator=gen)) < float(r[s]) / float(q[s]):      # u < r(s)/q(s)
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


class Eagle2Decoder:
    def __init__(self, pipe, draft, total: int = 60, depth: int = 6, topk: int = 10, temperature: float = 0.0,
                 generator: torch.Generator | None = None):
        self.pipe, self.draft = pipe, draft
        self.total, self.depth, self.topk = total, depth, topk
        self.temperature, self.gen = temperature, generator
        a = pipe.arena
        if total + 1 > a.limits.tree_tokens or (depth - 1) * topk > a.limits.tree_tokens:
            raise ValueError(f"tree (total {total}, depth {depth}, top-k {topk}) exceeds the arena's "
                             f"{a.limits.tree_tokens} tree slots")

    # ------------------------------------------------------------------ draft
    def run_draft(self, token_embeds, features, slots, positions, mask):
        a = self.pipe.arena
        return self.draft(token_embeds, features, positions, slots, mask, a.draft_k, a.draft_v)

    def draft_logprobs(self, hidden):
        return torch.log_softmax(self.pipe.engines.head.run(hidden=hidden).float(), dim=-1)

    def build_tree(self, h_root: torch.Tensor, root: int, p: int, root_pos: int) -> DraftTree:
        """Expand the tree with the draft; `p` is the accepted length (draft scratch starts there).

        Candidates live in flat tensors in creation order (a node's id is larger than its
        parent's), so reranking and ancestor bookkeeping are a few tensor ops per level rather
        than Python loops over nodes: on a CPU this loop is the draft's whole overhead.
        """
        a, k = self.pipe.arena, self.topk
        embed = self.pipe.lm.embed
        sampling = self.temperature > 0
        q_of: dict[int, torch.Tensor] = {}
        samples_of: dict[int, list[int]] = {}
        top_lp, top_tok = self.propose(self.draft_logprobs(h_root), torch.zeros(1, dtype=torch.long), q_of, samples_of)
        top_lp, top_tok = top_lp[0], top_tok[0]
        # Candidate arrays (node 0 = root).
        tok = [torch.tensor([root]), top_tok]
        score = [torch.zeros(1), top_lp]
        parent = [torch.tensor([-1]), torch.zeros(k, dtype=torch.long)]
        depth = [torch.zeros(1, dtype=torch.long), torch.ones(k, dtype=torch.long)]
        count = 1 + k
        # The frontier: nodes to expand next, with their parent's feature estimate and the draft
        # scratch slots of their expanded ancestors.
        f_ids = torch.arange(1, 1 + k)
        f_tok, f_score = top_tok, top_lp
        f_feat = h_root.expand(k, -1)
        scratch = (self.depth - 1) * k
        f_anc = torch.zeros(k, scratch, dtype=torch.bool)
        for level in range(2, self.depth + 1):
            used = (level - 2) * k                       # scratch slots taken by earlier levels
            f_anc[:, used:used + k] = torch.eye(k, dtype=torch.bool)
            mask = a.mask[:k, :p + used + k]
            mask[:, :p] = True
            mask[:, p:] = f_anc[:, :used + k]
            slots = a.slots[p + used:p + used + k]
            positions = torch.full((k,), root_pos + level - 2)
            h = self.run_draft(embed(f_tok), f_feat, slots, positions, mask)
            lp, child_tok = self.propose(self.draft_logprobs(h), f_ids, q_of, samples_of)   # [k, k]
            child_score = (f_score[:, None] + lp).flatten()
            tok.append(child_tok.flatten()), score.append(child_score)
            parent.append(f_ids.repeat_interleave(k)), depth.append(torch.full((k * k,), level))
            best = child_score.topk(k).indices
            f_ids = count + best
            f_tok, f_score = child_tok.flatten()[best], child_score[best]
            f_feat, f_anc = h[best // k], f_anc[best // k]
            count += k * k
        tok, score, parent, depth = (torch.cat(x) for x in (tok, score, parent, depth))
        # Rerank: best `total` nodes by cumulative score. A child's score never exceeds its
        # parent's (log-probabilities are <= 0) and a stable sort breaks ties by id, parent first:
        # the kept set is ancestor-closed.
        valid = int(torch.isfinite(score[1:]).sum())          # sampling: duplicate draws are -inf
        order = torch.sort(score[1:], descending=True, stable=True).indices[: min(self.total, valid)] + 1
        keep = torch.sort(order).values                                          # parents first
        index = torch.full((count,), -1, dtype=torch.long)
        index[0] = 0
        index[keep] = torch.arange(1, len(keep) + 1)
        tree = DraftTree(
            tokens=[root] + tok[keep].tolist(),
            parents=[-1] + index[parent[keep]].tolist(),
            depths=[0] + depth[keep].tolist(),
        )
        if sampling:
            tree.draft_probs = {int(index[g]): q for g, q in q_of.items() if index[g] >= 0}
            tree.samples = {int(index[g]): v for g, v in samples_of.items() if index[g] >= 0}
        return tree

    def propose(self, logprobs: torch.Tensor, node_ids: torch.Tensor, q_of: dict, samples_of: dict):
        """Children of each expanded node: (log-prob under the draft, token), each [rows, k].

        Greedy: the top-k tokens. Sampling: k i.i.d. draws from the temperature-scaled draft
        distribution q (what multi-candidate rejection sampling requires); a token drawn twice
        becomes one node, its repeats get score -inf so they are never kept.
        """
        if self.temperature <= 0:
            return logprobs.topk(self.topk, dim=-1)
        q = torch.softmax(logprobs / self.temperature, dim=-1)
        draws = torch.multinomial(q, self.topk, replacement=True, generator=self.gen)     # [rows, k]
        lp = torch.log(q.gather(1, draws))
        for r, g in enumerate(node_ids.tolist()):
            q_of[g], samples_of[g] = q[r], draws[r].tolist()
            seen = set()
            for j, t in enumerate(samples_of[g]):
                if t in seen:
                    lp[r, j] = float("-inf")
                seen.add(t)
        return lp, draws

    # ------------------------------------------------------------------ verify + accept
    def decode(self, root: int, p: int, root_pos: int, max_new: int) -> tuple[list[int], int, float]:
        pipe, a = self.pipe, self.pipe.arena
        eos = pipe.tok.eos_ids
        if root in eos:
            return [], 0, 1.0
        out = [root]
        # Pending draft pairs: the prompt, each row's next input embedding with its feature.
        n = p
        pend_emb = torch.cat([a.embeds[1:n], pipe.lm.embed(torch.tensor([root]))])
        pend_feat = pipe.prefill_hidden
        d0 = 0
        steps = emitted_in_rounds = 0
        while len(out) < max_new:
            rows = p - d0
            mask = a.mask[:rows, :p]
            mask.fill_(True)
            mask[:, d0:].tril_()
            h = self.run_draft(pend_emb, pend_feat, a.slots[d0:p], a.positions[d0:p], mask)
            tree = self.build_tree(h[-1:], root, p, root_pos)

            t = len(tree.tokens)
            ids = torch.tensor(tree.tokens)
            a.positions[p:p + t] = torch.tensor(tree.depths) + root_pos
            vmask = a.mask[:t, :p + t]
            vmask[:, :p] = True
            vmask[:, p:] = tree_ancestors(tree)
            hidden = pipe.run_decoder(pipe.lm.embed(ids), a.positions[p:p + t], a.slots[p:p + t], vmask)
            logits = pipe.engines.head.run(hidden=hidden)
            steps += 1
            children: dict[tuple[int, int], int] = {(par, tree.tokens[i]): i for i, par in enumerate(tree.parents) if par >= 0}
            if self.temperature > 0:
                probs = torch.softmax(logits.float() / self.temperature, dim=-1)
                path, bonus = speculative_sample(children, tree.samples, tree.draft_probs, probs, self.gen)
            else:
                pred = logits.argmax(-1).tolist()
                path = [0]
                while (path[-1], pred[path[-1]]) in children:
                    path.append(children[(path[-1], pred[path[-1]])])
                bonus = pred[path[-1]]
            new_tokens = [tree.tokens[i] for i in path[1:]] + [bonus]

            # Copy the accepted rows' KV from their tree slots down into place (src index >= dst).
            src = torch.tensor(path) + p
            dst = torch.arange(p, p + len(path))
            a.k_cache[:, :, dst] = a.k_cache[:, :, src]
            a.v_cache[:, :, dst] = a.v_cache[:, :, src]
            a.positions[dst] = root_pos + torch.arange(len(path))

            done = False
            for tok in new_tokens:
                if tok in eos or len(out) == max_new:
                    done = True
                    break
                out.append(tok)
                emitted_in_rounds += 1
            if done or len(out) >= max_new:
                break
            d0, p = p, p + len(path)
            pend_emb = pipe.lm.embed(torch.tensor(new_tokens))
            pend_feat = hidden[path]
            root, root_pos = bonus, root_pos + len(path)
        return out, steps, (emitted_in_rounds / steps) if steps else 1.0
