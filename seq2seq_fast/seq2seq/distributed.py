"""Distributed set-up (DDP through torchrun) and the few collectives the training loop needs."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup_distributed() -> Dist:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return Dist(0, 1, device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def synced_elapsed(started: float, ctx: Dist) -> float:
    """Seconds since ``started``; under DDP the maximum over ranks, so all ranks agree."""
    elapsed = time.perf_counter() - started
    if not ctx.enabled:
        return elapsed
    value = torch.tensor([elapsed], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def log(message: str, rank: Dist) -> None:
    if rank.is_main:
        from tqdm import tqdm

        tqdm.write(message, file=sys.stdout)


def max_over_ranks(ctx: Dist, values: list[float]) -> list[float]:
    """``values`` unchanged in one process; under DDP the elementwise maximum over ranks."""
    if not ctx.enabled:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
