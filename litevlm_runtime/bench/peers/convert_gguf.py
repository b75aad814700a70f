"""Write llama.cpp's files for a model folder with llama.cpp's own tools, as a standalone script
in its own process (no litevlm_runtime import):

    python convert_gguf.py convert LLAMA_SRC MODEL_DIR OUT.gguf f16 [--mmproj]
    python convert_gguf.py quantize IN.gguf OUT.gguf q8_0|q4_0

convert: `convert_hf_to_gguf.py` (with its `conversion/` package and `gguf-py/`) from the llama.cpp
tree that the llama-cpp-python source package vendors (LLAMA_SRC: scripts/setup.sh --peers keeps
it), so that converter and library are one version. InternVL folders in OpenGVLab's layout are
upstream's documented path: the text model by `llm_config.architectures` (Qwen2ForCausalLM), the
vision tower and `mlp1` by `--mmproj` (class InternVisionModel, projector `internvl`).

One addition, said here because it is the only one: the converter names a BPE tokenizer's
pre-tokenizer (the regex that splits text before merges) by hashing the ids that the tokenizer
gives a fixed text, against a list of known models' hashes; a tokenizer of a vocabulary it has
not seen fails there ("BPE pre-tokenizer was not recognized"), whatever its pre-tokenizer. This
project's checkpoints carry a byte-level BPE of their own vocabulary whose pre-tokenizer is
exactly GPT-2's (tokenizers' ByteLevel(add_prefix_space=False, use_regex=True), no normalizer):
for such a tokenizer, and only then, the name is `gpt-2` (what the converter itself writes for
openai-community/gpt2). That is what convert_hf_to_gguf_update.py does for a new model, decided
from the tokenizer's definition instead of a hash. Any other unrecognised tokenizer still fails.

quantize: libllama's `llama_model_quantize` (what the `llama-quantize` tool calls) with its default
parameters, from the F16 file, as upstream's docs convert then quantize.

Imports inside the functions: the converter is importable only once LLAMA_SRC is on sys.path, and
llama_cpp is the peers' package (`scripts/setup.sh --peers`), needed by quantize alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FTYPES = {"q8_0": 7, "q4_0": 2}      # llama_ftype: LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_0


def is_gpt2_pretokenizer(model_dir: Path) -> bool:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    pre, norm = data.get("pre_tokenizer") or {}, data.get("normalizer")
    return (data.get("model", {}).get("type") == "BPE" and norm is None and pre.get("type") == "ByteLevel"
            and pre.get("add_prefix_space") is False and pre.get("use_regex", True) is True)


def convert(llama_src: str, model_dir: str, out: str, outtype: str, mmproj: bool) -> None:
    src = Path(llama_src)
    sys.path[:0] = [str(src / "gguf-py"), str(src)]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    recognised = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            if is_gpt2_pretokenizer(Path(model_dir)):
                print("convert_gguf: pre-tokenizer ByteLevel(add_prefix_space=False, use_regex=True) -> gpt-2",
                      file=sys.stderr)
                return "gpt-2"
            raise

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", out, "--outtype", outtype] + (
        ["--mmproj"] if mmproj else [])
    convert_hf_to_gguf.main()


def quantize(src: str, out: str, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {out} ({kind}) returned {rc}")


def main(argv: list[str]) -> int:
    if argv[0] == "convert":
        convert(argv[1], argv[2], argv[3], argv[4], "--mmproj" in argv[5:])
    elif argv[0] == "quantize":
        quantize(argv[1], argv[2], argv[3])
    else:
        raise SystemExit(f"unknown step {argv[0]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
