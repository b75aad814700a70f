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


def tree_ancestors(tree: DraftTree) -> torch.Tensor:
    """[T, T] bool: row i marks node i and its ancestors (what node i may attend to in the tree)."""
    t = len(tree.tokens)
    anc = torch.eye(t, dtype=torch.bool)
    parents, depths = torch.tensor(tree.parents), torch.tensor(tree.depths)
    for d in range(1, int(depths.max()) + 1):            # parents are complete before their children
        rows = (depths == d).nonzero().flatten()
        anc[rows] |= anc[parents[rows]]
    return anc


class Eagle2Decoder:
    def __init__(self, pipe, draft, total: int = 60, depth: int = 6, topk: int = 10):
        self.pipe, self.draft = pipe, draft
        self.total, self.depth, self.topk = total, depth, topk
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
        top_lp, top_tok = self.draft_logprobs(h_root)[0].topk(k)
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
            lp, child_tok = self.draft_logprobs(h).topk(k, dim=-1)               # [k, k]
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
        order = torch.sort(score[1:], descending=True, stable=True).indices[: self.total] + 1
        keep = torch.sort(order).values                                          # parents first
        index = torch.full((count,), -1, dtype=torch.long)
        index[0] = 0
        index[keep] = torch.arange(1, len(keep) + 1)
        return DraftTree(
            tokens=[root] + tok[keep].tolist(),
            parents=[-1] + index[parent[keep]].tolist(),
            depths=[0] + depth[keep].tolist(),
        )

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
            pred = pipe.engines.head.run(hidden=hidden).argmax(-1).tolist()
            steps += 1

            children: dict[tuple[int, int], int] = {(par, tree.tokens[i]): i for i, par in enumerate(tree.parents) if par >= 0}
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
