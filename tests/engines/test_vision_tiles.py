"""The torch vision engine on the CPU encodes a call's tiles one at a time (engines/torch_engine.TorchVision:
each intermediate a tile's size, reused from the heap): a tile's features are the same whether it came
alone or beside others, and in float32 the same as the encoder over the whole batch up to GEMM blocking."""

from __future__ import annotations

import pytest
import torch
from helpers import options, relative_error

from litevlm_runtime.bench.random_model import random_pipeline


@pytest.mark.parametrize("vision_gemm", ["float32", "int8"])
def test_tiles_alone_or_together_give_the_same_features(vision_gemm):
    pipe = random_pipeline("tiny-qwen3", options(pipeline="baseline", backend__threads=1, backend__weights="int8",
                                                 backend__vision_gemm=vision_gemm))
    rt = pipe.rt
    s = rt.cfg.force_image_size
    pixels = torch.randn(3, 3, s, s, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        together = rt.engines.vision.run(pixels)
        alone = [rt.engines.vision.run(pixels[i:i + 1]) for i in range(3)]
        batched = rt.model.encode_images(pixels, rt.engines.vision.pos_embed)
    assert together.shape == (3, *alone[0].shape[1:])
    assert all(torch.equal(together[i], alone[i][0]) for i in range(3))
    if vision_gemm == "float32":        # (int8's kernels choose their path by the call's rows: not compared)
        assert relative_error(together, batched) <= 1e-5
