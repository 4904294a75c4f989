"""Tile sizes of the Triton kernels, chosen by a cost model fitted to timings on an H200.

The score kernels (forward, backward ds, backward grad) loop over [block_q, block_k, block_h]
tiles of tanh. The model scores a tile (block_q, block_k, block_h, warps) by the time it
predicts, relative to a perfect kernel:

    cost = padding waste x wave inefficiency x per-tanh tile cost

    padding waste      padded Tq x padded Tk x padded H over Tq x Tk x H: padded lanes cost tanh
    wave inefficiency  ceil(programs / slots) x slots / programs, slots = SMs x programs resident
                       per SM (4 for the forward's score tiles, 1 for the grad kernel)
    per-tanh cost      1 + c_q / block_q + c_k / block_k + c_h / block_h: the operand tiles loaded,
                       converted and broadcast per tanh (each query row is reused over block_k
                       keys and each key row over block_q queries), and the per-chunk reduction

The constants are fitted to the first H200 runs of bench/gpu_check.py (2026-12-04, triton 3.6):
every forward candidate of four benchmark shapes (150 tiles, block_q up to 32) and every
grad-kernel tile of two (68), per tanh path (bench/RESULTS.md). The first, physical model (MUFU
ops, issue slots and L2 bytes per tanh, counted from the SASS) ranked 2 x 4 x 512 first for the
bfloat16 training shapes; measured, it ran at half the speed of 16 x 4 x 64: the kernels are bound
by moving operands into the tanh tile, not by the tanh unit, so larger block_q pays although it
pads 50 queries to 64. With the fit, the pick is the measured best tile on 7 of the 12 measured
(shape, dtype, kernel) groups, the others within 20% (tests/ops/test_triton.py checks this against
the recorded timings).

A minimum-programs rule comes first: when some candidate gives every SM a program, those that
leave SMs idle are dropped. The decoding step (Tq = 1) gets block_q = 1 and a one-row GEMV for the
values (no 16-row tl.dot padding). The value products (phase 2) run on their own, larger tiles.
``rank_forward`` / ``rank_grad`` list every candidate with its cost (``bench/gpu_check.py
--wide-sweep`` times them all); rerun that sweep and refit after changing a kernel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_TILE",
    "H200_SMS",
    "TileConfig",
    "backward_configs",
    "forward_config",
    "grad_tile",
    "rank_forward",
    "rank_grad",
    "sweep_forward",
    "tile_cost",
]

DEFAULT_TILE = 4096  # elements of the [BLOCK_Q, BLOCK_K, BLOCK_H] tanh tile at 4 warps (32/thread)
DEFAULT_NUM_WARPS = 4
H200_SMS = 132
MUFU_PER_CLOCK, ISSUE_PER_CLOCK = 16, 128  # lanes per clock per SM (Hopper)
# (c_q, c_k, c_h) of the per-tanh cost per tanh path, and programs resident per SM: the fit to the
# H200 sweeps (module doc). approx / packed: float16 and bfloat16; product / exp: float32.
FORWARD_FIT = {"approx": (2.0, 0.0, -4.0), "product": (4.0, 2.0, 4.0)}
GRAD_FIT = {"approx": (0.5, 0.0, 0.0), "product": (0.0, 2.0, 4.0)}
FORWARD_RESIDENT, GRAD_RESIDENT = 4, 1
MAX_BLOCK_Q = 32


@dataclass(frozen=True)
class TileConfig:
    """Block sizes of one kernel launch (powers of two).

    Score kernels (forward, backward ds): block_q x block_k x block_h is the tanh tile; the
    softmax-weighted products (context, dO . values) use their own tile of rows2 x block_k2 keys x
    block_dv: a tl.dot with rows2 = max(16, block_q) rows (rows past block_q are masked), or at
    block_q = 1 a one-row GEMV (rows2 = 1, broadcast multiply-sum).
    Grad kernel: block_q x block_k x block_h. Grad-values kernel: block_k keys x block_dv values
    per program, block_q queries per step.
    """

    block_q: int
    block_k: int
    block_h: int
    block_dv: int
    num_warps: int = DEFAULT_NUM_WARPS
    block_k2: int = 32

    @property
    def use_dot(self) -> bool:
        # tl.dot needs every dimension >= 16; one query row is a GEMV, not a padded 16-row dot.
        return self.block_q > 1 and min(self.block_k2, self.block_dv) >= 16

    @property
    def rows2(self) -> int:
        return max(16, self.block_q) if self.use_dot else self.block_q


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _padding(n: int, block: int) -> float:
    n = max(1, int(n))
    return (-(-n // block) * block) / n


def _wave_factor(programs: int, slots: int) -> float:
    """Busiest slot's programs over the average: 1.0 when programs spread evenly."""
    programs = max(1, programs)
    return math.ceil(programs / slots) * slots / programs


def tile_cost(mode: str, block_q: int, block_k: int, block_h: int, grad: bool = False) -> float:
    """Per-tanh cost of a tile, relative (see the module doc)."""
    fit = GRAD_FIT if grad else FORWARD_FIT
    c_q, c_k, c_h = fit["approx" if mode in ("approx", "packed") else "product"]
    return 1.0 + c_q / block_q + c_k / block_k + c_h / block_h


def _default_mode(dtype: torch.dtype | None) -> str:
    return "approx" if dtype in (torch.float16, torch.bfloat16) else "product"


def _candidates(num_queries: int, num_keys: int, hidden: int, tile: int, max_q: int = MAX_BLOCK_Q,
                max_h: int = 512):  # fmt: skip
    """(block_q, block_k, block_h) with at most ``tile`` elements, block_k >= 4 (vector score
    stores), min(16, H) <= block_h <= max_h (some H loop left to overlap loads with tanh)."""
    cap_q = min(max_q, _pow2_at_least(num_queries))
    cap_k = max(4, min(128, _pow2_at_least(num_keys)))
    cap_h = min(max_h, _pow2_at_least(hidden))
    block_q = 1
    while block_q <= cap_q:
        block_k = 4
        while block_k <= cap_k and block_q * block_k * min(16, cap_h) <= tile:
            yield block_q, block_k, min(cap_h, tile // (block_q * block_k))
            block_k *= 2
        block_q *= 2


def _rank(costs: list[tuple[TileConfig, float, int]], sms: int) -> list[tuple[TileConfig, float]]:
    """Minimum-programs rule, then cost (ties: larger block_h, fewer programs)."""
    if any(programs >= sms for _, _, programs in costs):
        costs = [entry for entry in costs if entry[2] >= sms]
    costs = [(cfg, round(cost, 6), programs) for cfg, cost, programs in costs]
    costs.sort(key=lambda e: (e[1], -e[0].block_h, e[2]))
    return [(cfg, cost) for cfg, cost, _ in costs]


def rank_forward(batch: int, num_queries: int, num_keys: int, hidden: int, value_dim: int,
                 dtype: torch.dtype | None = None, sms: int = H200_SMS, mode: str | None = None,
                 tile: int = DEFAULT_TILE, max_q: int = MAX_BLOCK_Q,
                 ) -> list[tuple[TileConfig, float]]:  # fmt: skip
    """Every forward / backward-ds tile candidate with its predicted cost, best first."""
    mode = mode or _default_mode(dtype)
    k2, dv = _phase2_tiles(value_dim, dtype, num_queries)
    costs = []
    for block_q, block_k, block_h in _candidates(num_queries, num_keys, hidden, tile, max_q):
        programs = batch * -(-max(1, num_queries) // block_q)
        cost = (_padding(num_queries, block_q) * _padding(num_keys, block_k)
                * _padding(hidden, block_h) * _wave_factor(programs, sms * FORWARD_RESIDENT)
                * tile_cost(mode, block_q, block_k, block_h))  # fmt: skip
        costs.append((TileConfig(block_q, block_k, block_h, dv, block_k2=k2), cost, programs))
    return _rank(costs, sms)


def sweep_forward(batch: int, num_queries: int, num_keys: int, hidden: int, value_dim: int,
                  dtype: torch.dtype | None = None, sms: int = H200_SMS,
                  count: int = 4) -> list[tuple[TileConfig, float]]:  # fmt: skip
    """What a tile sweep should time: the best candidate of each block_q (up to ``count``), the
    model's choice first, so a GPU run checks the model where it is least sure."""
    best: dict[int, tuple[TileConfig, float]] = {}
    for cfg, cost in rank_forward(batch, num_queries, num_keys, hidden, value_dim, dtype, sms):
        best.setdefault(cfg.block_q, (cfg, cost))
    return sorted(best.values(), key=lambda entry: entry[1])[:count]


def _phase2_tiles(value_dim: int, dtype: torch.dtype | None, num_queries: int) -> tuple[int, int]:
    """(block_k2, block_dv) of the value products: tensor-core tiles for float16 / bfloat16, exact
    FMA tiles for float32 (a 32 x 64 float32 dot spills at sm_90), a 1-row GEMV at Tq = 1."""
    dv_cap = _pow2_at_least(max(16, value_dim))
    if num_queries <= 1:
        return 16, min(256, dv_cap)
    if dtype in (torch.float16, torch.bfloat16):  # 16 x 64 x 128 took 192 registers (triton 3.6)
        return 64, min(64, dv_cap)
    return 16, min(32, dv_cap)


@functools.lru_cache(maxsize=4096)  # ranking costs ~0.1 ms a call; shapes repeat
def forward_config(num_queries: int, num_keys: int, hidden: int, value_dim: int,
                   tile: int = DEFAULT_TILE, dtype: torch.dtype | None = None,
                   batch: int = 4 * H200_SMS, sms: int = H200_SMS,
                   mode: str | None = None) -> TileConfig:  # fmt: skip
    """Tiles for the forward and the backward-ds kernels: the cheapest of :func:`rank_forward`.

    ``batch`` matters only through the wave and minimum-programs terms (the launcher passes it);
    ``mode``: the tanh path (default: the dtype's).
    """
    ranked = rank_forward(batch, num_queries, num_keys, hidden, value_dim, dtype, sms, mode, tile)
    return ranked[0][0]


def rank_grad(batch: int, num_queries: int, num_keys: int, hidden: int,
              dtype: torch.dtype | None = None, sms: int = H200_SMS,
              mode: str | None = None) -> list[tuple[TileConfig, float]]:  # fmt: skip
    """Grad-kernel tiles (one program per batch x H chunk) with their predicted cost, best first."""
    mode = mode or _default_mode(dtype)
    costs = []
    for block_q, block_k, block_h in _candidates(num_queries, num_keys, hidden, DEFAULT_TILE, 8):
        programs = batch * -(-max(1, hidden) // block_h)
        cost = (_padding(num_queries, block_q) * _padding(num_keys, block_k)
                * _padding(hidden, block_h) * _wave_factor(programs, sms * GRAD_RESIDENT)
                * tile_cost(mode, block_q, block_k, block_h, grad=True))  # fmt: skip
        costs.append((TileConfig(block_q, block_k, block_h, 1), cost, programs))
    return _rank(costs, sms)


@functools.lru_cache(maxsize=4096)  # ranking costs ~0.1 ms a call; shapes repeat
def grad_tile(batch: int, num_queries: int, num_keys: int, hidden: int,
              dtype: torch.dtype | None = None, sms: int = H200_SMS,
              mode: str | None = None) -> tuple[int, int, int]:  # fmt: skip
    """(BLOCK_Q, BLOCK_K, BLOCK_H) of the grad kernel: the cheapest of :func:`rank_grad`."""
    cfg = rank_grad(batch, num_queries, num_keys, hidden, dtype, sms, mode)[0][0]
    return cfg.block_q, cfg.block_k, cfg.block_h


@functools.lru_cache(maxsize=4096)  # ranking costs ~0.1 ms a call; shapes repeat
def backward_configs(batch: int, num_queries: int, num_keys: int, hidden: int, value_dim: int,
                     tile: int = DEFAULT_TILE, dtype: torch.dtype | None = None,
                     sms: int = H200_SMS, mode: str | None = None,
                     ) -> tuple[TileConfig, TileConfig, TileConfig]:  # fmt: skip
    """Tiles for the ds kernel, the grad kernel (batch x H chunk) and the grad-values kernel."""
    ds_cfg = forward_config(num_queries, num_keys, hidden, value_dim, tile, dtype, batch, sms, mode)
    grad_cfg = TileConfig(*grad_tile(batch, num_queries, num_keys, hidden, dtype, sms, mode), 1)
    # grad values = p^T dO on tl.dot tiles (padding costs tensor-core work only).
    dvalues_cfg = TileConfig(
        max(16, min(32, _pow2_at_least(num_queries))),
        max(16, min(64, _pow2_at_least(num_keys))),
        1,
        max(16, min(64, _pow2_at_least(value_dim))),
    )
    return ds_cfg, grad_cfg, dvalues_cfg
