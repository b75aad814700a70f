"""Folders upstream would load and the runtime cannot are refused at load, naming the reason and the
key or tensor, never served: the InternVL3.5 variants whose decoder is not implemented (GPT-OSS,
the Qwen3 MoE sizes), parts the runtime lacks (tensors of a module it has no place for: an extra
projector as InternVL3.5's Flash variants add for their visual resolution router), and -hf folders
without the chat template that decides their prompt."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import make_tiny_checkpoint
from safetensors.torch import load_file, save_file

from litevlm_runtime.errors import CheckpointError
from litevlm_runtime.stages.prompt import model_layout
from litevlm_runtime.weights.checkpoint import load_model
from litevlm_runtime.weights.hf_layout import HF_ARCHITECTURE
from litevlm_runtime.weights.integrity import write_manifest


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q3") / "tiny-qwen3", "tiny-qwen3")


def edited_copy(src, dst, edit_config=None, edit_tensors=None):
    shutil.copytree(src, dst)
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        state = load_file(str(dst / "model.safetensors"))
        edit_tensors(state)
        save_file(state, str(dst / "model.safetensors"))
    write_manifest(dst)
    return dst


@pytest.mark.parametrize("architecture", ["GptOssForCausalLM", "Qwen3MoeForCausalLM"])
def test_unimplemented_decoder_is_refused_naming_it(qwen3_folder, tmp_path, architecture):
    folder = edited_copy(qwen3_folder, tmp_path / "m",
                         lambda c: c["llm_config"].update(architectures=[architecture]))
    with pytest.raises(CheckpointError, match=f"unknown llm_config architecture '{architecture}'; supported: "
                                              f"InternLM2ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_model(folder)


def test_tensors_of_a_module_the_runtime_lacks_are_refused_naming_one(qwen3_folder, tmp_path):
    def add_projector(state):
        state["mlp2.0.weight"] = torch.ones(4)
        state["mlp2.0.bias"] = torch.zeros(4)

    folder = edited_copy(qwen3_folder, tmp_path / "m", edit_tensors=add_projector)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'mlp2\.0\.bias' \(2 in all\) for this config"):
        load_model(folder)


def test_hf_folder_without_its_chat_template_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [HF_ARCHITECTURE], "model_type": "internvl"}))
    with pytest.raises(CheckpointError, match="without chat_template.jinja or chat_template.json"):
        model_layout(tmp_path)


def test_hf_text_model_the_runtime_does_not_map_is_refused(tmp_path):
    config = {"architectures": [HF_ARCHITECTURE], "model_type": "internvl", "vision_config": {},
              "text_config": {"model_type": "qwen3_moe"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text_config.model_type 'qwen3_moe' is not supported in the -hf layout"):
        load_model(tmp_path)
