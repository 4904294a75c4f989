"""Triton kernels for fused additive (Bahdanau) attention, the CUDA backend of the op.

    e[b,t,s]   = sum_h v[h] * tanh(query[b,t,h] + keys[b,s,h] + bias[h])
    p[b,t,:]   = softmax of e[b,t,:] over the valid keys (masked keys get exactly 0)
    ctx[b,t,:] = sum_s p[b,t,s] * values[b,s,:]

Installed as ``seq2seq_fast._triton.additive_attention``; ``seq2seq_fast.ops.additive_attention`` registers the two
launchers as the CUDA kernels of ``seq2seq_fast::additive_attention_fwd`` / ``_bwd``. Under
``TRITON_INTERPRET=1`` the same launchers run on CPU tensors through Triton's interpreter (tests).

Kernels (the [B, Tq, Tk, H] tensor is never written anywhere; scratch is O(B*Tq*Tk)):
    _additive_attention_fwd_kernel   one program per (batch, query tile). Phase 1 loops over key
        tiles, and inside over H chunks, building the [BLOCK_Q, BLOCK_K] score tile from a
        [BLOCK_Q, BLOCK_K, BLOCK_H] tanh tile in registers; masks it; keeps an online max/sum
        (flash-attention style) and parks the raw scores in an fp32 scratch [B, Tq, Tk]. Phase 2
        (same program, after a barrier) normalises with lse = max + log(sum), optionally writes
        the weights, and accumulates the context over Dv chunks. Two phases instead of a single
        rescaled accumulator because Dv is often 1024: a [BLOCK_Q, Dv] fp32 accumulator does not
        fit in registers, while re-reading the scores costs Tk floats per row, next to Tk*H tanh.
    _additive_attention_bwd_ds_kernel   per (batch, query tile): recomputes the scores (Tk*H tanh
        per row), p = exp(s - lse), dp = dO . values + dWeights, delta = sum_s p*dp, and writes
        p and ds = p * (dp - delta) to fp32 scratch [B, Tq, Tk].
    _additive_attention_bwd_grad_kernel  per (batch, H chunk): recomputes u = tanh(...) once more
        and reduces g = ds * (1 - u^2) over queries (grad keys, in registers), over keys (grad
        query, a read-modify-write of an fp32 buffer this program alone owns) and ds*u over both
        (grad v, one partial row per program, summed by torch). grad bias = sum of the fp32 grad
        query over (b, t) because d(pre)/d(bias) = d(pre)/d(query).
    _additive_attention_bwd_dvalues_kernel  per (batch, key tile, Dv tile): grad values = p^T dO.
    Backward costs 2 * B*Tq*Tk*H tanh; no float atomics anywhere, so results are bitwise
    reproducible run to run. Index arithmetic is int32 unless some tensor spans 2^31 elements
    (needs_int64_offsets), then int64 throughout (constexpr INT64_OFFSETS).

tanh paths (constexpr TANH_MODE; tanh_probe() evaluates each one alone):
    "product"  tanh(a + b) = 1 - 2 / (1 + e^{2a} e^{2b}) with a = q + bias, b = k: the two
               exponentials are taken on the 2D operand tiles and shared by the other operand's
               rows, so each tanh costs one FMA and one reciprocal (rcp.approx.ftz.f32, one MUFU
               op, <= 1 ulp) - the MUFU cost of tanh.approx at float32 accuracy. A score becomes
               sum_h v - 2 sum_h v r. Operands are clamped to +-43 before exponentiation (finite,
               nonzero factors: no inf * 0); a tile whose operands exceed +-34 on both sides,
               where the clamp could change a result, is recomputed with the "exp" path (never
               on sane data; tested on crafted inputs). Error: a few float32 ulps of 1, absolute
               (measured <= 1.8e-7 under the interpreter; bench/gpu_check.py measures the GPU).
               The 2D exponentials add (1/BLOCK_Q + 1/BLOCK_K) MUFU ops per tanh, which matters at
               BLOCK_Q = 1 (the decoding step): there "approx" is cheaper, and both are bound by
               reading the keys anyway.
    "approx"   PTX tanh.approx.f32: one MUFU op per tanh, CUDA only. Maximum relative error
               2^-10.987 (~4.9e-4) per the PTX ISA; bench/gpu_check.py measures it.
    "exp"      tanh|x| = (1 - t) / (1 + t), t = exp(-2|x|), sign restored, and the odd Taylor
               series to x^7 for |x| < 0.125 where 1 - t cancels. Absolute error <= ~1e-7, relative
               <= ~5e-7 under the interpreter. Two MUFU ops and ~17 FP32 ops per tanh on the GPU:
               the slow exact fallback of "product".
    Default ("auto"): "approx" for float16 / bfloat16 on CUDA (their input rounding, 2^-11 and
    2^-8, is as coarse), "product" for float32 (results within ~1e-5 of the reference) and under
    the interpreter (no inline PTX there; "approx" falls back to "product"). Override with
    SEQ2SEQ_FAST_TANH=auto|approx|product|exp, read at every call.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "TANH_MODES",
    "TileConfig",
    "additive_attention_bwd",
    "additive_attention_fwd",
    "backward_configs",
    "forward_config",
    "grad_tile",
    "is_interpreted",
    "needs_int64_offsets",
    "tanh_mode",
    "tanh_probe",
]

TANH_MODES = ("auto", "approx", "product", "exp")
TANH_ENV = "SEQ2SEQ_FAST_TANH"
_TANH_CODES = {"exp": 0, "approx": 1, "product": 2}  # the kernels' TANH_MODE constexpr
# Product path: each operand of tanh(a + b) is clamped to +-PAIR_CLAMP before exponentiation; a
# tile is recomputed exactly unless that cannot matter (see _pair_clamp_may_matter).
PAIR_CLAMP = tl.constexpr(43.0)
PAIR_SAFE_OTHER = tl.constexpr(34.0)
SUM_ABS_V_LIMIT = tl.constexpr(1.0e37)  # FLT_MAX / 34: sum_h v - 2 sum_h v r cannot overflow
# Elements of the [BLOCK_Q, BLOCK_K, BLOCK_H] tanh tile a program holds at once (4 warps: 32 a thread).
DEFAULT_TILE = 4096
DEFAULT_NUM_WARPS = 4


# --- device helpers --------------------------------------------------------------------------------


@triton.jit
def _rcp(x, FAST_RCP: tl.constexpr):
    """1 / x: one MUFU op (rcp.approx.ftz.f32, max error 1 ulp) on the GPU, a division elsewhere."""
    if FAST_RCP:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / x


@triton.jit
def _clamp_pair_operand(x2):
    """2x clamped to +-2 PAIR_CLAMP; NaN stays NaN (tl.minimum / tl.maximum would drop it)."""
    return tl.clamp(x2, -2.0 * PAIR_CLAMP, 2.0 * PAIR_CLAMP, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _tanh(x, TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr):
    """Elementwise tanh of a float32 tensor; the module docstring gives each path's error bound."""
    if TANH_MODE == 1:  # approx
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    elif TANH_MODE == 2:  # product (here with the second factor 1: exp(2x) = e^{2x} * e^0)
        e = tl.exp(_clamp_pair_operand(2.0 * x))
        return 1.0 - 2.0 * _rcp(e + 1.0, FAST_RCP)
    else:  # exp
        ax = tl.abs(x)
        t = tl.exp(-2.0 * ax)
        y = (1.0 - t) / (1.0 + t)
        # Near 0, 1 - t cancels; the odd Taylor series to x^7 is exact to < 2e-9 relative there.
        x2 = x * x
        series = x + x * x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0)))
        return tl.where(ax < 0.125, series, tl.where(x < 0.0, -y, y))


@triton.jit
def _pair_factors(a, b, FAST_RCP: tl.constexpr):
    """r = 1 / (1 + e^{2a} e^{2b}) for a [M, H] and b [N, H] -> [M, N, H]; tanh(a + b) = 1 - 2r.

    The exponentials are taken on the 2D operands (amortised over the other operand's rows), so
    each 3D element costs one FMA and one reciprocal. Each operand is clamped to +-PAIR_CLAMP
    (both exponentials stay finite and nonzero: never inf * 0); the callers recompute exactly
    where that clamp could change a result (see _pair_clamp_may_matter).
    """
    ea = tl.exp(_clamp_pair_operand(2.0 * a))
    eb = tl.exp(_clamp_pair_operand(2.0 * b))
    return _rcp(ea[:, None, :] * eb[None, :, :] + 1.0, FAST_RCP)


@triton.jit
def _pair_clamp_may_matter(max_abs_a, max_abs_b):
    """Whether clamping both operands to +-43 could change some tanh(a + b) in float32.

    It cannot when neither is clamped (e^{+-86} are normal floats: a product overflows to inf or
    underflows to 0 only where tanh is +-1 in float32), nor when only |a| > 43 while |b| <= 34
    (or the reverse): a + b and the clamped sum then lie on the same side of +-9, past which
    tanh is within one ulp of +-1.
    """
    larger = tl.maximum(max_abs_a, max_abs_b)
    smaller = tl.minimum(max_abs_a, max_abs_b)
    return (larger > PAIR_CLAMP) & (smaller > PAIR_SAFE_OTHER)


@triton.jit
def _index(offsets, INT64_OFFSETS: tl.constexpr):
    """Offsets for address arithmetic: int64 when some tensor spans 2^31 elements, else int32."""
    if INT64_OFFSETS:
        return offsets.to(tl.int64)
    else:
        return offsets


@triton.jit
def _tanh_probe_kernel(
    x_ptr, y_ptr, n, TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, _tanh(x, TANH_MODE, FAST_RCP), mask=offs < n)


def tanh_probe(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The kernels' tanh path ``mode`` (approx / product / exp) on a float32 tensor, elementwise."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        with _on_device(x.device):
            _tanh_probe_kernel[(triton.cdiv(x.numel(), 1024),)](
                x,
                y,
                x.numel(),
                TANH_MODE=_TANH_CODES[mode],
                FAST_RCP=_fast_rcp(),
                BLOCK=1024,
                enable_fp_fusion=True,
            )
    return y


@triton.jit
def _score_tile_direct(
    query_rows_ptr,
    keys_rows_ptr,
    v_ptr,
    bias_ptr,
    q_in,
    k_in,
    hidden,
    stride_query_h,
    stride_keys_h,
    stride_v_h,
    stride_bias_h,
    TANH_MODE: tl.constexpr,
    FAST_RCP: tl.constexpr,
    INT64_OFFSETS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Scores with an elementwise tanh of q + k + bias (the approx and exp paths)."""
    # Accumulate in 3D and reduce over h once at the end: one cross-lane reduction per key tile
    # instead of one per H chunk.
    acc = tl.zeros((BLOCK_Q, BLOCK_K, BLOCK_H), dtype=tl.float32)
    for h_start in range(0, hidden, BLOCK_H):
        offs_h = h_start + tl.arange(0, BLOCK_H)
        h_in = offs_h < hidden
        idx_h = _index(offs_h, INT64_OFFSETS)
        q = tl.load(
            query_rows_ptr + idx_h[None, :] * stride_query_h,
            mask=q_in & h_in[None, :],
            other=0.0,
        ).to(tl.float32)
        k = tl.load(
            keys_rows_ptr + idx_h[None, :] * stride_keys_h, mask=k_in & h_in[None, :], other=0.0
        ).to(tl.float32)
        bias = tl.load(bias_ptr + idx_h * stride_bias_h, mask=h_in, other=0.0).to(tl.float32)
        # v = 0 on padded h, so padded lanes add nothing.
        v = tl.load(v_ptr + idx_h * stride_v_h, mask=h_in, other=0.0).to(tl.float32)
        pre = (q + bias[None, :])[:, None, :] + k[None, :, :]
        acc += v[None, None, :] * _tanh(pre, TANH_MODE, FAST_RCP)
    return tl.sum(acc, axis=2)


@triton.jit
def _score_tile(
    query_rows_ptr,  # [BLOCK_Q, 1] pointers to query[b, t, 0]
    keys_rows_ptr,  # [BLOCK_K, 1] pointers to keys[b, s, 0]
    v_ptr,
    bias_ptr,
    q_in,  # [BLOCK_Q, 1] bool: t < Tq
    k_in,  # [BLOCK_K, 1] bool: s < Tk
    hidden,
    stride_query_h,
    stride_keys_h,
    stride_v_h,
    stride_bias_h,
    TANH_MODE: tl.constexpr,
    FAST_RCP: tl.constexpr,
    INT64_OFFSETS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Scores [BLOCK_Q, BLOCK_K] = sum_h v[h] tanh(q[t,h] + k[s,h] + bias[h]), fp32, unmasked."""
    if TANH_MODE == 2:
        # sum_h v tanh(a + b) = sum_h v - 2 sum_h v r,  r = 1 / (1 + e^{2a} e^{2b}).
        acc = tl.zeros((BLOCK_Q, BLOCK_K, BLOCK_H), dtype=tl.float32)
        v_total = tl.zeros((BLOCK_H,), dtype=tl.float32)
        v_abs_total = tl.zeros((BLOCK_H,), dtype=tl.float32)
        max_abs_q = tl.zeros((BLOCK_Q,), dtype=tl.float32)
        max_abs_k = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for h_start in range(0, hidden, BLOCK_H):
            offs_h = h_start + tl.arange(0, BLOCK_H)
            h_in = offs_h < hidden
            idx_h = _index(offs_h, INT64_OFFSETS)
            q = tl.load(
                query_rows_ptr + idx_h[None, :] * stride_query_h,
                mask=q_in & h_in[None, :],
                other=0.0,
            ).to(tl.float32)
            k = tl.load(
                keys_rows_ptr + idx_h[None, :] * stride_keys_h,
                mask=k_in & h_in[None, :],
                other=0.0,
            ).to(tl.float32)
            bias = tl.load(bias_ptr + idx_h * stride_bias_h, mask=h_in, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + idx_h * stride_v_h, mask=h_in, other=0.0).to(tl.float32)
            a = q + bias[None, :]
            acc += v[None, None, :] * _pair_factors(a, k, FAST_RCP)
            v_total += v
            v_abs_total += tl.abs(v)
            # Row maxima (a 2D running maximum would cost a register per element at BLOCK_Q = 1).
            max_abs_q = tl.maximum(max_abs_q, tl.max(tl.abs(a), axis=1))
            max_abs_k = tl.maximum(max_abs_k, tl.max(tl.abs(k), axis=1))
        scores = tl.sum(v_total, axis=0) - 2.0 * tl.sum(acc, axis=2)
        clamp_matters = _pair_clamp_may_matter(tl.max(max_abs_q), tl.max(max_abs_k))
        # sum_h v could overflow where sum_h v tanh does not (|v| ~ 1e37): take the direct path.
        if clamp_matters | (tl.sum(v_abs_total, axis=0) > SUM_ABS_V_LIMIT):
            # Pre-activations past +-34 on both sides, or a huge v (never on sane data): exact.
            scores = _score_tile_direct(
                query_rows_ptr, keys_rows_ptr, v_ptr, bias_ptr, q_in, k_in, hidden,
                stride_query_h, stride_keys_h, stride_v_h, stride_bias_h,
                0, FAST_RCP, INT64_OFFSETS, BLOCK_Q, BLOCK_K, BLOCK_H,
            )  # fmt: skip
        return scores
    else:
        return _score_tile_direct(
            query_rows_ptr, keys_rows_ptr, v_ptr, bias_ptr, q_in, k_in, hidden,
            stride_query_h, stride_keys_h, stride_v_h, stride_bias_h,
            TANH_MODE, FAST_RCP, INT64_OFFSETS, BLOCK_Q, BLOCK_K, BLOCK_H,
        )  # fmt: skip


@triton.jit
def _matmul_acc(acc, a, b, USE_DOT: tl.constexpr, LOWP_DOT: tl.constexpr):
    """acc + a @ b for a [M, K] float32 and b [K, N] (input dtype), float32 accumulation.

    tl.dot (tensor cores for float16 / bfloat16, exact float32 FMA otherwise) when every
    dimension is >= 16; else a broadcast multiply-sum.
    """
    if USE_DOT:
        if LOWP_DOT:
            return tl.dot(a.to(b.dtype), b, acc)
        else:
            return tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
    else:
        return acc + tl.sum(a[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _valid_keys(
    offs_k,
    num_keys,
    key_end,
    mask_row_ptr,
    stride_mask_s,
    HAS_MASK: tl.constexpr,
    INT64_OFFSETS: tl.constexpr,
):
    """Bool [BLOCK_K]: key s exists, lies below the row's length and is allowed by the mask."""
    valid = (offs_k < num_keys) & (offs_k < key_end)
    if HAS_MASK:
        allowed = tl.load(
            mask_row_ptr + _index(offs_k, INT64_OFFSETS) * stride_mask_s,
            mask=offs_k < num_keys,
            other=0,
        )
        valid = valid & (allowed != 0)
    return valid


# --- forward ---------------------------------------------------------------------------------------


@triton.jit
def _additive_attention_fwd_kernel(
    query_ptr,
    keys_ptr,
    values_ptr,
    v_ptr,
    bias_ptr,
    lengths_ptr,
    mask_ptr,
    context_ptr,
    weights_ptr,
    scores_ptr,
    lse_ptr,
    num_queries,
    num_keys,
    hidden,
    value_dim,
    num_q_tiles,
    stride_query_b,
    stride_query_t,
    stride_query_h,
    stride_keys_b,
    stride_keys_s,
    stride_keys_h,
    stride_values_b,
    stride_values_s,
    stride_values_d,
    stride_v_h,
    stride_bias_h,
    stride_lengths_b,
    stride_mask_b,
    stride_mask_s,
    stride_context_b,
    stride_context_t,
    stride_context_d,
    stride_weights_b,
    stride_weights_t,
    stride_weights_s,
    stride_scores_b,
    stride_scores_t,
    stride_scores_s,
    stride_lse_b,
    stride_lse_t,
    HAS_LENGTHS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    RETURN_WEIGHTS: tl.constexpr,
    TANH_MODE: tl.constexpr,
    FAST_RCP: tl.constexpr,
    USE_DOT: tl.constexpr,
    LOWP_DOT: tl.constexpr,
    INT64_OFFSETS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    ROWS2: tl.constexpr,
    BLOCK_K2: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_b = _index(pid // num_q_tiles, INT64_OFFSETS)
    pid_q = pid % num_q_tiles

    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_valid = offs_q < num_queries
    q_in = q_valid[:, None]
    idx_q = _index(offs_q, INT64_OFFSETS)
    query_rows_ptr = query_ptr + pid_b * stride_query_b + idx_q[:, None] * stride_query_t
    keys_batch_ptr = keys_ptr + pid_b * stride_keys_b
    values_batch_ptr = values_ptr + pid_b * stride_values_b
    scores_rows_ptr = scores_ptr + pid_b * stride_scores_b + idx_q[:, None] * stride_scores_t
    mask_row_ptr = mask_ptr + pid_b * stride_mask_b

    # Keys at or past the row's length are never scored: their tanh work is skipped outright.
    key_end = num_keys
    if HAS_LENGTHS:
        key_end = tl.minimum(num_keys, tl.load(lengths_ptr + pid_b * stride_lengths_b).to(tl.int32))

    # Phase 1: scores, online max / sum, raw scores parked in the fp32 scratch.
    m_i = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    num_valid = 0
    for k_start in range(0, key_end, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_in = offs_k[:, None] < num_keys
        keys_rows_ptr = keys_batch_ptr + _index(offs_k, INT64_OFFSETS)[:, None] * stride_keys_s
        s = _score_tile(
            query_rows_ptr, keys_rows_ptr, v_ptr, bias_ptr, q_in, k_in, hidden,
            stride_query_h, stride_keys_h, stride_v_h, stride_bias_h,
            TANH_MODE, FAST_RCP, INT64_OFFSETS, BLOCK_Q, BLOCK_K, BLOCK_H,
        )  # fmt: skip
        valid = _valid_keys(
            offs_k, num_keys, key_end, mask_row_ptr, stride_mask_s, HAS_MASK, INT64_OFFSETS
        )
        num_valid += tl.sum(valid.to(tl.int32), axis=0)
        s = tl.where(valid[None, :], s, float("-inf"))
        tl.store(
            scores_rows_ptr + _index(offs_k, INT64_OFFSETS)[None, :] * stride_scores_s,
            s,
            mask=q_in & (offs_k[None, :] < num_keys),
        )
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    # +inf for a row with no valid key: exp(s - lse) is then 0 everywhere, never NaN. "No valid
    # key" comes from the count, not from l: a row whose scores are NaN or +-inf must come out
    # NaN, as the reference's softmax gives it, not as an empty row.
    has_key = num_valid > 0
    lse = tl.where(has_key, m_i + tl.log(tl.where(has_key, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + pid_b * stride_lse_b + idx_q * stride_lse_t, lse, mask=q_valid)

    # The scratch and lse written above are read back below in other thread layouts.
    tl.debug_barrier()

    # Phase 2 has its own tiling: ROWS2 rows (>= 16 so that tl.dot applies; rows past this
    # program's BLOCK_Q read as masked and are never stored) x BLOCK_K2 keys x BLOCK_DV values.
    offs_r = pid_q * BLOCK_Q + tl.arange(0, ROWS2)
    r_in = ((tl.arange(0, ROWS2) < BLOCK_Q) & (offs_r < num_queries))[:, None]
    idx_r = _index(offs_r, INT64_OFFSETS)
    lse2 = tl.load(
        lse_ptr + pid_b * stride_lse_b + idx_r * stride_lse_t,
        mask=r_in.reshape(ROWS2),
        other=float("inf"),
    )
    scores2_ptr = scores_ptr + pid_b * stride_scores_b + idx_r[:, None] * stride_scores_t
    weights_rows_ptr = weights_ptr + pid_b * stride_weights_b + idx_r[:, None] * stride_weights_t
    # Normalise once: p = exp(s - lse) replaces s in the scratch (and goes to the weights), so
    # the context loop below reads p for each Dv block without recomputing exponentials.
    for k_start in range(0, num_keys, BLOCK_K2):
        offs_k = k_start + tl.arange(0, BLOCK_K2)
        idx_k = _index(offs_k, INT64_OFFSETS)
        s = tl.load(
            scores2_ptr + idx_k[None, :] * stride_scores_s,
            mask=r_in & (offs_k[None, :] < key_end),
            other=float("-inf"),
        )
        p = tl.exp(s - lse2[:, None])
        tl.store(
            scores2_ptr + idx_k[None, :] * stride_scores_s,
            p,
            mask=r_in & (offs_k[None, :] < key_end),
        )
        if RETURN_WEIGHTS:
            tl.store(
                weights_rows_ptr + idx_k[None, :] * stride_weights_s,
                p.to(weights_ptr.dtype.element_ty),
                mask=r_in & (offs_k[None, :] < num_keys),
            )

    tl.debug_barrier()

    context_rows_ptr = context_ptr + pid_b * stride_context_b + idx_r[:, None] * stride_context_t
    for d_start in range(0, value_dim, BLOCK_DV):
        offs_d = d_start + tl.arange(0, BLOCK_DV)
        d_in = offs_d < value_dim
        idx_d = _index(offs_d, INT64_OFFSETS)
        acc = tl.zeros((ROWS2, BLOCK_DV), dtype=tl.float32)
        for k_start in range(0, key_end, BLOCK_K2):
            offs_k = k_start + tl.arange(0, BLOCK_K2)
            idx_k = _index(offs_k, INT64_OFFSETS)
            p = tl.load(
                scores2_ptr + idx_k[None, :] * stride_scores_s,
                mask=r_in & (offs_k[None, :] < key_end),
                other=0.0,
            )
            vals = tl.load(
                values_batch_ptr
                + idx_k[:, None] * stride_values_s
                + idx_d[None, :] * stride_values_d,
                mask=(offs_k[:, None] < key_end) & d_in[None, :],
                other=0.0,
            )
            acc = _matmul_acc(acc, p, vals, USE_DOT, LOWP_DOT)
        tl.store(
            context_rows_ptr + idx_d[None, :] * stride_context_d,
            acc.to(context_ptr.dtype.element_ty),
            mask=r_in & d_in[None, :],
        )


# --- backward --------------------------------------------------------------------------------------


@triton.jit
def _additive_attention_bwd_ds_kernel(
    grad_context_ptr,
    grad_weights_ptr,
    query_ptr,
    keys_ptr,
    values_ptr,
    v_ptr,
    bias_ptr,
    lengths_ptr,
    mask_ptr,
    lse_ptr,
    probs_ptr,
    ds_ptr,
    num_queries,
    num_keys,
    hidden,
    value_dim,
    num_q_tiles,
    stride_grad_context_b,
    stride_grad_context_t,
    stride_grad_context_d,
    stride_grad_weights_b,
    stride_grad_weights_t,
    stride_grad_weights_s,
    stride_query_b,
    stride_query_t,
    stride_query_h,
    stride_keys_b,
    stride_keys_s,
    stride_keys_h,
    stride_values_b,
    stride_values_s,
    stride_values_d,
    stride_v_h,
    stride_bias_h,
    stride_lengths_b,
    stride_mask_b,
    stride_mask_s,
    stride_lse_b,
    stride_lse_t,
    stride_scratch_b,
    stride_scratch_t,
    stride_scratch_s,
    HAS_LENGTHS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_GRAD_WEIGHTS: tl.constexpr,
    TANH_MODE: tl.constexpr,
    FAST_RCP: tl.constexpr,
    USE_DOT: tl.constexpr,
    LOWP_DOT: tl.constexpr,
    INT64_OFFSETS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    ROWS2: tl.constexpr,
    BLOCK_K2: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_b = _index(pid // num_q_tiles, INT64_OFFSETS)
    pid_q = pid % num_q_tiles

    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_valid = offs_q < num_queries
    q_in = q_valid[:, None]
    idx_q = _index(offs_q, INT64_OFFSETS)
    query_rows_ptr = query_ptr + pid_b * stride_query_b + idx_q[:, None] * stride_query_t
    keys_batch_ptr = keys_ptr + pid_b * stride_keys_b
    values_batch_ptr = values_ptr + pid_b * stride_values_b
    scratch_offset = pid_b * stride_scratch_b + idx_q[:, None] * stride_scratch_t
    mask_row_ptr = mask_ptr + pid_b * stride_mask_b

    key_end = num_keys
    if HAS_LENGTHS:
        key_end = tl.minimum(num_keys, tl.load(lengths_ptr + pid_b * stride_lengths_b).to(tl.int32))
    # Padded query rows get lse = +inf, hence p = 0 and ds = 0.
    lse = tl.load(
        lse_ptr + pid_b * stride_lse_b + idx_q * stride_lse_t, mask=q_valid, other=float("inf")
    )

    # Phase 1: recompute the scores, p = exp(s - lse) into the probs scratch.
    for k_start in range(0, key_end, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        idx_k = _index(offs_k, INT64_OFFSETS)
        k_in = offs_k[:, None] < num_keys
        keys_rows_ptr = keys_batch_ptr + idx_k[:, None] * stride_keys_s
        s = _score_tile(
            query_rows_ptr, keys_rows_ptr, v_ptr, bias_ptr, q_in, k_in, hidden,
            stride_query_h, stride_keys_h, stride_v_h, stride_bias_h,
            TANH_MODE, FAST_RCP, INT64_OFFSETS, BLOCK_Q, BLOCK_K, BLOCK_H,
        )  # fmt: skip
        valid = _valid_keys(
            offs_k, num_keys, key_end, mask_row_ptr, stride_mask_s, HAS_MASK, INT64_OFFSETS
        )
        p = tl.where(valid[None, :], tl.exp(s - lse[:, None]), 0.0)
        tl.store(
            probs_ptr + scratch_offset + idx_k[None, :] * stride_scratch_s,
            p,
            mask=q_in & (offs_k[None, :] < num_keys),
        )

    tl.debug_barrier()

    # Phase 2, on the dot tiling of the forward's phase 2 (ROWS2 >= 16 rows, rows past BLOCK_Q
    # masked): dp = dO . values^T (+ dWeights) into the ds scratch, delta = sum_s p * dp.
    offs_r = pid_q * BLOCK_Q + tl.arange(0, ROWS2)
    r_in = ((tl.arange(0, ROWS2) < BLOCK_Q) & (offs_r < num_queries))[:, None]
    idx_r = _index(offs_r, INT64_OFFSETS)
    scratch2_offset = pid_b * stride_scratch_b + idx_r[:, None] * stride_scratch_t
    grad_context2_ptr = (
        grad_context_ptr + pid_b * stride_grad_context_b + idx_r[:, None] * stride_grad_context_t
    )
    grad_weights2_ptr = (
        grad_weights_ptr + pid_b * stride_grad_weights_b + idx_r[:, None] * stride_grad_weights_t
    )
    delta = tl.zeros((ROWS2,), dtype=tl.float32)
    for k_start in range(0, key_end, BLOCK_K2):
        offs_k = k_start + tl.arange(0, BLOCK_K2)
        idx_k = _index(offs_k, INT64_OFFSETS)
        # Values past the row's length are not read (as in the forward): a non-finite value in
        # the padding must not reach dp, where p * dp = 0 * inf would poison delta and the row.
        k_in = offs_k[:, None] < key_end
        dp = tl.zeros((ROWS2, BLOCK_K2), dtype=tl.float32)
        for d_start in range(0, value_dim, BLOCK_DV):
            offs_d = d_start + tl.arange(0, BLOCK_DV)
            d_in = offs_d < value_dim
            idx_d = _index(offs_d, INT64_OFFSETS)
            grad_out = tl.load(
                grad_context2_ptr + idx_d[None, :] * stride_grad_context_d,
                mask=r_in & d_in[None, :],
                other=0.0,
            )
            vals = tl.load(
                values_batch_ptr
                + idx_k[:, None] * stride_values_s
                + idx_d[None, :] * stride_values_d,
                mask=k_in & d_in[None, :],
                other=0.0,
            )
            dp = _matmul_acc(dp, grad_out.to(tl.float32), tl.trans(vals), USE_DOT, LOWP_DOT)
        in_tile = r_in & (offs_k[None, :] < num_keys)
        if HAS_GRAD_WEIGHTS:
            dp += tl.load(
                grad_weights2_ptr + idx_k[None, :] * stride_grad_weights_s,
                mask=in_tile,
                other=0.0,
            ).to(tl.float32)
        scratch_ptrs = scratch2_offset + idx_k[None, :] * stride_scratch_s
        p = tl.load(probs_ptr + scratch_ptrs, mask=in_tile, other=0.0)
        delta += tl.sum(p * dp, axis=1)
        tl.store(ds_ptr + scratch_ptrs, dp, mask=in_tile)

    tl.debug_barrier()

    # Phase 3: ds = p * (dp - delta), in place of dp.
    for k_start in range(0, key_end, BLOCK_K2):
        offs_k = k_start + tl.arange(0, BLOCK_K2)
        scratch_ptrs = scratch2_offset + _index(offs_k, INT64_OFFSETS)[None, :] * stride_scratch_s
        in_tile = r_in & (offs_k[None, :] < num_keys)
        p = tl.load(probs_ptr + scratch_ptrs, mask=in_tile, other=0.0)
        dp = tl.load(ds_ptr + scratch_ptrs, mask=in_tile, other=0.0)
        tl.store(ds_ptr + scratch_ptrs, p * (dp - delta[:, None]), mask=in_tile)


@triton.jit
def _grad_key_tile(
    query_batch_ptr,  # [1, BLOCK_H] pointers to query[b, 0, h chunk]
    ds_batch_ptr,
    grad_query_batch_ptr,  # [1, BLOCK_H] pointers to the fp32 grad query[b, 0, h chunk]
    k,  # [BLOCK_K, BLOCK_H] float32 keys of this tile
    v,
    bias,
    h_in,
    offs_k,
    idx_k,
    num_queries,
    num_keys,
    stride_query_t,
    stride_scratch_t,
    stride_scratch_s,
    stride_grad_query_t,
    TANH_MODE: tl.constexpr,
    FAST_RCP: tl.constexpr,
    INT64_OFFSETS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One key tile x H chunk against every query: adds sum_s g v to grad query (in memory) and
    returns (sum_t g, sum_t ds u), g = ds (1 - u^2), u = tanh(q + k + bias)."""
    grad_k_acc = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    grad_v_acc = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    for q_start in range(0, num_queries, BLOCK_Q):
        offs_q = q_start + tl.arange(0, BLOCK_Q)
        idx_q = _index(offs_q, INT64_OFFSETS)
        q_in = offs_q[:, None] < num_queries
        q = tl.load(
            query_batch_ptr + idx_q[:, None] * stride_query_t,
            mask=q_in & h_in[None, :],
            other=0.0,
        ).to(tl.float32)
        ds = tl.load(
            ds_batch_ptr + idx_q[:, None] * stride_scratch_t + idx_k[None, :] * stride_scratch_s,
            mask=q_in & (offs_k[None, :] < num_keys),
            other=0.0,
        )[:, :, None]
        a = q + bias[None, :]
        if TANH_MODE == 2:
            r = _pair_factors(a, k, FAST_RCP)  # u = 1 - 2r, 1 - u^2 = 4 r (1 - r)
            w = ds * (1.0 - 2.0 * r)
            g = ds * (4.0 * (r - r * r))
        else:
            u = _tanh(a[:, None, :] + k[None, :, :], TANH_MODE, FAST_RCP)
            w = ds * u  # d score / d v, weighted by ds
            g = ds - w * u  # ds * (1 - u^2): d loss / d pre, without the factor v
        grad_k_acc += tl.sum(g, axis=0)
        grad_v_acc += tl.sum(w, axis=0)
        grad_q_ptrs = grad_query_batch_ptr + idx_q[:, None] * stride_grad_query_t
        grad_q_mask = q_in & h_in[None, :]
        grad_q = tl.load(grad_q_ptrs, mask=grad_q_mask, other=0.0)
        grad_q += tl.sum(g, axis=1) * v[None, :]
        tl.store(grad_q_ptrs, grad_q, mask=grad_q_mask)
    return grad_k_acc, grad_v_acc


@triton.jit
def _additive_attention_bwd_grad_kernel(
    query_ptr,
    keys_ptr,
    v_ptr,
    bias_ptr,
    lengths_ptr,
    ds_ptr,
    grad_query_ptr,  # fp32 [B, Tq, H], zero-filled, contiguous
    grad_keys_ptr,  # input dtype [B, Tk, H], zero-filled (keys past the length are not visited)
    grad_v_partial_ptr,  # fp32 [B, H]
    num_queries,
    num_keys,
    hidden,
    num_h_tiles,
    stride_query_b,
    stride_query_t,
    stride_query_h,
    stride_keys_b,
    stride_keys_s,
    stride_keys_h,
    stride_v_h,
    stride_bias_h,
    stride_lengths_b,
    stride_scratch_b,
    stride_scratch_t,
    stride_scratch_s,
    stride_grad_query_b,
    stride_grad_query_t,
    stride_grad_query_h,
    stride_grad_keys_b,
    stride_grad_keys_s,
    stride_grad_keys_h,
    stride_grad_v_partial_b,
    HAS_LENGTHS: tl.constexpr,
    TANH_MODE: tl.constexpr,
    FAST_RCP: tl.constexpr,
    INT64_OFFSETS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_b = _index(pid // num_h_tiles, INT64_OFFSETS)
    pid_h = pid % num_h_tiles

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_in = offs_h < hidden
    idx_h = _index(offs_h, INT64_OFFSETS)
    v = tl.load(v_ptr + idx_h * stride_v_h, mask=h_in, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + idx_h * stride_bias_h, mask=h_in, other=0.0).to(tl.float32)
    query_batch_ptr = query_ptr + pid_b * stride_query_b + idx_h[None, :] * stride_query_h
    keys_batch_ptr = keys_ptr + pid_b * stride_keys_b + idx_h[None, :] * stride_keys_h
    grad_query_batch_ptr = (
        grad_query_ptr + pid_b * stride_grad_query_b + idx_h[None, :] * stride_grad_query_h
    )
    grad_keys_batch_ptr = (
        grad_keys_ptr + pid_b * stride_grad_keys_b + idx_h[None, :] * stride_grad_keys_h
    )
    ds_batch_ptr = ds_ptr + pid_b * stride_scratch_b

    key_end = num_keys
    if HAS_LENGTHS:
        key_end = tl.minimum(num_keys, tl.load(lengths_ptr + pid_b * stride_lengths_b).to(tl.int32))

    max_abs_q = 0.0
    if TANH_MODE == 2:  # max |q + bias| over this chunk, for _pair_clamp_may_matter
        running = tl.zeros((BLOCK_Q, BLOCK_H), dtype=tl.float32)
        for q_start in range(0, num_queries, BLOCK_Q):
            offs_q = q_start + tl.arange(0, BLOCK_Q)
            q = tl.load(
                query_batch_ptr + _index(offs_q, INT64_OFFSETS)[:, None] * stride_query_t,
                mask=(offs_q[:, None] < num_queries) & h_in[None, :],
                other=0.0,
            ).to(tl.float32)
            running = tl.maximum(running, tl.abs(q + bias[None, :]))
        max_abs_q = tl.max(running)

    grad_v_acc = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    for k_start in range(0, key_end, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        idx_k = _index(offs_k, INT64_OFFSETS)
        k_in = offs_k[:, None] < num_keys
        # Keys past the row's length are not read: their ds is 0, but 0 * sech^2(NaN) would
        # still reach grad query (their grad keys rows are stored as 0).
        k = tl.load(
            keys_batch_ptr + idx_k[:, None] * stride_keys_s,
            mask=(offs_k[:, None] < key_end) & h_in[None, :],
            other=0.0,
        ).to(tl.float32)
        if TANH_MODE == 2:
            if _pair_clamp_may_matter(max_abs_q, tl.max(tl.abs(k))):
                # Pre-activations past +-34 on both sides (never on sane data): exact tanh.
                grad_k_acc, grad_v_part = _grad_key_tile(
                    query_batch_ptr, ds_batch_ptr, grad_query_batch_ptr, k, v, bias, h_in,
                    offs_k, idx_k, num_queries, num_keys,
                    stride_query_t, stride_scratch_t, stride_scratch_s, stride_grad_query_t,
                    0, FAST_RCP, INT64_OFFSETS, BLOCK_Q, BLOCK_K, BLOCK_H,
                )  # fmt: skip
            else:
                grad_k_acc, grad_v_part = _grad_key_tile(
                    query_batch_ptr, ds_batch_ptr, grad_query_batch_ptr, k, v, bias, h_in,
                    offs_k, idx_k, num_queries, num_keys,
                    stride_query_t, stride_scratch_t, stride_scratch_s, stride_grad_query_t,
                    2, FAST_RCP, INT64_OFFSETS, BLOCK_Q, BLOCK_K, BLOCK_H,
                )  # fmt: skip
        else:
            grad_k_acc, grad_v_part = _grad_key_tile(
                query_batch_ptr, ds_batch_ptr, grad_query_batch_ptr, k, v, bias, h_in,
                offs_k, idx_k, num_queries, num_keys,
                stride_query_t, stride_scratch_t, stride_scratch_s, stride_grad_query_t,
                TANH_MODE, FAST_RCP, INT64_OFFSETS, BLOCK_Q, BLOCK_K, BLOCK_H,
            )  # fmt: skip
        grad_v_acc += grad_v_part
        tl.store(
            grad_keys_batch_ptr + idx_k[:, None] * stride_grad_keys_s,
            (grad_k_acc * v[None, :]).to(grad_keys_ptr.dtype.element_ty),
            mask=k_in & h_in[None, :],
        )
        # This program re-reads its grad-query rows in the next key tile.
        tl.debug_barrier()
    tl.store(
        grad_v_partial_ptr + pid_b * stride_grad_v_partial_b + idx_h,
        tl.sum(grad_v_acc, axis=0),
        mask=h_in,
    )


@triton.jit
def _additive_attention_bwd_dvalues_kernel(
    probs_ptr,
    grad_context_ptr,
    grad_values_ptr,
    num_queries,
    num_keys,
    value_dim,
    num_k_tiles,
    num_d_tiles,
    stride_scratch_b,
    stride_scratch_t,
    stride_scratch_s,
    stride_grad_context_b,
    stride_grad_context_t,
    stride_grad_context_d,
    stride_grad_values_b,
    stride_grad_values_s,
    stride_grad_values_d,
    USE_DOT: tl.constexpr,
    LOWP_DOT: tl.constexpr,
    INT64_OFFSETS: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_b = _index(pid // (num_k_tiles * num_d_tiles), INT64_OFFSETS)
    pid_rest = pid % (num_k_tiles * num_d_tiles)
    pid_k = pid_rest // num_d_tiles
    pid_d = pid_rest % num_d_tiles

    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = pid_d * BLOCK_DV + tl.arange(0, BLOCK_DV)
    idx_k = _index(offs_k, INT64_OFFSETS)
    idx_d = _index(offs_d, INT64_OFFSETS)
    k_in = offs_k < num_keys
    d_in = offs_d < value_dim
    probs_batch_ptr = probs_ptr + pid_b * stride_scratch_b + idx_k[None, :] * stride_scratch_s
    grad_context_batch_ptr = (
        grad_context_ptr + pid_b * stride_grad_context_b + idx_d[None, :] * stride_grad_context_d
    )

    acc = tl.zeros((BLOCK_K, BLOCK_DV), dtype=tl.float32)
    for q_start in range(0, num_queries, BLOCK_Q):
        offs_q = q_start + tl.arange(0, BLOCK_Q)
        idx_q = _index(offs_q, INT64_OFFSETS)
        q_in = offs_q[:, None] < num_queries
        p = tl.load(
            probs_batch_ptr + idx_q[:, None] * stride_scratch_t,
            mask=q_in & k_in[None, :],
            other=0.0,
        )  # [BLOCK_Q, BLOCK_K]
        grad_out = tl.load(
            grad_context_batch_ptr + idx_q[:, None] * stride_grad_context_t,
            mask=q_in & d_in[None, :],
            other=0.0,
        )  # [BLOCK_Q, BLOCK_DV]
        if USE_DOT:
            if LOWP_DOT:
                acc += tl.dot(tl.trans(p.to(grad_out.dtype)), grad_out)
            else:
                acc += tl.dot(tl.trans(p), grad_out.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.sum(p[:, :, None] * grad_out.to(tl.float32)[:, None, :], axis=0)
    tl.store(
        grad_values_ptr
        + pid_b * stride_grad_values_b
        + idx_k[:, None] * stride_grad_values_s
        + idx_d[None, :] * stride_grad_values_d,
        acc.to(grad_values_ptr.dtype.element_ty),
        mask=k_in[:, None] & d_in[None, :],
    )


# --- tile choice -----------------------------------------------------------------------------------


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


# --- launchers -------------------------------------------------------------------------------------


def is_interpreted() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    return type(_additive_attention_fwd_kernel).__name__ == "InterpretedFunction"


def tanh_mode(dtype: torch.dtype, device: torch.device | str) -> str:
    """The tanh path the kernels take for inputs of this dtype and device (see the module doc).

    SEQ2SEQ_FAST_TANH=auto (default) | approx | product | exp, read at every call. "approx" needs
    inline PTX, so under the interpreter (or off CUDA) it falls back to "product".
    """
    mode = os.environ.get(TANH_ENV, "auto").strip().lower() or "auto"
    if mode not in TANH_MODES:
        raise ValueError(f"{TANH_ENV} must be one of {', '.join(TANH_MODES)}, got {mode!r}")
    on_gpu = torch.device(device).type == "cuda" and not is_interpreted()
    if mode == "auto":
        mode = "approx" if dtype in (torch.float16, torch.bfloat16) else "product"
    if mode == "approx" and not on_gpu:
        mode = "product"
    return mode


def _fast_rcp() -> bool:
    """rcp.approx through inline PTX, which the interpreter cannot run."""
    return not is_interpreted()


def needs_int64_offsets(*tensors: torch.Tensor | None) -> bool:
    """Whether an element offset of one of these tensors can reach 2^31 (then all index math is
    done in int64; below that int32 saves address instructions and registers)."""
    limit = 2**31 - 1
    for t in tensors:
        if t is not None and t.numel() > 0:
            span = sum(
                (size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True)
            )
            if span >= limit or t.numel() >= limit:
                return True
    return False


def _on_device(device: torch.device):
    """Launch on the tensors' GPU (Triton launches on the current device), a no-op elsewhere."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _lowp_dot(dtype: torch.dtype) -> bool:
    """Feed float16/bfloat16 operands to tl.dot as they are (tensor cores, fp32 accumulation).

    Triton's interpreter multiplies bfloat16 dot operands as raw 16-bit integers (seen with
    triton 3.9), so there bfloat16 tiles are widened to float32 first.
    """
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and not is_interpreted()


def _mask_arg(mask: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    if mask is None:
        return fallback, 0, 0
    mask_u8 = mask.view(torch.uint8)  # bool is one byte: same storage, loadable as integers
    return mask_u8, mask_u8.stride(0), mask_u8.stride(1)


def _lengths_arg(lengths: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, int]:
    if lengths is None:
        return fallback, 0
    if lengths.dtype != torch.int64:
        lengths = lengths.to(torch.int64)
    return lengths, lengths.stride(0)


def _additive_attention_fwd_impl(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    lengths: torch.Tensor | None,
    mask: torch.Tensor | None,
    return_weights: bool,
    *,
    config: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, num_queries, hidden = query.shape
    num_keys, value_dim = values.shape[1], values.shape[2]
    dtype, device = query.dtype, query.device
    if bias is None:
        bias = query.new_zeros(hidden)
    context = torch.empty((batch, num_queries, value_dim), dtype=dtype, device=device)
    if return_weights:
        weights = torch.empty((batch, num_queries, num_keys), dtype=dtype, device=device)
    else:
        weights = torch.empty((0,), dtype=dtype, device=device)
    lse = torch.empty((batch, num_queries), dtype=torch.float32, device=device)
    if batch * num_queries == 0:
        return context, weights, lse

    cfg = config or forward_config(num_queries, num_keys, hidden, value_dim, dtype=dtype)
    scores = torch.empty((batch, num_queries, num_keys), dtype=torch.float32, device=device)
    lengths_t, stride_lengths_b = _lengths_arg(lengths, lse)
    mask_t, stride_mask_b, stride_mask_s = _mask_arg(mask, lse)
    weights_t = weights if return_weights else scores
    int64_offsets = needs_int64_offsets(query, keys, values, context, weights_t, scores, mask)
    num_q_tiles = triton.cdiv(num_queries, cfg.block_q)
    grid = (batch * num_q_tiles,)
    _additive_attention_fwd_kernel[grid](
        query, keys, values, v, bias, lengths_t, mask_t,
        context, weights_t, scores, lse,
        num_queries, num_keys, hidden, value_dim, num_q_tiles,
        *query.stride(), *keys.stride(), *values.stride(),
        v.stride(0), bias.stride(0), stride_lengths_b, stride_mask_b, stride_mask_s,
        *context.stride(), *weights_t.stride(), *scores.stride(), *lse.stride(),
        HAS_LENGTHS=lengths is not None,
        HAS_MASK=mask is not None,
        INT64_OFFSETS=int64_offsets,
        RETURN_WEIGHTS=bool(return_weights),
        TANH_MODE=_TANH_CODES[tanh_mode(dtype, device)],
        FAST_RCP=_fast_rcp(),
        USE_DOT=cfg.use_dot,
        LOWP_DOT=_lowp_dot(dtype),
        BLOCK_Q=cfg.block_q,
        BLOCK_K=cfg.block_k,
        BLOCK_H=cfg.block_h,
        BLOCK_DV=cfg.block_dv,
        ROWS2=cfg.rows2,
        BLOCK_K2=cfg.block_k2,
        num_warps=cfg.num_warps,
        enable_fp_fusion=True,  # FMA contraction: Triton 3.10 turns it off by default
    )  # fmt: skip
    return context, weights, lse


def _additive_attention_bwd_impl(
    grad_context: torch.Tensor,
    grad_weights: torch.Tensor | None,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    lengths: torch.Tensor | None,
    mask: torch.Tensor | None,
    context: torch.Tensor,
    lse: torch.Tensor,
    *,
    configs: tuple[TileConfig, TileConfig, TileConfig] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    del context
    batch, num_queries, hidden = query.shape
    num_keys, value_dim = values.shape[1], values.shape[2]
    dtype, device = query.dtype, query.device
    if bias is None:
        bias = query.new_zeros(hidden)
    grad_query = torch.empty_like(query)
    grad_keys = torch.zeros_like(keys)
    grad_values = torch.empty_like(values)
    grad_v = torch.empty_like(v)
    grad_bias = torch.empty_like(bias)
    if batch * num_queries * num_keys == 0:  # no (query, key) pair: every gradient is zero
        for grad in (grad_query, grad_values, grad_v, grad_bias):
            grad.zero_()
        return grad_query, grad_keys, grad_values, grad_v, grad_bias

    ds_cfg, grad_cfg, dvalues_cfg = configs or backward_configs(
        batch, num_queries, num_keys, hidden, value_dim, dtype=dtype
    )
    tanh_code = _TANH_CODES[tanh_mode(dtype, device)]
    lengths_t, stride_lengths_b = _lengths_arg(lengths, lse)
    mask_t, stride_mask_b, stride_mask_s = _mask_arg(mask, lse)
    # Keys past a row's length are never visited: their p and ds must read as 0.
    probs = torch.zeros((batch, num_queries, num_keys), dtype=torch.float32, device=device)
    ds = torch.zeros_like(probs)
    grad_weights_t = grad_weights if grad_weights is not None else probs
    int64_offsets = needs_int64_offsets(
        query, keys, values, grad_context, grad_weights_t, grad_keys, grad_values, probs, mask
    )

    num_q_tiles = triton.cdiv(num_queries, ds_cfg.block_q)
    _additive_attention_bwd_ds_kernel[(batch * num_q_tiles,)](
        grad_context, grad_weights_t, query, keys, values, v, bias, lengths_t, mask_t, lse,
        probs, ds,
        num_queries, num_keys, hidden, value_dim, num_q_tiles,
        *grad_context.stride(), *grad_weights_t.stride(), *query.stride(), *keys.stride(),
        *values.stride(), v.stride(0), bias.stride(0), stride_lengths_b,
        stride_mask_b, stride_mask_s, *lse.stride(), *probs.stride(),
        HAS_LENGTHS=lengths is not None,
        HAS_MASK=mask is not None,
        HAS_GRAD_WEIGHTS=grad_weights is not None,
        INT64_OFFSETS=int64_offsets,
        TANH_MODE=tanh_code,
        FAST_RCP=_fast_rcp(),
        USE_DOT=ds_cfg.use_dot,
        LOWP_DOT=_lowp_dot(dtype),
        BLOCK_Q=ds_cfg.block_q,
        BLOCK_K=ds_cfg.block_k,
        BLOCK_H=ds_cfg.block_h,
        BLOCK_DV=ds_cfg.block_dv,
        ROWS2=ds_cfg.rows2,
        BLOCK_K2=ds_cfg.block_k2,
        num_warps=ds_cfg.num_warps,
        enable_fp_fusion=True,  # FMA contraction: Triton 3.10 turns it off by default
    )  # fmt: skip

    grad_query_f32 = torch.zeros((batch, num_queries, hidden), dtype=torch.float32, device=device)
    grad_v_partial = torch.zeros((batch, hidden), dtype=torch.float32, device=device)
    num_h_tiles = triton.cdiv(hidden, grad_cfg.block_h)
    if num_h_tiles > 0:
        _additive_attention_bwd_grad_kernel[(batch * num_h_tiles,)](
            query, keys, v, bias, lengths_t, ds, grad_query_f32, grad_keys, grad_v_partial,
            num_queries, num_keys, hidden, num_h_tiles,
            *query.stride(), *keys.stride(), v.stride(0), bias.stride(0), stride_lengths_b,
            *ds.stride(), *grad_query_f32.stride(), *grad_keys.stride(), grad_v_partial.stride(0),
            HAS_LENGTHS=lengths is not None,
            TANH_MODE=tanh_code,
        FAST_RCP=_fast_rcp(),
            INT64_OFFSETS=int64_offsets,
            BLOCK_Q=grad_cfg.block_q,
            BLOCK_K=grad_cfg.block_k,
            BLOCK_H=grad_cfg.block_h,
            num_warps=grad_cfg.num_warps,
            enable_fp_fusion=True,  # FMA contraction: Triton 3.10 turns it off by default
        )  # fmt: skip

    num_k_tiles = triton.cdiv(num_keys, dvalues_cfg.block_k)
    num_d_tiles = triton.cdiv(value_dim, dvalues_cfg.block_dv)
    if num_d_tiles > 0:
        _additive_attention_bwd_dvalues_kernel[(batch * num_k_tiles * num_d_tiles,)](
            probs, grad_context, grad_values,
            num_queries, num_keys, value_dim, num_k_tiles, num_d_tiles,
            *probs.stride(), *grad_context.stride(), *grad_values.stride(),
            USE_DOT=min(dvalues_cfg.block_q, dvalues_cfg.block_k, dvalues_cfg.block_dv) >= 16,
            LOWP_DOT=_lowp_dot(dtype),
            INT64_OFFSETS=int64_offsets,
            BLOCK_Q=dvalues_cfg.block_q,
            BLOCK_K=dvalues_cfg.block_k,
            BLOCK_DV=dvalues_cfg.block_dv,
            num_warps=dvalues_cfg.num_warps,
            enable_fp_fusion=True,  # FMA contraction: Triton 3.10 turns it off by default
        )  # fmt: skip

    # Fixed-order reductions in torch: deterministic, no float atomics.
    grad_query.copy_(grad_query_f32)
    grad_v.copy_(grad_v_partial.sum(dim=0))
    grad_bias.copy_(grad_query_f32.sum(dim=(0, 1)))
    return grad_query, grad_keys, grad_values, grad_v, grad_bias


def additive_attention_fwd(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    lengths: torch.Tensor | None,
    mask: torch.Tensor | None,
    return_weights: bool,
    *,
    config: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of the op (contract in ``seq2seq_fast.ops.additive_attention``).

    Args:
        query [B, Tq, H], keys [B, Tk, H], values [B, Tk, Dv], v [H], bias [H] or None: one dtype
            (float32, float16 or bfloat16), any strides.
        lengths: int [B] (0 <= length <= Tk) or None. mask: bool [B, Tk] (True = attend) or None.
        return_weights: also write the [B, Tq, Tk] weights.
        config: tile override (benchmarks); None picks :func:`forward_config`.

    Returns:
        context [B, Tq, Dv] and weights [B, Tq, Tk] (an empty [0] tensor when not asked) in the
        input dtype; lse float32 [B, Tq] = max + log(sum(exp)) of the valid scores, +inf for a row
        without a valid key.
    """
    with _on_device(query.device):
        return _additive_attention_fwd_impl(
            query, keys, values, v, bias, lengths, mask, return_weights, config=config
        )


def additive_attention_bwd(
    grad_context: torch.Tensor,
    grad_weights: torch.Tensor | None,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    lengths: torch.Tensor | None,
    mask: torch.Tensor | None,
    context: torch.Tensor,
    lse: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    configs: tuple[TileConfig, TileConfig, TileConfig] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the op: grads for (query, keys, values, v, bias), each in its input's dtype.

    Args:
        grad_context [B, Tq, Dv]; grad_weights [B, Tq, Tk] or None; query, keys, values, v, bias,
        lengths, mask as in :func:`additive_attention_fwd`; context [B, Tq, Dv] (unused: delta is
        recomputed exactly from p and dp rather than from the rounded context); lse float32 [B, Tq]
        from the forward; weights: the forward's weights when the caller kept them (unused here:
        p = exp(e - lse) is recomputed in the score tiles, where it costs one exp per pair and
        saves reading a [B, Tq, Tk] tensor). configs: tile override (benchmarks).
    """
    with _on_device(query.device):
        return _additive_attention_bwd_impl(
            grad_context,
            grad_weights,
            query,
            keys,
            values,
            v,
            bias,
            lengths,
            mask,
            context,
            lse,
            configs=configs,
        )
