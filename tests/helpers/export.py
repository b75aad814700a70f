"""Builders shared by the export, backend and calibration tests: a tiny checkpoint whose random
weights are large enough that greedy answers depend on the input (std 0.02 answers every
question with the same repeated token, which would make "identical answers" prove nothing), and
one exported bundle per test session (export takes seconds per graph)."""

from __future__ import annotations

from pathlib import Path

from litevlm_runtime.engines.buckets import Buckets

MAX_NEW_TOKENS = 12
# Few, small buckets: vision 4 and 6 tiles (3 tiles run padded to 4), one prompt bucket, decode
# steps of 1 row and of an 8-node tree (5-row trees run padded to 8), batched steps of 2 and 4
# queries (the default serving.max_batch; 3 run padded to 4).
TEST_BUCKETS = Buckets(vision=(4, 6), prefill=(256,), step=(1, 8), head=(1, 8), batch=(2, 4))

_cache: dict[str, Path] = {}


def lively_checkpoint(root: Path) -> Path:
    if "model" not in _cache:
        from helpers import make_tiny_checkpoint
        from litevlm_runtime.weights.checkpoint import load_model, write_checkpoint
        from litevlm_runtime.weights.random_init import init_weights

        tiny = make_tiny_checkpoint(root / "tiny-base")
        model = load_model(tiny)
        init_weights(model, seed=1, std=0.1)
        write_checkpoint(root / "tiny-lively", model, tiny / "tokenizer.json")
        _cache["model"] = root / "tiny-lively"
    return _cache["model"]


def exported_bundle(root: Path) -> Path:
    """`litevlm export` of the lively checkpoint through the real command line."""
    if "bundle" not in _cache:
        from litevlm_runtime.cli import main

        model = lively_checkpoint(root)
        spec = ";".join(f"{k}={','.join(map(str, v))}" for k, v in TEST_BUCKETS.to_dict().items())
        out = root / "bundle"
        rc = main(["export", "--model", str(model), "--out", str(out), "--max_new_tokens", str(MAX_NEW_TOKENS),
                   "--buckets", spec])
        assert rc == 0
        _cache["bundle"] = out
    return _cache["bundle"]


# The backends that run the bundle's graphs on the CPU, tested alike against torch.
BUNDLE_BACKENDS = ("onnxruntime", "openvino")


def pipelines(model: Path, bundle: Path, backend: str = "onnxruntime", **settings):
    """(torch pipeline, `backend` pipeline over the bundle) with the same settings."""
    from helpers import options
    from litevlm_runtime.pipeline.pipeline import Pipeline

    torch_pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, **settings))
    bound_pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, backend__name=backend,
                                                         backend__bundle=str(bundle), **settings))
    return torch_pipe, bound_pipe
