"""The transformers reference (litevlm_runtime/hf_reference.py) is itself checked here, against a
float64 recomputation written out by hand from the upstream InternVL2.5 definitions and the
upstream-named weights, so that the numerical proof of our models stands on two independent legs.

Relative error throughout: max|a - b| / max|b| with b the float64 hand computation.
Tolerance: 1e-4 (fp32 vs fp64 at these sizes lands around 1e-6).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error
from safetensors.torch import save_file

from litevlm_runtime.bench.hf_reference import (
    build_hf_internvl,
    build_hf_text_model,
    find_image_token_id,
    hf_generate,
    load_upstream_state_dict,
    unpack_internlm2_wqkv,
)
from litevlm_runtime.errors import CheckpointError

TOL = 1e-4



# ----------------------------------------------------------------------------------------------
# Random weights in the upstream InternVL2.5 layout (names and shapes as the real checkpoints)
# ----------------------------------------------------------------------------------------------

# One keyword per field of the upstream config.json it writes (a mirrored schema, not an options object).
def upstream_config(arch="InternLM2ForCausalLM", *, llm_width=256, heads=4, kv_heads=2, llm_layers=2,  # noqa: PLR0913
                    vocab=300, vit_width=64, vit_heads=4, vit_layers=2, image=56, patch=14, tie=False):
    llm = {
        "architectures": [arch],
        "hidden_size": llm_width,
        "intermediate_size": 2 * llm_width,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": llm_layers,
        "rms_norm_eps": 1e-5 if arch == "InternLM2ForCausalLM" else 1e-6,
        "rope_theta": 1_000_000.0,
        "vocab_size": vocab,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
    }
    if arch == "InternLM2ForCausalLM":
        llm["bias"] = False
    return {
        "architectures": ["InternVLChatModel"],
        "downsample_ratio": 0.5,
        "template": "internvl2_5",
        "force_image_size": image,
        "ps_version": "v2",
        "select_layer": -1,
        "vision_config": {
            "hidden_size": vit_width, "num_attention_heads": vit_heads, "num_hidden_layers": vit_layers,
            "intermediate_size": 2 * vit_width, "image_size": image, "patch_size": patch,
            "layer_norm_eps": 1e-6, "qkv_bias": True, "qk_normalization": False, "norm_type": "layer_norm",
            "hidden_act": "gelu",
        },
        "llm_config": llm,
    }


def random_upstream_state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor a real InternVL2.5 checkpoint has, random, scaled so activations stay O(1).
    Norm weights, layer scales and biases are random too, so a dropped or misplaced one shows."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, mean=0.0):
        return (torch.randn(shape, generator=g) * scale + mean).float()

    def lin(out_f, in_f):
        return rnd(out_f, in_f, scale=1 / math.sqrt(in_f))

    v, l = cfg["vision_config"], cfg["llm_config"]
    c, grid = v["hidden_size"], v["image_size"] // v["patch_size"]
    s: dict[str, torch.Tensor] = {
        "vision_model.embeddings.class_embedding": rnd(1, 1, c),
        "vision_model.embeddings.patch_embedding.weight": rnd(c, 3, v["patch_size"], v["patch_size"],
                                                               scale=1 / v["patch_size"] / math.sqrt(3)),
        "vision_model.embeddings.patch_embedding.bias": rnd(c, scale=0.1),
        "vision_model.embeddings.position_embedding": rnd(1, 1 + grid * grid, c, scale=0.5),
    }
    for i in range(v["num_hidden_layers"]):
        p = f"vision_model.encoder.layers.{i}."
        s.update(
            {
                p + "attn.qkv.weight": lin(3 * c, c),
                p + "attn.qkv.bias": rnd(3 * c, scale=0.1),
                p + "attn.proj.weight": lin(c, c),
                p + "attn.proj.bias": rnd(c, scale=0.1),
                p + "mlp.fc1.weight": lin(v["intermediate_size"], c),
                p + "mlp.fc1.bias": rnd(v["intermediate_size"], scale=0.1),
                p + "mlp.fc2.weight": lin(c, v["intermediate_size"]),
                p + "mlp.fc2.bias": rnd(c, scale=0.1),
                p + "norm1.weight": rnd(c, scale=0.1, mean=1.0),
                p + "norm1.bias": rnd(c, scale=0.1),
                p + "norm2.weight": rnd(c, scale=0.1, mean=1.0),
                p + "norm2.bias": rnd(c, scale=0.1),
                p + "ls1": rnd(c, scale=0.2, mean=0.5),
                p + "ls2": rnd(c, scale=0.2, mean=0.5),
            }
        )
    d, wide = l["hidden_size"], 4 * c
    s.update({
        "mlp1.0.weight": rnd(wide, scale=0.1, mean=1.0), "mlp1.0.bias": rnd(wide, scale=0.1),
        "mlp1.1.weight": lin(d, wide), "mlp1.1.bias": rnd(d, scale=0.1),
        "mlp1.3.weight": lin(d, d), "mlp1.3.bias": rnd(d, scale=0.1),
    })
    hq, hkv = l["num_attention_heads"], l["num_key_value_heads"]
    hd, inter, vocab = d // hq, l["intermediate_size"], l["vocab_size"]
    internlm2 = l["architectures"][0] == "InternLM2ForCausalLM"
    m = "language_model.model."
    s[m + ("tok_embeddings.weight" if internlm2 else "embed_tokens.weight")] = rnd(vocab, d)
    s[m + "norm.weight"] = rnd(d, scale=0.1, mean=1.0)
    for i in range(l["num_hidden_layers"]):
        p = f"{m}layers.{i}."
        if internlm2:
            s.update({
                p + "attention.wqkv.weight": lin((hq + 2 * hkv) * hd, d),
                p + "attention.wo.weight": lin(d, hq * hd),
                p + "feed_forward.w1.weight": lin(inter, d),
                p + "feed_forward.w3.weight": lin(inter, d),
                p + "feed_forward.w2.weight": lin(d, inter),
                p + "attention_norm.weight": rnd(d, scale=0.1, mean=1.0),
                p + "ffn_norm.weight": rnd(d, scale=0.1, mean=1.0),
            })
        else:
            s.update({
                p + "self_attn.q_proj.weight": lin(hq * hd, d), p + "self_attn.q_proj.bias": rnd(hq * hd, scale=0.3),
                p + "self_attn.k_proj.weight": lin(hkv * hd, d), p + "self_attn.k_proj.bias": rnd(hkv * hd, scale=0.3),
                p + "self_attn.v_proj.weight": lin(hkv * hd, d), p + "self_attn.v_proj.bias": rnd(hkv * hd, scale=0.3),
                p + "self_attn.o_proj.weight": lin(d, hq * hd),
                p + "mlp.gate_proj.weight": lin(inter, d),
                p + "mlp.up_proj.weight": lin(inter, d),
                p + "mlp.down_proj.weight": lin(d, inter),
                p + "input_layernorm.weight": rnd(d, scale=0.1, mean=1.0),
                p + "post_attention_layernorm.weight": rnd(d, scale=0.1, mean=1.0),
            })
    if internlm2:
        s["language_model.output.weight"] = lin(vocab, d)
    elif not l["tie_word_embeddings"]:
        s["language_model.lm_head.weight"] = lin(vocab, d)
    return s


# ----------------------------------------------------------------------------------------------
# Hand float64 recomputation from the upstream definitions
# ----------------------------------------------------------------------------------------------

def hand_rmsnorm(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def hand_rope(x, positions, theta):
    """x [H, T, D]; rotate-half convention (both InternLM2 and Qwen2 use it)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None]            # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def hand_decoder_logits(cfg: dict, s: dict[str, torch.Tensor], embeds: torch.Tensor) -> torch.Tensor:
    """embeds [T, D] float64 -> logits [T, V], full causal attention, positions 0..T-1."""
    l = cfg["llm_config"]
    s = {k: v.double() for k, v in s.items() if k.startswith("language_model.")}
    internlm2 = l["architectures"][0] == "InternLM2ForCausalLM"
    hq, hkv, eps, theta = l["num_attention_heads"], l["num_key_value_heads"], l["rms_norm_eps"], l["rope_theta"]
    t, d = embeds.shape
    hd, groups = d // hq, hq // hkv
    pos = torch.arange(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = embeds.double()
    for i in range(l["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        if internlm2:
            h = hand_rmsnorm(x, s[p + "attention_norm.weight"], eps)
            # Upstream InternLM2Attention: the wqkv OUTPUT is viewed as [kv_heads, groups + 2, head_dim]:
            # the first `groups` slots are that KV head's query heads, then its key, then its value.
            packed = (h @ s[p + "attention.wqkv.weight"].T).view(t, hkv, groups + 2, hd)
            q = packed[:, :, :groups].reshape(t, hq, hd)
            k, v = packed[:, :, groups], packed[:, :, groups + 1]
            wo, norm2 = s[p + "attention.wo.weight"], s[p + "ffn_norm.weight"]
            w_gate, w_up, w_down = (s[p + f"feed_forward.{n}.weight"] for n in ("w1", "w3", "w2"))
        else:
            h = hand_rmsnorm(x, s[p + "input_layernorm.weight"], eps)
            a = p + "self_attn."
            q = (h @ s[a + "q_proj.weight"].T + s[a + "q_proj.bias"]).view(t, hq, hd)
            k = (h @ s[a + "k_proj.weight"].T + s[a + "k_proj.bias"]).view(t, hkv, hd)
            v = (h @ s[a + "v_proj.weight"].T + s[a + "v_proj.bias"]).view(t, hkv, hd)
            wo, norm2 = s[a + "o_proj.weight"], s[p + "post_attention_layernorm.weight"]
            w_gate, w_up, w_down = (s[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        q = hand_rope(q.transpose(0, 1), pos, theta)                   # [Hq, T, D]
        k = hand_rope(k.transpose(0, 1), pos, theta)                   # [Hkv, T, D]
        v = v.transpose(0, 1)
        # GQA: query head j reads KV head j // groups.
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(hd)
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, hq * hd)
        x = x + attn @ wo.T
        h = hand_rmsnorm(x, norm2, eps)
        x = x + (F.silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T
    x = hand_rmsnorm(x, s["language_model.model.norm.weight"], eps)
    if internlm2:
        head = s["language_model.output.weight"]
    else:
        head = s.get("language_model.lm_head.weight", s["language_model.model.embed_tokens.weight"])
    return x @ head.T


def hand_embed(cfg: dict, s: dict, ids: torch.Tensor) -> torch.Tensor:
    name = ("language_model.model.tok_embeddings.weight"
            if cfg["llm_config"]["architectures"][0] == "InternLM2ForCausalLM"
            else "language_model.model.embed_tokens.weight")
    return s[name].double()[ids]


def hand_layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def hand_gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def hand_vision_tokens(cfg: dict, s: dict, pixels: torch.Tensor) -> torch.Tensor:
    """pixels [B, 3, S, S] -> visual tokens [B, (S/14/2)^2, D], float64, from the upstream definition
    (tile size equal to the position embedding's, so no interpolation)."""
    v = cfg["vision_config"]
    s = {k: t.double() for k, t in s.items() if k.startswith(("vision_model.", "mlp1."))}
    b, _, size, _ = pixels.shape
    p, c, heads, eps = v["patch_size"], v["hidden_size"], v["num_attention_heads"], v["layer_norm_eps"]
    g = size // p
    # Patch embedding as an explicit sum over each 14x14x3 patch (no conv): patch (r, col) in row-major order.
    patches = pixels.double().reshape(b, 3, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, 3 * p * p)
    w = s["vision_model.embeddings.patch_embedding.weight"].reshape(c, 3 * p * p)
    x = patches @ w.T + s["vision_model.embeddings.patch_embedding.bias"]
    x = torch.cat([s["vision_model.embeddings.class_embedding"].expand(b, 1, c), x], 1)
    x = x + s["vision_model.embeddings.position_embedding"]
    n, hd = x.shape[1], c // heads
    for i in range(v["num_hidden_layers"]):
        q_ = f"vision_model.encoder.layers.{i}."
        h = hand_layernorm(x, s[q_ + "norm1.weight"], s[q_ + "norm1.bias"], eps)
        qkv = (h @ s[q_ + "attn.qkv.weight"].T + s[q_ + "attn.qkv.bias"]).view(b, n, 3, heads, hd)
        q, k, vv = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
        attn = ((q @ k.transpose(-1, -2)) / math.sqrt(hd)).softmax(-1) @ vv
        attn = attn.transpose(1, 2).reshape(b, n, c) @ s[q_ + "attn.proj.weight"].T + s[q_ + "attn.proj.bias"]
        x = x + s[q_ + "ls1"] * attn
        h = hand_layernorm(x, s[q_ + "norm2.weight"], s[q_ + "norm2.bias"], eps)
        h = hand_gelu(h @ s[q_ + "mlp.fc1.weight"].T + s[q_ + "mlp.fc1.bias"]) @ s[q_ + "mlp.fc2.weight"].T
        x = x + s[q_ + "ls2"] * (h + s[q_ + "mlp.fc2.bias"])
    # No final norm; drop CLS; pixel shuffle v2 == 2x2 space-to-depth where output token (i, j)
    # concatenates patches (2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1) in that channel order
    # (derived from upstream's view/permute/view/permute sequence on a row-major [g, g] grid).
    x = x[:, 1:].reshape(b, g // 2, 2, g // 2, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(b, (g // 2) ** 2, 4 * c)
    x = hand_layernorm(x, s["mlp1.0.weight"], s["mlp1.0.bias"], 1e-5)   # nn.LayerNorm default eps
    x = hand_gelu(x @ s["mlp1.1.weight"].T + s["mlp1.1.bias"])
    return x @ s["mlp1.3.weight"].T + s["mlp1.3.bias"]


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (14, 2, 64), (4, 4, 8)])
def test_unpack_wqkv_block_layout(heads, kv_heads, head_dim):
    """Label each packed row by (kind, head, row) and check every row lands where upstream says."""
    groups = heads // kv_heads
    labels = []
    for h in range(kv_heads):
        labels += [(0, h * groups + j, r) for j in range(groups) for r in range(head_dim)]
        labels += [(1, h, r) for r in range(head_dim)]
        labels += [(2, h, r) for r in range(head_dim)]
    packed = torch.tensor(labels, dtype=torch.float64)                   # [rows, 3] as a fake weight
    q, k, v = unpack_internlm2_wqkv(packed, heads, kv_heads, head_dim)
    for kind, part, n_heads in ((0, q, heads), (1, k, kv_heads), (2, v, kv_heads)):
        expected = torch.tensor([(kind, hh, r) for hh in range(n_heads) for r in range(head_dim)], dtype=torch.float64)
        assert torch.equal(part, expected)
    with pytest.raises(CheckpointError):
        unpack_internlm2_wqkv(packed[:-1], heads, kv_heads, head_dim)


@pytest.mark.parametrize("arch,heads,kv_heads", [
    ("InternLM2ForCausalLM", 4, 2), ("InternLM2ForCausalLM", 6, 2), ("InternLM2ForCausalLM", 4, 4),
    ("Qwen2ForCausalLM", 4, 2),
])
def test_text_reference_matches_hand_float64(arch, heads, kv_heads):
    cfg = upstream_config(arch, heads=heads, kv_heads=kv_heads, llm_width=192 if heads == 6 else 256)
    state = random_upstream_state(cfg, seed=1)
    model = build_hf_text_model(cfg, state)
    ids = torch.randint(0, cfg["llm_config"]["vocab_size"], (11,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(input_ids=ids[None]).logits[0]
    want = hand_decoder_logits(cfg, state, hand_embed(cfg, state, ids))
    err = relative_error(got, want)
    print(f"{arch} {heads}/{kv_heads} heads: logits rel err {err:.2e}")
    assert err < TOL


def test_vision_reference_matches_hand_float64():
    cfg = upstream_config()
    state = random_upstream_state(cfg, seed=3)
    model = build_hf_internvl(cfg, state, image_token_id=7)
    assert isinstance(model.model.vision_tower.layernorm, torch.nn.Identity)   # no final norm
    pixels = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model.get_image_features(pixel_values=pixels).pooler_output
    want = hand_vision_tokens(cfg, state, pixels)
    assert got.shape == want.shape == (2, 4, cfg["llm_config"]["hidden_size"])
    err = relative_error(got, want)
    print(f"InternViT + pixel shuffle + mlp1: rel err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("arch", ["InternLM2ForCausalLM", "Qwen2ForCausalLM"])
def test_full_model_and_generate_match_hand_float64(arch):
    """Image context tokens in the prompt are replaced by the visual tokens; logits of the whole
    prompt and hf_generate's greedy continuation match the hand computation."""
    cfg = upstream_config(arch, tie=(arch == "Qwen2ForCausalLM"))
    state = random_upstream_state(cfg, seed=5)
    img_ctx = 7
    model = build_hf_internvl(cfg, state, image_token_id=img_ctx)
    pixels = torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(6))
    ids = torch.tensor([1, 5, 9, 6] + [img_ctx] * 4 + [8, 40, 41, 42, 43])
    visual = hand_vision_tokens(cfg, state, pixels)[0]

    def hand_logits(seq):
        emb = hand_embed(cfg, state, seq)
        emb[4:8] = visual               # only the prompt's image slots (generated ids are plain text)
        return hand_decoder_logits(cfg, state, emb)

    with torch.no_grad():
        got = model(input_ids=ids[None], pixel_values=pixels).logits[0]
    err = relative_error(got, hand_logits(ids))
    print(f"{arch} full model logits rel err {err:.2e}")
    assert err < TOL

    new = hf_generate(model, ids[None], pixels, max_new_tokens=6)
    seq, want = ids, []
    for _ in range(6):
        nxt = int(hand_logits(seq)[-1].argmax())
        want.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
    assert new == want
    # Stops right after the first occurrence of the stop token when one is given.
    stop = want[2]
    assert hf_generate(model, ids[None], pixels, max_new_tokens=6, eos_token_id=stop) == want[:want.index(stop) + 1]


def test_load_upstream_folder_single_and_sharded(tmp_path):
    cfg = upstream_config()
    state = random_upstream_state(cfg, seed=7)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for folder in (single, sharded):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(single / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, part in halves.items():
        save_file({n: state[n] for n in part}, str(sharded / fname))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in halves.items() for n in part}}))
    (sharded / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 123, "content": "<IMG_CONTEXT>"}]}))
    for folder in (single, sharded):
        got_cfg, got = load_upstream_state_dict(folder)
        assert got_cfg == cfg and got.keys() == state.keys()
        assert all(torch.equal(got[n], state[n]) for n in state)
    assert find_image_token_id(sharded) == 123
    assert find_image_token_id(single) == 92546          # the real InternLM2 tokenizer's id
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        load_upstream_state_dict(sharded)
