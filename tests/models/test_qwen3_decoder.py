"""The Qwen3 decoder (InternVL3.5) and Qwen2.5 at InternVL3's widths against transformers.

transformers' Qwen3ForCausalLM / Qwen2ForCausalLM is built at the real width (2 layers, 2000-id
vocabulary), randomized and saved with save_pretrained. The runtime reads that config.json with its
own parser (as the llm_config of an InternVL folder) and the safetensors by name into its decoder,
then runs prefill and static-KV-cache greedy decoding as the pipeline does. Checked: prefill logits
and every cached decode step's logits within 1e-4 (relative to the largest logit, fp32), the greedy
tokens identical to transformers' generate.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import relative_error
from helpers.internvl3 import TOL, hf_text_config, randomize, run_ours_decoder
from safetensors.torch import load_file

from litevlm_runtime.bench.hf_reference import hf_generate
from litevlm_runtime.errors import CheckpointError
from litevlm_runtime.models.config import ModelConfig
from litevlm_runtime.models.internvl import DECODERS

VOCAB = 2000
NEW_TOKENS = 12
# A narrow vision_config, only to hold the decoder's config in an InternVL config for the parser.
VISION = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 128,
          "image_size": 56, "patch_size": 14}


def parse_llm(text_config: dict):
    return ModelConfig.from_dict({"vision_config": VISION, "llm_config": text_config, "force_image_size": 56}).llm


def saved_by_transformers(folder, shape: str, seed: int):
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    config = hf_text_config(shape, VOCAB)
    cls = Qwen3ForCausalLM if config.model_type == "qwen3" else Qwen2ForCausalLM
    torch.manual_seed(seed)
    ref = cls(config)
    randomize(ref, seed)
    ref.save_pretrained(folder)
    return ref.float().eval()


@pytest.mark.parametrize("shape", ["internvl3_5-1b", "internvl3_5-2b", "internvl3-1b"])
@torch.inference_mode()
def test_decoder_matches_transformers(tmp_path, shape):
    ref = saved_by_transformers(tmp_path, shape, seed=21)
    text_config = json.loads((tmp_path / "config.json").read_text())
    cfg = parse_llm(text_config)
    family = text_config["model_type"]
    assert cfg.architecture == family and cfg.tie_word_embeddings
    assert cfg.head_dim == text_config.get("head_dim", cfg.hidden_size // cfg.num_attention_heads)
    ours = DECODERS[cfg.architecture](cfg, max_len=64)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in state                 # tied: transformers saves the embedding once
    ours.load_state_dict(state, strict=True)
    ours.eval()

    prompt = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    prefill, steps, ours_ids = run_ours_decoder(ours, prompt, NEW_TOKENS)
    ref_ids = hf_generate(ref, torch.tensor([prompt]), None, NEW_TOKENS)
    ref_logits = ref(input_ids=torch.tensor([prompt + ours_ids])).logits[0]
    t = len(prompt)
    e_prefill = relative_error(prefill, ref_logits[:t])
    e_steps = relative_error(steps, ref_logits[t:t + NEW_TOKENS - 1])
    print(f"\n{shape} decoder ({family}, 2 layers, real width, head {cfg.head_dim}): prefill logits rel err "
          f"{e_prefill:.2e}, cached decode steps {e_steps:.2e}; greedy {NEW_TOKENS} tokens "
          f"{'identical' if ours_ids == ref_ids else 'DIFFER'}")
    assert e_prefill < TOL and e_steps < TOL
    assert ours_ids == ref_ids and len(set(ref_ids)) > 2          # a greedy run that can tell models apart


QWEN3 = {**hf_text_config("internvl3_5-1b", VOCAB).to_dict(), "architectures": ["Qwen3ForCausalLM"]}


def test_qwen3_head_dim_defaults_to_128_as_qwen3config():
    d = copy.deepcopy(QWEN3)
    del d["head_dim"]
    assert parse_llm(d).head_dim == 128


@pytest.mark.parametrize("key, value, message", [
    ("attention_bias", True, "llm_config.attention_bias is True; only False is supported"),
    ("use_sliding_window", True, "llm_config.use_sliding_window is True; only False is supported"),
    ("layer_types", ["sliding_attention", "full_attention"], "llm_config.layer_types is"),
    ("hidden_act", "gelu", "llm_config.hidden_act is 'gelu'; only 'silu' is supported"),
])
def test_qwen3_values_the_runtime_does_not_implement_are_refused(key, value, message):
    d = copy.deepcopy(QWEN3)
    d[key] = value
    with pytest.raises(CheckpointError) as err:
        parse_llm(d)
    assert str(err.value).startswith(f"config.json: {message}"), str(err.value)
