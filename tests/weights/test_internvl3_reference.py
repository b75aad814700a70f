"""InternVL3 / InternVL3.5 folders in both upstream layouts against transformers' own InternVL.

For InternVL3-1B- (Qwen2.5-0.5B), InternVL3.5-1B- (Qwen3-0.6B), InternVL3.5-2B- (Qwen3-1.7B) and
InternVL2.5-2B- (InternLM2-1.8B, a Llama text model in -hf folders) shaped models: transformers'
InternVLForConditionalGeneration is built at the real widths (InternViT
1024 wide at 448 px, 1 layer; the decoder 2 layers; a 2000-id byte-level BPE vocabulary with
InternVL's special tokens), randomized and saved with save_pretrained, with a tokenizer, an image
processor and the -hf chat template beside it: an `-hf` folder as a user downloads one.

* -hf layout: the runtime loads that folder as it is (names mapped, no copy on disk).
* remote-code layout: the runtime writes what it loaded as an OpenGVLab `InternVLChatModel` folder;
  hf_reference (transformers' converter's renames, code independent of hf_layout.py) converts that
  folder back, and every tensor must equal transformers' original bit for bit, so the remote-code
  folder holds exactly the model transformers saved.

Checked in each layout: the ViT output and the visual tokens (get_image_features) within 1e-4 of
transformers, the multimodal prompt's logits within 1e-4, the pipeline's greedy answer identical to
transformers' generate, and the prompt ids identical to what the layout's upstream builds: the -hf
processor's chat template + InternVLProcessor for one image per camera, or InternVL's `chat()`
string (template internvl2_5) tokenized whole by transformers' tokenizer. Relative error:
max|ours - reference| / max|reference|, fp32.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import relative_error
from helpers.internvl3 import EXTRA_SPECIAL, HF_CHAT_TEMPLATE, REAL_VISION, TOL, hf_text_config, randomize

from litevlm_runtime.bench.hf_reference import (
    build_hf_internvl,
    find_image_token_id,
    hf_generate,
    load_upstream_state_dict,
)
from litevlm_runtime.errors import CheckpointError
from litevlm_runtime.models.config import INTERNVL_SYSTEM_MESSAGE
from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions
from litevlm_runtime.stages.prompt import model_layout
from litevlm_runtime.weights.checkpoint import load_model, read_config, write_checkpoint
from litevlm_runtime.weights.corpus import default_corpus
from litevlm_runtime.weights.integrity import write_manifest
from litevlm_runtime.weights.tokenizer import train_bpe_tokenizer

NEW_TOKENS = 8
QUESTION = "Is there a pedestrian in front of the ego car?"
CAMERAS = ("CAM_FRONT", "CAM_FRONT_LEFT")


def internvl_processor(folder):
    """transformers' InternVLProcessor over the folder's tokenizer, image processor and chat template.
    (No video processor: transformers' needs torchvision, absent here; the processor's image path
    does not touch it, and the subclass only lets the constructor accept None for it.)"""
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, PreTrainedTokenizerFast

    class ImageOnlyInternVLProcessor(InternVLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            if arg is not None:
                return super().check_argument_for_proper_class(name, arg)

    return ImageOnlyInternVLProcessor(image_processor=GotOcr2ImageProcessor.from_pretrained(str(folder)),
                                      tokenizer=PreTrainedTokenizerFast.from_pretrained(str(folder)),
                                      chat_template=(folder / "chat_template.jinja").read_text(), image_seq_length=256)


def write_hf_tokenizer(folder):
    """A byte-level BPE tokenizer.json with InternVL's special tokens, plus `<video>` and Qwen3's
    `<think>`/`</think>` as added tokens, saved by transformers with the -hf extra special tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import GotOcr2ImageProcessor, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    train_bpe_tokenizer(default_corpus(), 2000, folder / "tokenizer.json")
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<video>", special=True, normalized=False)])
    tok.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    tok.save(str(folder / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>",
                            pad_token="<|im_end|>", extra_special_tokens=EXTRA_SPECIAL).save_pretrained(str(folder))
    GotOcr2ImageProcessor(size={"height": 448, "width": 448}, image_mean=[0.485, 0.456, 0.406],
                          image_std=[0.229, 0.224, 0.225], crop_to_patches=False).save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text(HF_CHAT_TEMPLATE)
    return HFTokenizer.from_file(str(folder / "tokenizer.json"))


def hf_internvl(shape: str, vocab_size: int, image_token_id: int, seed: int):
    from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig

    text = hf_text_config(shape, vocab_size)
    vision = InternVLVisionConfig(num_hidden_layers=1, attn_implementation="eager", **REAL_VISION)
    config = InternVLConfig(text_config=text, vision_config=vision, image_token_id=image_token_id, image_seq_length=256,
                            downsample_ratio=0.5, tie_word_embeddings=text.tie_word_embeddings,
                            attn_implementation="eager")
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(config)
    randomize(model, seed)
    with torch.no_grad():
        # Visual tokens at the scale of the (0.02) text embeddings, as in trained models: visual tokens
        # a hundred times larger would steer every decode step to the same argmax.
        for p in model.model.multi_modal_projector.linear_2.parameters():
            p.mul_(0.02)
    return model.float().eval()


@pytest.fixture(
    scope="module",
    params=[
        "internvl3-1b",
        pytest.param("internvl3_5-1b", marks=pytest.mark.slow),  # (Qwen3: 3.5-2B in CI)
        "internvl3_5-2b",
        "internvl2_5-2b",
    ],
)
def folders(request, tmp_path_factory):
    """(shape, -hf folder, remote-code folder, transformers' model) for one upstream shape."""
    shape = request.param
    hf = tmp_path_factory.mktemp(f"{shape}-hf")
    tok = write_hf_tokenizer(hf)
    ref = hf_internvl(shape, tok.get_vocab_size(with_added_tokens=True), tok.token_to_id("<IMG_CONTEXT>"), seed=31)
    ref.save_pretrained(str(hf))
    remote = tmp_path_factory.mktemp(f"{shape}-remote")
    write_checkpoint(remote, load_model(hf, torch.float32), hf / "tokenizer.json")
    # As upstream's folders: a Qwen2 tokenizer class, so the layout is InternVL's own (`internvl`), and
    # no system_message key (the -hf model has none; upstream's template internvl2_5 brings its own).
    tok_config = json.loads((remote / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(json.dumps({**tok_config, "tokenizer_class": "Qwen2Tokenizer"}))
    config = json.loads((remote / "config.json").read_text())
    del config["system_message"]
    (remote / "config.json").write_text(json.dumps(config, indent=2))
    write_manifest(remote)
    yield shape, hf, remote, ref
    for folder in (hf, remote):     # 0.2-0.6 GB each: CI's disk holds the whole run's temporary folders
        shutil.rmtree(folder, ignore_errors=True)


def test_remote_code_folder_holds_exactly_transformers_weights(folders):
    shape, hf, remote, ref = folders
    config, state = load_upstream_state_dict(remote)
    family = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "llama": "InternLM2ForCausalLM"}[ref.config.text_config.model_type]
    assert config["llm_config"]["architectures"] == [family]
    back = build_hf_internvl(config, state, find_image_token_id(remote, config)).state_dict()
    original = ref.state_dict()
    assert set(back) == set(original)
    different = [k for k in original if not torch.equal(back[k], original[k])]
    assert different == [], f"{shape}: {different[:3]}"


@pytest.fixture(scope="module", params=["hf", "remote"])
def loaded(request, folders):
    shape, hf, remote, ref = folders
    folder = hf if request.param == "hf" else remote
    return shape, request.param, folder, load_model(folder, torch.float32, max_len=1024), ref


@torch.inference_mode()
def test_vision_features_match_transformers(loaded):
    shape, layout, _, ours, ref = loaded
    pixels = torch.randn(2, 3, 448, 448, generator=torch.Generator().manual_seed(5))
    out = ref.model.get_image_features(pixel_values=pixels)
    e_vit = relative_error(ours.vision_model(pixels), out.last_hidden_state)
    e_tokens = relative_error(ours.encode_images(pixels), out.pooler_output)
    print(f"\n{shape} ({layout} layout): ViT out rel err {e_vit:.2e}, visual tokens rel err {e_tokens:.2e}")
    assert e_vit < TOL and e_tokens < TOL


@torch.inference_mode()
def test_prompt_logits_and_greedy_answer_match_transformers(loaded):
    shape, layout, folder, ours, ref = loaded
    pipe = Pipeline.from_pretrained(folder, PipelineOptions(pipeline="baseline", cameras=CAMERAS,
                                                            max_new_tokens=NEW_TOKENS))
    tok = pipe.rt.tok
    assert ref.config.image_token_id == tok.img_context_id
    rng = np.random.default_rng(7)
    images = {c: rng.integers(0, 256, (300, 500, 3), dtype=np.uint8) for c in CAMERAS}
    ans = pipe.answer(images, QUESTION)
    ids, pixels = pipe.reference_inputs(images, QUESTION)
    ref_ids = [t for t in hf_generate(ref, ids, pixels, NEW_TOKENS, sorted(tok.eos_ids)) if t not in tok.eos_ids]
    ref_logits = ref(input_ids=ids, pixel_values=pixels).logits[0]
    lm, t = ours.language_model, ids.shape[1]
    embeds = lm.embed(ids[0]).clone()
    embeds[ids[0] == tok.img_context_id] = ours.encode_images(pixels).reshape(-1, embeds.shape[-1])
    e_prompt = relative_error(lm.head(lm(embeds, torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril())[0]),
                              ref_logits)
    print(f"\n{shape} ({layout} layout): {t} prompt tokens ({2 * 256} visual), prompt logits rel err {e_prompt:.2e}; "
          f"pipeline answer {ans.token_ids} vs transformers generate {ref_ids}")
    assert ans.input_tokens == t
    assert e_prompt < TOL
    # (Random weights often settle on one token here; the prompt logits above, every position of the
    # multimodal prompt within 1e-4, are the finer check, test_qwen3_decoder's varied greedy runs another.)
    assert ans.token_ids == ref_ids


def upstream_chat_query(question: str, n_images: int) -> str:
    """The string InternVL's remote-code chat() tokenizes (template internvl2_5, num_patches_list of
    one tile per image; InternVL3 and InternVL3.5 configs name the same template)."""
    lines = "<image>\n" if n_images == 1 else "".join(f"Image-{i + 1}: <image>\n" for i in range(n_images))
    sep = "<|im_end|>\n"
    query = (f"<|im_start|>system\n{INTERNVL_SYSTEM_MESSAGE}{sep}<|im_start|>user\n{lines}{question}{sep}"
             f"<|im_start|>assistant\n")
    return query.replace("<image>", "<img>" + "<IMG_CONTEXT>" * 256 + "</img>")


@pytest.mark.parametrize("n_cameras", [1, 2])
def test_prompt_ids_equal_the_layouts_own_upstream(loaded, n_cameras):
    from PIL import Image
    from transformers import PreTrainedTokenizerFast

    shape, layout, folder, _, _ = loaded
    cameras = CAMERAS[:n_cameras]
    pipe = Pipeline.from_pretrained(folder, PipelineOptions(pipeline="baseline", cameras=cameras))
    rng = np.random.default_rng(8)
    frames = [rng.integers(0, 256, (300, 500, 3), dtype=np.uint8) for _ in cameras]
    ours = pipe.reference_inputs(dict(zip(cameras, frames)), QUESTION)[0][0].tolist()
    if layout == "hf":
        assert model_layout(folder)[0] == "chat_template"
        processor = internvl_processor(folder)
        messages = [{"role": "user", "content": [{"type": "image"}] * n_cameras + [{"type": "text", "text": QUESTION}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        expected = processor(text=text, images=[Image.fromarray(f) for f in frames], crop_to_patches=False)[
            "input_ids"
        ][0]
    else:
        assert model_layout(folder)[0] == "internvl"
        expected = PreTrainedTokenizerFast.from_pretrained(str(folder))(upstream_chat_query(QUESTION, n_cameras))[
            "input_ids"
        ]
    assert ours == list(expected)


def test_hf_config_keys_the_runtime_does_not_implement_are_refused_by_their_hf_name(folders, tmp_path):
    _, hf, _, _ = folders
    config = json.loads((hf / "config.json").read_text())
    llama = config["text_config"]["model_type"] == "llama"
    text_edit = ((lambda c: c["text_config"].update(mlp_bias=True), "text_config.mlp_bias is True; only False") if llama
                 else (lambda c: c["text_config"].update(use_sliding_window=True),
                       "text_config.use_sliding_window is True; only False"))
    for edit, message in [
        text_edit,
        (lambda c: c["vision_config"].update(use_qk_norm=True), "vision_config.use_qk_norm is True; only False"),
        (
            lambda c: c["vision_config"].update(use_mean_pooling=False),
            "vision_config.use_mean_pooling is False; only True",
        ),
        (lambda c: c.update(vision_feature_layer=-2), "vision_feature_layer is -2; only -1"),
        (lambda c: c.update(image_seq_length=64), "image_seq_length is 64, but the tiles give 256"),
        (lambda c: c["text_config"].update(model_type="mistral"), "text_config.model_type 'mistral' is not supported"),
        (
            lambda c: c.update(tie_word_embeddings=not c["text_config"].get("tie_word_embeddings", False)),
            "but text_config.tie_word_embeddings is",
        ),
    ]:
        bad = json.loads(json.dumps(config))
        edit(bad)
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError) as err:
            read_config(tmp_path)
        assert message in str(err.value), str(err.value)
