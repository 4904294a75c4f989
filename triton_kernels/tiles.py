"""Tile sizes of the Triton kernels: which block shapes each launch uses, and why.

The score kernels' cost is tanh evaluations, so padding (a tile past the end of Tq, Tk or H) is
paid in tanh; the value products run on tl.dot tiles whose padding costs tensor-core work only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_TILE", "TileConfig", "backward_configs", "forward_config", "grad_tile"]

# Elements of the [BLOCK_Q, BLOCK_K, BLOCK_H] tanh tile a program holds at once (4 warps: 32 a thread).
DEFAULT_TILE = 4096
DEFAULT_NUM_WARPS = 4


@dataclass(frozen=True)
class TileConfig:
    """Block sizes of one kernel launch (powers of two).

    Score kernels (forward, backward ds): block_q x block_k x block_h is the tanh tile; the
    softmax-weighted products (context, dO . values) use their own tile of rows2 x block_k2 keys x
    block_dv, with rows2 >= 16 so that tl.dot applies (rows past block_q are masked).
    Grad-values kernel: block_k keys x block_dv values per program, block_q queries per step.
    """

    block_q: int
    block_k: int
    block_h: int
    block_dv: int
    num_warps: int = DEFAULT_NUM_WARPS
    block_k2: int = 32

    @property
    def use_dot(self) -> bool:
        # tl.dot needs every dimension >= 16; smaller tiles use a broadcast multiply-sum.
        return min(self.block_k2, self.block_dv) >= 16

    @property
    def rows2(self) -> int:
        return max(16, self.block_q) if self.use_dot else self.block_q


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _pick_block(n: int, cap: int, max_waste: float = 0.125) -> int:
    """Largest power of two <= cap whose padding of n wastes at most max_waste of the work.

    Padding is paid in tanh evaluations, the kernel's bottleneck, so a smaller tile that fits n
    beats a large half-empty one (e.g. Tk=66 -> 8, not 128; Tq=50 -> 8; Tq=1 -> 1).
    """
    n = max(1, int(n))
    block = min(_pow2_at_least(n), max(1, int(cap)))
    # Below 4 the padding of a tiny size costs nothing worth the extra loop trips.
    floor = min(block, 4)
    while block > floor:
        padded = -(-n // block) * block
        if (padded - n) <= max_waste * padded:
            return block
        block //= 2
    return floor


def forward_config(
    num_queries: int,
    num_keys: int,
    hidden: int,
    value_dim: int,
    tile: int = DEFAULT_TILE,
    dtype: torch.dtype | None = None,
) -> TileConfig:
    """Tiles for the forward and the backward-ds kernels (one program per batch x query tile).

    BLOCK_Q <= 16 rows share each loaded key tile; BLOCK_K fills what the query rows leave of
    ~256 (query x key) pairs, so the one-query decoding step spreads its lanes over keys and H
    (Tq=1, Tk=66, H=1024 -> [1, 8, 512]) instead of idling 15 of 16 query rows.
    """
    block_q = _pick_block(num_queries, 16)
    block_k = _pick_block(num_keys, max(16, 256 // block_q))
    block_h = _pick_block(hidden, max(16, tile // (block_q * block_k)))
    # The products with values run on tl.dot tiles (padding costs tensor-core work only): wider
    # for float16 / bfloat16 (tensor cores), narrower for float32, whose exact FMA dot would
    # otherwise spill registers (bench/triton_aot_report.py).
    low_precision = dtype in (torch.float16, torch.bfloat16)
    block_k2 = 32 if low_precision else 16
    block_dv = max(16, min(64 if low_precision else 32, _pow2_at_least(value_dim)))
    return TileConfig(block_q, block_k, block_h, block_dv, block_k2=block_k2)


# Grad-kernel tiles (BLOCK_Q, BLOCK_K, BLOCK_H) of 4096 elements (4 warps) and their cost in
# issued instructions per tanh in the innermost loop, read off the sm_90 SASS that
# bench/triton_aot_report.py prints (triton 3.9, bf16; float32 costs 1.2-1.3x, same order). A
# static proxy, not a timing: it favours wide key tiles because the replicated loads of ds and q
# and the grad-query update are paid once per query tile. Rerun the report (and time them on a
# GPU) after changing the kernel.
_GRAD_TILE_COSTS = (
    ((4, 32, 32), 9.2),
    ((1, 8, 512), 10.3),
    ((8, 16, 32), 10.4),
    ((4, 64, 16), 10.4),
    ((8, 32, 16), 10.6),
    ((1, 16, 256), 10.6),
    ((2, 8, 256), 11.2),
    ((16, 16, 16), 13.0),
    ((4, 8, 128), 14.3),
    ((8, 8, 64), 16.9),
)


def _padding(n: int, block: int) -> float:
    n = max(1, int(n))
    return (-(-n // block) * block) / n


def grad_tile(batch: int, num_queries: int, num_keys: int, hidden: int, min_programs: int = 512):
    """(BLOCK_Q, BLOCK_K, BLOCK_H) of the grad kernel: least instructions per useful tanh.

    Cost = instructions per tanh of the tile (_GRAD_TILE_COSTS) x the padding it adds to Tq and
    Tk (padded rows cost tanh too) x how far its batch x H-chunk grid falls short of
    ``min_programs`` (a GPU with idle SMs). Tq=Tk=50 -> (4, 32, 32); Tq=74, Tk=75 -> (8, 16, 32);
    the decoding step (Tq=1, Tk=66, B=1280) -> (1, 8, 512).
    """

    def cost(item):
        (block_q, block_k, block_h), per_tanh = item
        programs = batch * -(-hidden // min(block_h, _pow2_at_least(hidden)))
        shortfall = max(1.0, min_programs / max(1, programs))
        padding = _padding(num_queries, block_q) * _padding(num_keys, block_k)
        return per_tanh * padding * shortfall

    (block_q, block_k, block_h), _ = min(_GRAD_TILE_COSTS, key=cost)
    return block_q, block_k, min(block_h, _pow2_at_least(hidden))


def backward_configs(
    batch: int,
    num_queries: int,
    num_keys: int,
    hidden: int,
    value_dim: int,
    tile: int = DEFAULT_TILE,
    min_programs: int = 512,
    dtype: torch.dtype | None = None,
) -> tuple[TileConfig, TileConfig, TileConfig]:
    """Tiles for the ds kernel, the grad kernel (batch x H chunk) and the grad-values kernel."""
    ds_cfg = forward_config(num_queries, num_keys, hidden, value_dim, tile, dtype)
    grad_cfg = TileConfig(*grad_tile(batch, num_queries, num_keys, hidden, min_programs), 1)
    # grad values = p^T dO on tl.dot tiles (padding costs tensor-core work only).
    dvalues_cfg = TileConfig(
        max(16, min(32, _pow2_at_least(num_queries))),
        max(16, min(64, _pow2_at_least(num_keys))),
        1,
        max(16, min(64, _pow2_at_least(value_dim))),
    )
    return ds_cfg, grad_cfg, dvalues_cfg
