"""The memory arena: every buffer a query touches, allocated once at start-up from configured maxima.

Stages read and write slices of these tensors; nothing per query is allocated here afterwards, so
buffer addresses are stable (what CUDA-graph capture and TensorRT tensor binding need). Model
intermediates inside a stage come from the framework's allocator (on a GPU, the graph's pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.config import ModelConfig
from ..models.kv_cache import QuantizedKV, kv_zeros


@dataclass(frozen=True)
class Limits:
    cameras: int = 6
    tiles_per_camera: int = 1
    frames: int = 1               # frame sets in one prompt, at most (temporal.max_frames): sizes its visual rows
    text_tokens: int = 512        # template + camera labels + question
    new_tokens: int = 64          # answer length
    tree_tokens: int = 64         # EAGLE-2 draft tree verified in one pass (scratch slots)
    draft_layers: int = 0         # EAGLE-2 draft head's own KV cache (0: no draft)
    cached_cameras: int = 0       # visual features kept for later queries (feature_cache.py)
    batch: int = 1                # queries decoded together (serving.max_batch): one KV region each
    conversations: int = 0        # answered turns kept for follow-up questions: one KV region each (conversation.py)
    prefix_rows: int = 0  # the prompt prefix every query shares, its KV kept (prefix.py; 0: not kept)
    kv_dtype: str = "float"  # the KV cache's elements: float (the pipeline's dtype) | int8 | fp8 (models/kv_cache.py)

    def max_tiles(self) -> int:
        """Tiles of one frame set: what one call of the vision stage takes (pixels, visual)."""
        return self.cameras * self.tiles_per_camera


class Arena:
    @staticmethod
    def max_len_for(cfg: ModelConfig, limits: Limits) -> int:
        """Cache length: the longest prompt (every frame set's visual tokens), the answer, and the
        draft tree's scratch slots."""
        return (limits.max_tiles() * limits.frames * cfg.tokens_per_tile + limits.text_tokens + limits.new_tokens
                + limits.tree_tokens)

    def __init__(self, cfg: ModelConfig, limits: Limits, dtype: torch.dtype, device: torch.device):
        self.limits = limits
        s, d, llm = cfg.force_image_size, cfg.llm.hidden_size, cfg.llm
        tiles = limits.max_tiles()
        self.max_visual = tiles * limits.frames * cfg.tokens_per_tile   # a K-frame prompt's, every token kept
        self.max_prompt = self.max_visual + limits.text_tokens
        self.max_len = self.max_len_for(cfg, limits)
        self.max_query = max(self.max_prompt, limits.tree_tokens)
        kv_shape = (llm.num_hidden_layers, llm.num_key_value_heads, self.max_len, llm.head_dim)
        alloc = dict(device=device)
        self.pixels_u8 = torch.zeros(tiles, 3, s, s, dtype=torch.uint8, **alloc)
        self.pixels = torch.zeros(tiles, 3, s, s, dtype=dtype, **alloc)
        self.visual = torch.zeros(tiles, cfg.tokens_per_tile, d, dtype=dtype, **alloc)
        self.token_ids = torch.zeros(self.max_len, dtype=torch.long, **alloc)
        self.embeds = torch.zeros(self.max_prompt, d, dtype=dtype, **alloc)
        # The full prompt (every visual token present) the token selector reads; prefill gathers the
        # kept rows from it into token_ids/embeds/positions (kept_rows: their full-prompt indices).
        self.prompt_ids = torch.zeros(self.max_prompt, dtype=torch.long, **alloc)
        self.prompt_embeds = torch.zeros(self.max_prompt, d, dtype=dtype, **alloc)
        self.kept_rows = torch.zeros(self.max_prompt, dtype=torch.long, **alloc)
        # FastV: which cache slots layers >= K may see, and the masks of those layers.
        self.slot_visible = torch.ones(self.max_len, dtype=torch.bool, **alloc)
        self.positions = torch.zeros(self.max_len, dtype=torch.long, **alloc)
        self.slots = torch.arange(self.max_len, dtype=torch.long, **alloc)
        # A call's two masks (engines/base.py): old cache columns, and this call's own rows.
        self.mask_cache = torch.zeros(self.max_query, self.max_len, dtype=torch.bool, **alloc)
        self.mask_new = torch.zeros(self.max_query, self.max_query, dtype=torch.bool, **alloc)
        self.layer_mask = torch.zeros(self.max_query, self.max_len, dtype=torch.bool, **alloc)
        # One KV region per query of a batch (batching.py), [batch, layers, kv_heads, max_len,
        # head_dim]; region 0 is the cache every single-query stage and engine uses (k_cache).
        # With limits.kv_dtype int8/fp8 every cache below but the draft's is a QuantizedKV (codes and
        # a scale per head and row; models/kv_cache.py), indexed like the float tensor.
        kv = lambda shape: kv_zeros(shape, limits.kv_dtype, dtype, device)  # noqa: E731
        self.k_regions = kv((limits.batch, *kv_shape))
        self.v_regions = kv((limits.batch, *kv_shape))
        self.k_cache = self.k_regions[0]
        self.v_cache = self.v_regions[0]
        # Follow-up questions (conversation.py): the KV rows of recently answered turns, copied out of
        # the region that decoded them, and back into the region of the follow-up that continues one.
        self.k_turns = kv((limits.conversations, *kv_shape))
        self.v_turns = kv((limits.conversations, *kv_shape))
        # A batched decode step's rows (one per region): token, position, slot in its region, the
        # region columns it sees, and the identity mask of its own new row.
        self.batch_tokens = torch.zeros(limits.batch, dtype=torch.long, **alloc)
        self.batch_positions = torch.zeros(limits.batch, dtype=torch.long, **alloc)
        self.batch_slots = torch.zeros(limits.batch, dtype=torch.long, **alloc)
        self.batch_mask = torch.zeros(limits.batch, self.max_len, dtype=torch.bool, **alloc)
        self.batch_eye = torch.eye(limits.batch, dtype=torch.bool, **alloc)
        self.logits = torch.zeros(limits.tree_tokens, llm.vocab_size, dtype=dtype, **alloc)
        # Visual reuse: one camera frame's visual tokens per slot (tiles per camera x tokens per tile);
        # also the window of a K-frame query's views (runtime.arena_limits: at least max_frames x cameras).
        self.feature_cache = torch.zeros(limits.cached_cameras, limits.tiles_per_camera * cfg.tokens_per_tile, d,
                                         dtype=dtype, **alloc)
        # The shared prompt prefix (prefix.py): its KV rows and final-norm features, computed once.
        prefix_shape = (llm.num_hidden_layers, llm.num_key_value_heads, limits.prefix_rows, llm.head_dim)
        self.prefix_k = kv(prefix_shape)
        self.prefix_v = kv(prefix_shape)
        self.prefix_hidden = torch.zeros(limits.prefix_rows, d, dtype=dtype, **alloc)
        # (the EAGLE-2 draft's one-layer cache stays in the pipeline's dtype whatever kv_dtype says:
        # 1/layers of the bytes, and the draft only proposes tokens the target verifies)
        draft_shape = (limits.draft_layers, llm.num_key_value_heads, self.max_len, llm.head_dim)
        self.draft_k = torch.zeros(draft_shape, dtype=dtype, **alloc)
        self.draft_v = torch.zeros(draft_shape, dtype=dtype, **alloc)

    def buffers(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in vars(self).items():
            if isinstance(v, torch.Tensor):
                out[k] = v
            elif isinstance(v, QuantizedKV):
                out[f"{k}.codes"], out[f"{k}.scales"] = v.tensors()
        return out

    def nbytes(self, names=None) -> int:
        """Bytes of the arena's buffers (`names`: only those whose name starts with one of them)."""
        # (k_cache/v_cache are views of the regions: each storage counted once)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for k, t in self.buffers().items()
                    if names is None or k.startswith(tuple(names))}
        return sum(storages.values())

    KV_BUFFERS = ("k_regions", "v_regions", "k_turns", "v_turns", "prefix_k", "prefix_v", "draft_k", "draft_v")

    def kv_nbytes(self) -> int:
        """Bytes of every KV buffer: the batch regions, conversation turns, prompt prefix and draft cache."""
        return self.nbytes(self.KV_BUFFERS)

    def causal_mask(self, n: int) -> torch.Tensor:
        """mask_new[:n, :n] set to lower-triangular (True = may attend), in place."""
        m = self.mask_new[:n, :n]
        m.fill_(True)
        return m.tril_()

    def all_visible(self, rows: int, columns: int) -> torch.Tensor:
        """mask_cache[:rows, :columns] set to True, in place (a step that sees every earlier slot)."""
        m = self.mask_cache[:rows, :columns]
        m.fill_(True)
        return m
