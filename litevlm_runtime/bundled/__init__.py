"""The bundled default model: a small InternVL2.5-layout checkpoint trained on SynthDrive by
`litevlm train vlm` (see <DEFAULT_MODEL>/MODEL_CARD.md). The add-on modules trained on it by
their own commands live in sub-folders of it (view selector, token selector, EAGLE-2 head)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "synthdrive-internvl2_5-v2"
DEFAULT_MODEL = Path(__file__).resolve().parent / DEFAULT_MODEL_NAME
