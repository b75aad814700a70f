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
        """Expand the tree with the draft; `p` is the accepted length (draft scratch starts there)."""
        a, k = self.pipe.arena, self.topk
        embed = self.pipe.lm.embed
        tokens, parents, depths, scores = [root], [-1], [0], [0.0]
        draft_slot: dict[int, int] = {}          # node -> draft scratch slot (expanded nodes only)
        hidden_of: dict[int, torch.Tensor] = {0: h_root[0]}
        logp = self.draft_logprobs(h_root)[0]
        top_lp, top_tok = logp.topk(k)
        frontier = []
        for lp, tok in zip(top_lp.tolist(), top_tok.tolist()):
            tokens.append(tok), parents.append(0), depths.append(1), scores.append(lp)
            frontier.append(len(tokens) - 1)
        next_slot = p
        for level in range(2, self.depth + 1):
            # Run the draft on the frontier: pair (embedding of the node, feature estimate of its parent).
            rows = len(frontier)
            slots = torch.arange(next_slot, next_slot + rows)
            for i, n in enumerate(frontier):
                draft_slot[n] = next_slot + i
            next_slot += rows
            mask = a.mask[:rows, :next_slot]
            mask.fill_(False)
            mask[:, :p] = True
            for i, n in enumerate(frontier):
                m = n
                while m > 0:
                    mask[i, draft_slot[m]] = True
                    m = parents[m]
            emb = embed(torch.tensor([tokens[n] for n in frontier]))
            feats = torch.stack([hidden_of[parents[n]] for n in frontier])
            positions = torch.tensor([root_pos + depths[n] - 1 for n in frontier])
            h = self.run_draft(emb, feats, slots, positions, mask)
            for i, n in enumerate(frontier):
                hidden_of[n] = h[i]
            lp_children, tok_children = self.draft_logprobs(h).topk(k, dim=-1)          # [rows, k]
            cand_scores = torch.tensor([scores[n] for n in frontier])[:, None] + lp_children
            flat = cand_scores.flatten()
            new_nodes = []
            for idx, (sc, tok) in enumerate(zip(flat.tolist(), tok_children.flatten().tolist())):
                parent = frontier[idx // k]
                tokens.append(tok), parents.append(parent), depths.append(level), scores.append(sc)
                new_nodes.append(len(tokens) - 1)
            best = flat.topk(min(k, flat.numel())).indices.tolist()
            frontier = [new_nodes[i] for i in best]
        # Rerank: best `total` nodes by cumulative score; ties go to the shallower node, so a child
        # (score <= its parent's) never enters without its parent: the set is ancestor-closed.
        order = sorted(range(1, len(tokens)), key=lambda n: (-scores[n], depths[n], n))[: self.total]
        keep = sorted(order, key=lambda n: (depths[n], n))           # parents before children
        index = {0: 0}
        for i, n in enumerate(keep):
            index[n] = i + 1
        return DraftTree(
            tokens=[root] + [tokens[n] for n in keep],
            parents=[-1] + [index[parents[n]] for n in keep],
            depths=[0] + [depths[n] for n in keep],
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
            vmask.fill_(False)
            vmask[:, :p] = True
            for i, parent in enumerate(tree.parents):
                if parent >= 0:
                    vmask[i, p:p + t] = vmask[parent, p:p + t]
                vmask[i, p + i] = True
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
