"""PyTorch engines: the model's own modules, eager (on a GPU, see cuda_graph.py for capture)."""

from __future__ import annotations


from .base import Engines, StageEngine


class TorchVision(StageEngine):
    stage, backend = "vision", "torch"

    def __init__(self, model, pos_embed):
        self.model, self.pos_embed = model, pos_embed

    def run(self, pixels):
        return self.model.encode_images(pixels, self.pos_embed)


class TorchDecoder(StageEngine):
    stage, backend = "decoder", "torch"

    def __init__(self, lm):
        self.lm = lm

    def run(self, embeds, positions, slots, mask, k_cache, v_cache):
        return self.lm(embeds, positions, slots, mask, k_cache, v_cache)


class TorchHead(StageEngine):
    stage, backend = "head", "torch"

    def __init__(self, lm):
        self.lm = lm

    def run(self, hidden):
        return self.lm.head(hidden)


def torch_engines(pipeline) -> Engines:
    return Engines(
        vision=TorchVision(pipeline.model, pipeline.pos_embed),
        decoder=TorchDecoder(pipeline.lm),
        head=TorchHead(pipeline.lm),
    )
