"""The motion network: per cell of the token grid, MOTION_FEATURES numbers of optical flow
(stages/motion.py) -> what is added to the newest frame set's visual token there. Saved beside an
InternVL checkpoint in its `motion/` folder (weights/checkpoint.py), never in its tensors."""

from __future__ import annotations

import torch
from torch import nn

MOTION_FEATURES = 9


class MotionTokens(nn.Module):
    """[..., MOTION_FEATURES] -> [..., D]: what is added to the newest set's visual tokens."""

    def __init__(self, hidden: int, out_features: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(MOTION_FEATURES, hidden), nn.GELU(), nn.Linear(hidden, out_features))
        nn.init.zeros_(self.net[2].weight)        # a new model answers as it did without motion
        nn.init.zeros_(self.net[2].bias)

    def forward(self, motion: torch.Tensor) -> torch.Tensor:
        return self.net(motion.to(self.net[0].weight.dtype))
