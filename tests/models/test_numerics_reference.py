"""Numerical proof of the project's models against transformers (issue 2, section 4).

With identical random weights, at the REAL widths of InternVL2.5-2B / -1B and reduced depth
(2 layers each):
  * InternViT-300M (1024 wide, 16 heads, 448 tiles) + pixel shuffle + mlp1 vs transformers'
    InternVLModel.get_image_features;
  * the InternLM2 decoder (2048 wide, 16/8 heads, head 128) vs LlamaForCausalLM after un-packing
    wqkv, and the Qwen2 decoder (896 wide, 14/2 heads) vs Qwen2ForCausalLM: prefill logits, the
    logits of every static-KV-cache decode step, and 12 greedy tokens;
  * the whole pipeline (one camera, one 448 tile) vs InternVLForConditionalGeneration.generate.

The weights travel the way a user's do: our model is randomized, written as an InternVL2.5 folder
by the runtime's writer, loaded back by the runtime's loader, and read independently (raw
config.json keys) by litevlm_runtime.bench.hf_reference for transformers.

Relative error: max|ours - reference| / max|reference|, in fp32, tolerance 1e-4.
Vocabulary is small (the BPE tokenizer trained for the folder, 2000 ids) to keep the file fast.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from helpers import relative_error
from helpers.internvl3 import run_ours_decoder

from litevlm_runtime.bench.hf_reference import (
    build_hf_internvl,
    build_hf_text_model,
    find_image_token_id,
    hf_generate,
    load_upstream_state_dict,
)
from litevlm_runtime.models.config import LLMConfig, ModelConfig, VisionConfig
from litevlm_runtime.models.internvl import InternVL
from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions
from litevlm_runtime.weights.checkpoint import load_model, write_checkpoint
from litevlm_runtime.weights.corpus import default_corpus
from litevlm_runtime.weights.tokenizer import Tokenizer, train_bpe_tokenizer

TOL = 1e-4
NEW_TOKENS = 12

REAL_VIT = dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096, image_size=448, patch_size=14)
REAL_LLM = {
    "internlm2": dict(architecture="internlm2", hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                      num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1_000_000.0),
    "qwen2": dict(architecture="qwen2", hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                  num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1_000_000.0),
}



def randomize(model: InternVL, seed: int) -> None:
    """Every parameter random, including norm weights, biases and layer scales (an init of ones
    and zeros would hide a dropped or misplaced one); linear weights scaled 1/sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("ls1", "ls2"):
                p.copy_(0.5 + 0.2 * r)
            elif leaf == "bias":
                p.copy_(0.2 * r)
            elif p.dim() == 1:                                  # norm weights
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith(("tok_embeddings.weight", "embed_tokens.weight", "class_embedding")):
                p.copy_(r)
            elif name.endswith("position_embedding"):
                p.copy_(0.5 * r)
            else:
                p.copy_(r / math.sqrt(p[0].numel()))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(default_corpus(), 2000, path)
    return path


def write_real_width(folder, family: str, tokenizer_file, seed: int):
    vocab = Tokenizer(tokenizer_file.parent).vocab_size
    cfg = ModelConfig(VisionConfig(num_hidden_layers=2, **REAL_VIT),
                      LLMConfig(num_hidden_layers=2, vocab_size=vocab, **REAL_LLM[family]),
                      force_image_size=448)
    assert cfg.llm.head_dim == (128 if family == "internlm2" else 64) and cfg.tokens_per_tile == 256
    model = InternVL(cfg, max_len=64)
    randomize(model, seed)
    write_checkpoint(folder, model, tokenizer_file)
    return folder


@pytest.fixture(scope="module", params=["internlm2", "qwen2"])
def real_width(request, tmp_path_factory, tokenizer_file):
    """(folder, our model loaded by the runtime, upstream config dict, upstream state dict)."""
    folder = write_real_width(tmp_path_factory.mktemp(request.param), request.param, tokenizer_file,
                              seed=11 if request.param == "internlm2" else 12)
    ours = load_model(folder, torch.float32, max_len=512)   # RoPE table long enough for the image prompt
    config, state = load_upstream_state_dict(folder)
    # transformers' full model is built once per family (the vision and pipeline tests share it).
    full_ref = build_hf_internvl(config, state, image_token_id=find_image_token_id(folder, config))
    yield request.param, folder, ours, config, state, full_ref
    shutil.rmtree(folder, ignore_errors=True)     # 0.25-0.65 GB of weights: CI's disk holds the whole run's


@torch.inference_mode()
def test_decoder_matches_transformers(real_width):
    family, _, ours, config, state, _ = real_width
    ref = build_hf_text_model(config, state)
    assert type(ref).__name__ == ("LlamaForCausalLM" if family == "internlm2" else "Qwen2ForCausalLM")
    vocab = config["llm_config"]["vocab_size"]
    prompt = torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(3)).tolist()

    prefill, steps, ours_ids = run_ours_decoder(ours.language_model, prompt, NEW_TOKENS)
    ref_ids = hf_generate(ref, torch.tensor([prompt]), None, NEW_TOKENS)
    # One full forward over prompt + generated tokens gives the reference logits for every step.
    ref_logits = ref(input_ids=torch.tensor([prompt + ours_ids])).logits[0]
    t = len(prompt)
    e_prefill = relative_error(prefill, ref_logits[:t])
    e_steps = relative_error(steps, ref_logits[t:t + NEW_TOKENS - 1])
    print(f"\n{family} decoder (2 layers, real width): prefill logits rel err {e_prefill:.2e}, "
          f"cached decode-step logits rel err {e_steps:.2e}; greedy {NEW_TOKENS} tokens "
          f"{'identical' if ours_ids == ref_ids else 'DIFFER'}")
    assert e_prefill < TOL and e_steps < TOL
    assert ours_ids == ref_ids


@torch.inference_mode()
def test_vision_tower_and_projector_match_transformers(real_width):
    family, _, ours, _, _, full_ref = real_width
    ref = full_ref.model
    pixels = torch.randn(2, 3, 448, 448, generator=torch.Generator().manual_seed(5))
    ref_out = ref.get_image_features(pixel_values=pixels)          # carries both ViT output and tokens
    e_tokens = relative_error(ours.encode_images(pixels), ref_out.pooler_output)
    e_vit = relative_error(ours.vision_model(pixels[:1]), ref_out.last_hidden_state[:1])
    # A tile smaller than the position embedding's 448: both interpolate it (bicubic).
    small = pixels[:, :, :224, :224].contiguous()
    grid = 224 // 14
    pos = ours.vision_model.embeddings.position_embedding_for(grid, grid)
    e_small = relative_error(ours.encode_images(small, pos), ref.get_image_features(pixel_values=small).pooler_output)
    print(f"\nInternViT (2 layers, 1024 wide, 448) + mlp1 -> {family} width: ViT out rel err {e_vit:.2e}, "
          f"visual tokens rel err {e_tokens:.2e}, 224 tile (interpolated pos) {e_small:.2e}")
    assert e_vit < TOL and e_tokens < TOL and e_small < TOL


@torch.inference_mode()
def test_pipeline_answer_matches_transformers_generate(real_width):
    """The staged pipeline (one camera, one 448 tile, all tokens kept, greedy) and transformers'
    InternVLForConditionalGeneration.generate give the same tokens on the same weights and inputs."""
    family, folder, ours, _, _, ref = real_width
    pipe = Pipeline.from_pretrained(folder, PipelineOptions(pipeline="baseline", cameras=("CAM_FRONT",),
                                                            max_new_tokens=NEW_TOKENS))
    tok = pipe.rt.tok
    assert ref.config.image_token_id == tok.img_context_id
    rng = np.random.default_rng(7)
    images = {"CAM_FRONT": rng.integers(0, 256, (300, 500, 3), dtype=np.uint8)}
    question = "Is there a pedestrian in front of the ego car?"
    ans = pipe.answer(images, question)
    ids, pixels = pipe.reference_inputs(images, question)
    ref_ids = hf_generate(ref, ids, pixels, NEW_TOKENS, sorted(tok.eos_ids))
    ref_ids = [t for t in ref_ids if t not in tok.eos_ids]
    # Logits of the whole multimodal prompt: our model's parts (visual tokens spliced into the
    # embeddings at the <IMG_CONTEXT> slots, one causal pass) vs transformers' forward.
    ref_logits = ref(input_ids=ids, pixel_values=pixels).logits[0]
    lm, t = ours.language_model, ids.shape[1]
    embeds = lm.embed(ids[0]).clone()
    embeds[ids[0] == tok.img_context_id] = ours.encode_images(pixels).reshape(-1, embeds.shape[-1])
    ours_logits = lm.head(lm(embeds, torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril())[0])
    e_prompt = relative_error(ours_logits, ref_logits)
    print(f"\n{family} full model: {t} prompt tokens (256 visual), prompt logits rel err {e_prompt:.2e}; "
          f"pipeline answer {ans.token_ids} vs transformers generate {ref_ids}")
    assert ans.input_tokens == t
    assert e_prompt < TOL
    assert ans.token_ids == ref_ids


@torch.inference_mode()
def test_tied_qwen2_head_matches_transformers(tmp_path, tokenizer_file):
    """Qwen2.5-0.5B ties its LM head to the embedding: the folder then has no lm_head tensor and
    both sides must reuse the embedding (real decoder width; a narrow ViT, unused here)."""
    vocab = Tokenizer(tokenizer_file.parent).vocab_size
    cfg = ModelConfig(VisionConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=128,
                                   image_size=56, patch_size=14),
                      LLMConfig(num_hidden_layers=2, vocab_size=vocab, tie_word_embeddings=True, **REAL_LLM["qwen2"]),
                      force_image_size=56)
    model = InternVL(cfg, max_len=64)
    randomize(model, seed=13)
    write_checkpoint(tmp_path, model, tokenizer_file)
    config, state = load_upstream_state_dict(tmp_path)
    assert "language_model.lm_head.weight" not in state and config["llm_config"]["tie_word_embeddings"]
    ours = load_model(tmp_path, torch.float32, max_len=64).language_model
    ref = build_hf_text_model(config, state)
    prompt = torch.randint(0, vocab, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    prefill, _, ours_ids = run_ours_decoder(ours, prompt, NEW_TOKENS)
    e = relative_error(prefill, ref(input_ids=torch.tensor([prompt])).logits[0])
    print(f"\nqwen2 tied head: prefill logits rel err {e:.2e}")
    assert e < TOL
    assert ours_ids == hf_generate(ref, torch.tensor([prompt]), None, NEW_TOKENS)
