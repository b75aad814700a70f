"""What a trained module records about how it was made: the data's hash and generator settings,
and the command line that repeats the run."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from ..weights.integrity import sha256_file


def data_provenance(data: Path) -> dict:
    """What the training data was: its hash, and the generator's settings when it left them."""
    info = {"file": str(data), "sha256": sha256_file(data)}
    for name in ("synthdrive.json", "synth.json", "meta.json"):
        meta = Path(data).parent / name
        if meta.is_file():
            try:
                info["generator"] = json.loads(meta.read_text())
            except json.JSONDecodeError:
                pass
            break
    return info


def reproduce_command(args, trainer: str, skip: tuple[str, ...] = (), repeated: tuple[str, ...] = ()) -> str:
    """The `litevlm train TRAINER` command line that repeats this run, every setting spelled out:
    a flag set to True as the bare flag, a list-valued option (`repeated`) once per item, a list
    item joined with commas; options in `skip` (unused by this run) and unset ones left out."""
    parts = ["litevlm", "train", trainer]
    for k, v in vars(args).items():
        if k in ("func", "command", "trainer") + skip or v is None or v is False:
            continue
        flag = f"--{k.replace('_', '-')}"
        if v is True:
            parts.append(flag)
            continue
        for item in v if k in repeated else [v]:
            parts += [flag, shlex.quote(",".join(item) if isinstance(item, list) else str(item))]
    return " ".join(parts)
