"""What /proc/cpuinfo says about this CPU: its vendor and instruction-set flags. Read here because
torch exposes neither (torch.backends.cpu.get_cpu_capability stops at "AVX512"), and two choices
depend on them: whether bfloat16 GEMMs run natively (bf16.py) and which float32 GEMM kernel
`backend.gemm auto` picks (gemm.py)."""

from __future__ import annotations


def read_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str, list[str]] | None:
    """(vendor_id, flags) of the first processor listed; None where the file cannot be read (not Linux)."""
    vendor, flags = "", []
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].split()
                if vendor and flags:
                    break
    except OSError:
        return None
    return vendor, flags
