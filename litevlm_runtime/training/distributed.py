"""Single-process or torchrun/DDP: the same training script runs either way.

Under `torchrun` (WORLD_SIZE set) the process group is initialized (NCCL on GPUs, gloo on the
CPU), each rank takes its shard of the samples, DDP averages gradients, and only rank 0 writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.world == 1:
            return module

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)

    def shard(self, items: list) -> list:
        return items[self.rank::self.world]

    def mean(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / self.world

    def log(self, *parts) -> None:
        """Progress lines from rank 0 only (every rank runs the same loop)."""
        if self.rank == 0:
            print(*parts, flush=True)

    def close(self) -> None:
        """Leave the process group together. Rank 0 keeps working after training (evaluation,
        writing); a rank that tore its gloo group down meanwhile and exited could abort
        ("terminate called without an active exception") while the peer's connection was open,
        failing the whole torchrun. So every rank waits here for the others first."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def setup(device: str | None = None) -> Dist:
    """Initialize the process group when launched by torchrun. `device` pins the device (a CPU
    trainer passes "cpu": then the ranks talk over gloo even where a GPU exists); by default a GPU
    is used when there is one (one per local rank, NCCL), else the CPU (gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device:
        dev = torch.device(device)
    elif torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        dev = torch.device("cpu")
    if world == 1:
        return Dist(device=dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # The other ranks wait in close() while rank 0 evaluates and writes after training; the
    # default 30-minute collective timeout is shorter than a full `train vlm` evaluation.
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(hours=3))
    return Dist(dist.get_rank(), dist.get_world_size(), dev)


def threads_per_rank() -> int:
    """The machine's cores divided among the local ranks: more threads than free cores makes
    OpenMP workers spin against each other."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return max(1, (os.cpu_count() or 1) // local)
