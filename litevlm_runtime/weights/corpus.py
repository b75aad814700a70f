"""A small English driving corpus for the tokenizer of the project's own checkpoints, used when no
training text is given. Trained on real data later (SynthDrive / DriveLM QA), this is only the
fallback that keeps `make-checkpoint` self-contained."""

from __future__ import annotations

from ..cameras import CAMERAS

_WORDS = (
    "the ego vehicle car truck bus pedestrian cyclist barrier traffic light red green yellow "
    "front back left right rear behind ahead moving parked stopped going straight turning slowly fast "
    "what is are there any how many which should do avoid keep lane brake accelerate yes no "
    "white black blue silver grey orange of in on to a an and important objects scene status"
).split()


def default_corpus() -> list[str]:
    lines = [" ".join(_WORDS[i:i + 9]) for i in range(0, len(_WORDS), 3)]
    lines += [f"{cam}: " for cam in CAMERAS]
    lines += [f"<c{i},{cam},{x}.{i}, {y}.5>" for i, cam in enumerate(CAMERAS) for x, y in ((800, 450), (123, 789))]
    lines += [
        "A. Going ahead. B. Turn left. C. Turn right. D. Stopped.",
        "What are the important objects in the current scene?",
    ]
    return lines * 4
