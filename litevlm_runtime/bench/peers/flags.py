"""The peers study's flag values and the machine line every table starts with (command.py and
decode.py both read them)."""

from __future__ import annotations

import os
from pathlib import Path

ENGINES = ("litevlm", "llama.cpp", "openvino")
GGUF = ("f16", "q8_0", "q4_0")
OPENVINO = ("int8", "int4")
PIPELINES = ("baseline", "litevlm")
WEIGHTS = ("float", "int8", "int4", "int4-rtn", "fp16", "bf16")


def split(value: str | None, default: str) -> list[str]:
    return [v.strip() for v in (value or default).split(",") if v.strip()]


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8"]
    return f"{model}; flags: " + " ".join(f for f in wanted if f in flags) + f"; {os.cpu_count()} CPUs"
