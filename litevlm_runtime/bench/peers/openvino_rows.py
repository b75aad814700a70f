"""OpenVINO's files and rows (the timing runs in run_openvino.py, in the OpenVINO venv).

What a user of OpenVINO GenAI would run on an InternVL folder is `optimum-cli export openvino`
(task image-text-to-text) then `VLMPipeline`. optimum-intel's `internvl_chat` export loads the
folder with transformers' `trust_remote_code`: the modeling files upstream ships inside its model
folders (configuration_internvl_chat.py, modeling_internvl_chat.py, ...), named by `auto_map` in
config.json. This project writes OpenGVLab's tensor layout without upstream's code (and must not
copy it), so that export is attempted on the same folder and its error recorded (prepare's
`vlm_export`); OpenVINO is then measured on the parts it can take, as issue 43 asks:

- the language model: the same weights as a transformers Qwen2 folder (`llm_folder`), exported by
  `optimum-cli --task text-generation-with-past --weight-format int8|int4` (optimum's own IR and
  NNCF compression at its defaults), run by OpenVINO GenAI's `LLMPipeline`;
- the vision encoder: InternViT + pixel shuffle + mlp1 of the same weights as an IR written by
  OpenVINO's own converter (`ov.convert_model` over this project's modules: no exporter of
  optimum's takes them without upstream's code), weights compressed to int8 by NNCF as optimum
  compresses a VLM's vision part, run by OpenVINO's CPU plugin.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ...engines.stages import VisionStage
from ...weights.checkpoint import load_model, read_config, weight_files
from ...weights.tokenizer import Tokenizer
from . import env
from .files import cache_dir


def llm_folder(peer_dir: Path, out: Path) -> Path:
    """The language model of an InternVL folder as a transformers Qwen2ForCausalLM folder
    (config.json from llm_config, safetensors with `language_model.` dropped from the names,
    the tokenizer files), tensor by tensor."""
    if (out / "model.safetensors").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads((peer_dir / "config.json").read_text())["llm_config"]
    config = {k: v for k, v in config.items() if k != "auto_map"}
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))

    state = {}
    for path in sorted(set(weight_files(peer_dir).values())):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if name.startswith("language_model."):
                    state[name[len("language_model."):]] = f.get_tensor(name)
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (peer_dir / name).is_file():
            shutil.copy(peer_dir / name, tmp / name)
    tmp.rename(out)
    return out


def write_vision_ir(peer_dir: Path, out: Path) -> None:
    """InternViT + pixel shuffle + mlp1 of the folder (the project's VisionStage, what its own
    `litevlm export` writes) as ONNX (torch.onnx.export, dynamo) read by OpenVINO's converter, its
    weights compressed to int8 by NNCF (INT8_ASYM, per channel), saved as IR."""
    # OpenVINO and NNCF: the peers' packages (`scripts/setup.sh --peers`), imported only where a row needs them.
    import nncf
    import openvino as ov

    model = load_model(peer_dir)
    tile = model.cfg.force_image_size
    grid = tile // model.cfg.vision.patch_size
    stage = VisionStage(model, model.vision_model.embeddings.position_embedding_for(grid, grid)).eval()
    out.mkdir(parents=True, exist_ok=True)
    onnx_path = out / "vision.onnx"
    with torch.no_grad():
        program = torch.onnx.export(stage, (torch.zeros(1, 3, tile, tile),), dynamo=True,
                                    input_names=["pixel_values"], output_names=["visual"], optimize=False,
                                    verbose=False, external_data=True)
        program.save(str(onnx_path), external_data=True)
    ir = nncf.compress_weights(ov.convert_model(str(onnx_path)), mode=nncf.CompressWeightsMode.INT8_ASYM)
    ov.save_model(ir, str(out / "vision.xml"))
    for f in out.glob("vision.onnx*"):
        f.unlink()


def prepare(peer_dir: Path, cache: Path, forms, progress=print) -> dict:
    root = cache_dir(cache, peer_dir) / "openvino"
    root.mkdir(exist_ok=True)
    log = root / "export.log"
    python = env.openvino_python()
    script = env.HERE / "run_openvino.py"
    attempt = root / "vlm-attempt" / "export-vlm.json"
    if not attempt.is_file():
        progress(f"trying optimum-intel's InternVL export of {peer_dir} (task image-text-to-text)")
        env.run_script(python, script, ["export-vlm", str(peer_dir), str(attempt.parent)], log)
    vlm = json.loads(attempt.read_text())
    progress(f"  optimum-intel's InternVL export: {'ok' if vlm['ok'] else vlm['error'].splitlines()[0][:300]}")
    llm = llm_folder(peer_dir, root / "llm-qwen2")
    irs = {}
    for form in forms:
        done = root / f"llm-{form}" / "openvino_model.xml"
        if not done.is_file():
            progress(f"writing the language model's IR ({form}) with optimum-cli -> {done.parent}")
            shutil.rmtree(done.parent, ignore_errors=True)
            env.run_script(python, script, ["export-llm", str(llm), str(done.parent), form], log)
        irs[form] = done.parent
    vision = root / "vision-int8" / "vision.xml"
    if not vision.is_file():
        progress(f"writing the vision IR (ov.convert_model, NNCF int8) -> {vision.parent}")
        tmp = vision.parent.with_name("vision-int8.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.redirect_stdout(sys.stderr):        # NNCF's progress table: stdout is the report's
            write_vision_ir(peer_dir, tmp)
        tmp.rename(vision.parent)
    return {"vlm_export": vlm, "llm": irs, "vision": vision}


def run(row, ctx: dict, job: Path, out: Path) -> None:
    ov = ctx["openvino"]
    ref = ctx["reference"]
    context_id = Tokenizer(ctx["peer"]).img_context_id

    questions = []
    for q in ctx["questions"]:
        seq = ref[q["id"]].get("prompt_seq")
        if seq is None:
            raise RuntimeError("openvino rows need the reference row's prompt ids (its first round)")
        questions.append({"id": q["id"], "images": list(q["images"].values()), "new_tokens": len(ref[q["id"]]["ids"]),
                          "prompt_ids": [context_id if i < 0 else i for i in seq]})
    job.write_text(json.dumps({"mode": "whole", "llm": str(ov["llm"][row.weights]), "vision": str(ov["vision"]),
                               "tile": read_config(ctx["peer"]).force_image_size, "threads": ctx["threads"],
                               "questions": questions}))
    env.run_script(env.openvino_python(), env.HERE / "run_openvino.py", ["run", str(job), str(out)], ctx["log"])
