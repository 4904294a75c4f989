"""Triton kernels for fused additive (Bahdanau) attention, the CUDA backend of the op.

    e[b,t,s]   = sum_h v[h] * tanh(query[b,t,h] + keys[b,s,h] + bias[h])
    p[b,t,:]   = softmax of e[b,t,:] over the valid keys (masked keys get exactly 0); with
                 normalize="sigmoid" (SIGMOID): sigmoid(e) / sum sigmoid(e) over them, computed
                 as the softmax of log sigmoid(e) (lse = log sum sigmoid(e)), and the backward's
                 ds times 1 - sigmoid(e) (the derivative of log sigmoid), parked in a scratch;
                 with a score bias b (HAS_SCORE_BIAS, a one-element tensor): of e + b, and the
                 score bias's gradient the sum of ds (torch, over the zero-filled ds scratch)
    ctx[b,t,:] = sum_s p[b,t,s] * values[b,s,:]

Installed as ``seq2seq_fast._triton.additive_attention``; ``seq2seq_fast.ops.additive_attention``
registers the two launchers as the CUDA kernels of ``seq2seq_fast::additive_attention_fwd`` /
``_bwd``. Under ``TRITON_INTERPRET=1`` the same launchers run on CPU tensors through Triton's
interpreter (tests). The tanh paths and their choice live in ``tanh.py``, the tile sizes in
``tiles.py``.

Kernels (the [B, Tq, Tk, H] tensor is never written anywhere; scratch is O(B*Tq*Tk)):
    _fwd_kernel   one program per (batch, query tile). Phase 1 loops over key tiles, and inside
        over H chunks, building the [BLOCK_Q, BLOCK_K] score tile from a [BLOCK_Q, BLOCK_K,
        BLOCK_H] tanh tile in registers; masks it; keeps an online max/sum (flash-attention
        style) and parks the raw scores in an fp32 scratch [B, Tq, Tk]. Phase 2 (same program,
        after a barrier) normalises with lse = max + log(sum), optionally writes the weights, and
        accumulates the context over Dv chunks. Two phases instead of a single rescaled
        accumulator because Dv is often 1024: a [BLOCK_Q, Dv] fp32 accumulator does not fit in
        registers, while re-reading the scores costs Tk floats per row, next to Tk*H tanh.
    _bwd_ds_kernel   per (batch, query tile): recomputes the scores (Tk*H tanh per row),
        p = exp(s - lse), dp = dO . values + dWeights, delta = sum_s p*dp, and writes p and
        ds = p * (dp - delta) to fp32 scratch [B, Tq, Tk].
    _bwd_grad_kernel   per (batch, H chunk): recomputes u = tanh(...) once more and reduces
        g = ds * (1 - u^2) over queries (grad keys, in registers), over keys (grad query, a
        read-modify-write of an fp32 buffer this program alone owns) and ds*u over both (grad v,
        one partial row per program, summed by torch). grad bias = sum of the fp32 grad query
        over (b, t) because d(pre)/d(bias) = d(pre)/d(query).
    _bwd_dvalues_kernel   per (batch, key tile, Dv tile): grad values = p^T dO.
    Backward costs 2 * B*Tq*Tk*H tanh; no float atomics anywhere, so results are bitwise
    reproducible run to run. Index arithmetic is int32 unless some tensor spans 2^31 elements
    (needs_int64_offsets), then int64 throughout (constexpr INT64).

Stride arguments are named s<tensor>_<dim>: sq query, sk keys, sx values, sc context,
sw weights, ss scores / scratch, sl lse, sm mask, sg grad context, sgw grad weights, sgq grad
query, sgk grad keys, sgx grad values; b batch, t query, s key, h hidden, d value dim.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from .tanh import (
    SUM_ABS_V_LIMIT,
    TANH_CODES,
    TANH_MODES,
    fast_rcp,
    is_interpreted,
    pair_clamp_may_matter,
    pair_factors,
    product_too_coarse,
    resolve_tanh,
    tanh,
    tanh_override,
    tanh_probe,
)
from .tiles import H200_SMS, TileConfig, backward_configs, forward_config, grad_tile

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
    "resolve_tanh",
    "tanh_override",
    "tanh_probe",
]
_TANH_CODES = TANH_CODES  # the kernels' TANH_MODE constexpr, by path name


# --- building blocks -------------------------------------------------------------------------------


@triton.jit
def _index(offsets, INT64: tl.constexpr):
    """Offsets for address arithmetic: int64 when some tensor spans 2^31 elements, else int32."""
    if INT64:
        return offsets.to(tl.int64)
    else:
        return offsets


@triton.jit
def _key_end(len_ptr, pid_b, s_len, num_keys, HAS_LENGTHS: tl.constexpr):
    """Keys at or past the row's length are never scored: their tanh work is skipped outright."""
    key_end = num_keys
    if HAS_LENGTHS:
        key_end = tl.minimum(num_keys, tl.load(len_ptr + pid_b * s_len).to(tl.int32))
    return key_end


@triton.jit
def _load_h_chunk(q_rows, k_rows, v_ptr, b_ptr, q_in, k_in, h0, H, sq_h, sk_h, s_v, s_b,
                  INT64: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """float32 (q + bias [BQ, BH], k [BK, BH], v [BH]) of one H chunk; 0 on padded lanes."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    h_in = offs_h < H
    idx_h = _index(offs_h, INT64)
    q = tl.load(q_rows + idx_h[None, :] * sq_h, mask=q_in & h_in[None, :], other=0.0)
    k = tl.load(k_rows + idx_h[None, :] * sk_h, mask=k_in & h_in[None, :], other=0.0)
    bias = tl.load(b_ptr + idx_h * s_b, mask=h_in, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + idx_h * s_v, mask=h_in, other=0.0).to(tl.float32)
    return q.to(tl.float32) + bias[None, :], k.to(tl.float32), v


@triton.jit
def _score_tile_direct(q_rows, k_rows, v_ptr, b_ptr, q_in, k_in, H, sq_h, sk_h, s_v, s_b,
                       TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr, INT64: tl.constexpr,
                       BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """Scores with an elementwise tanh of q + k + bias (the approx, packed and exp paths)."""
    # Accumulate in 3D and reduce over h once at the end: one cross-lane reduction per key tile
    # instead of one per H chunk. v = 0 on padded h, so padded lanes add nothing.
    acc = tl.zeros((BLOCK_Q, BLOCK_K, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        a, k, v = _load_h_chunk(q_rows, k_rows, v_ptr, b_ptr, q_in, k_in, h0, H,
                                sq_h, sk_h, s_v, s_b, INT64, BLOCK_H)  # fmt: skip
        acc += v[None, None, :] * tanh(a[:, None, :] + k[None, :, :], TANH_MODE, FAST_RCP)
    return tl.sum(acc, axis=2)


@triton.jit
def _score_tile(q_rows, k_rows, v_ptr, b_ptr, q_in, k_in, H, sq_h, sk_h, s_v, s_b,
                TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr, INT64: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """Scores [BLOCK_Q, BLOCK_K] = sum_h v[h] tanh(q[t,h] + k[s,h] + bias[h]), fp32, unmasked.

    q_rows [BLOCK_Q, 1] / k_rows [BLOCK_K, 1]: pointers to query[b, t, 0] / keys[b, s, 0];
    q_in / k_in: which of those rows exist.
    """
    if TANH_MODE == 2:
        # sum_h v tanh(a + b) = sum_h v - 2 sum_h v r,  r = 1 / (1 + e^{2a} e^{2b}).
        acc = tl.zeros((BLOCK_Q, BLOCK_K, BLOCK_H), dtype=tl.float32)
        v_total = tl.zeros((BLOCK_H,), dtype=tl.float32)
        v_abs_total = tl.zeros((BLOCK_H,), dtype=tl.float32)
        max_abs_q = tl.zeros((BLOCK_Q,), dtype=tl.float32)
        max_abs_k = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            a, k, v = _load_h_chunk(q_rows, k_rows, v_ptr, b_ptr, q_in, k_in, h0, H,
                                    sq_h, sk_h, s_v, s_b, INT64, BLOCK_H)  # fmt: skip
            acc += v[None, None, :] * pair_factors(a, k, FAST_RCP)
            v_total += v
            v_abs_total += tl.abs(v)
            # Row maxima (a 2D running maximum would cost a register per element at BLOCK_Q = 1).
            max_abs_q = tl.maximum(max_abs_q, tl.max(tl.abs(a), axis=1))
            max_abs_k = tl.maximum(max_abs_k, tl.max(tl.abs(k), axis=1))
        scores = tl.sum(v_total, axis=0) - 2.0 * tl.sum(acc, axis=2)
        clamp_matters = pair_clamp_may_matter(tl.max(max_abs_q), tl.max(max_abs_k))
        too_coarse = product_too_coarse(tl.max(max_abs_q), tl.max(max_abs_k))
        # sum_h v could overflow where sum_h v tanh does not (|v| ~ 1e37): take the direct path.
        if clamp_matters | too_coarse | (tl.sum(v_abs_total, axis=0) > SUM_ABS_V_LIMIT):
            # Pre-activations past +-34 on both sides, all of them small (the product's absolute
            # error against tanh ~ x), or a huge v (never on sane data): exact.
            scores = _score_tile_direct(q_rows, k_rows, v_ptr, b_ptr, q_in, k_in, H,
                                        sq_h, sk_h, s_v, s_b, 0, FAST_RCP, INT64,
                                        BLOCK_Q, BLOCK_K, BLOCK_H)  # fmt: skip
        return scores
    else:
        return _score_tile_direct(q_rows, k_rows, v_ptr, b_ptr, q_in, k_in, H,
                                  sq_h, sk_h, s_v, s_b, TANH_MODE, FAST_RCP, INT64,
                                  BLOCK_Q, BLOCK_K, BLOCK_H)  # fmt: skip


@triton.jit
def _matmul_acc(acc, a, b, USE_DOT: tl.constexpr, LOWP_DOT: tl.constexpr):
    """acc + a @ b for a [M, K] float32 and b [K, N] (input dtype), float32 accumulation.

    tl.dot (tensor cores for float16 / bfloat16, exact float32 FMA otherwise) when every
    dimension is >= 16; else a broadcast multiply-sum (the one-row GEMV of the decoding step).
    """
    if USE_DOT:
        if LOWP_DOT:
            return tl.dot(a.to(b.dtype), b, acc)
        else:
            return tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
    else:
        return acc + tl.sum(a[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _valid_keys(offs_k, num_keys, key_end, mask_row, sm_s, HAS_MASK: tl.constexpr,
                INT64: tl.constexpr):  # fmt: skip
    """Bool [BLOCK_K]: key s exists, lies below the row's length and is allowed by the mask."""
    valid = (offs_k < num_keys) & (offs_k < key_end)
    if HAS_MASK:
        allowed = tl.load(mask_row + _index(offs_k, INT64) * sm_s, mask=offs_k < num_keys, other=0)
        valid = valid & (allowed != 0)
    return valid


@triton.jit
def _log_sigmoid(s, tail):
    """log sigmoid(s) = min(s, 0) - log(1 + exp(-|s|)), tail = the second term (NaN stays NaN)."""
    return tl.where(s < 0.0, s, 0.0) - tail


@triton.jit
def _scores_pass(q_rows, k_batch, v_ptr, b_ptr, mask_row, out_rows, om_rows, lse, q_in,
                 Tk, key_end, H, sq_h, sk_s, sk_h, s_v, s_b, sm_s, ss_s, shift,
                 HAS_MASK: tl.constexpr, TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr,
                 INT64: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_H: tl.constexpr, FORWARD: tl.constexpr, SIGMOID: tl.constexpr,
                 HAS_SCORE_BIAS: tl.constexpr):  # fmt: skip
    """Scores of this query tile against every key tile below key_end, stored at out_rows.

    FORWARD: stores the masked raw scores and returns (online max m, sum l, valid key count).
    Else (backward): stores p = exp(s - lse) (0 on masked keys) and returns zeros.
    HAS_SCORE_BIAS: s + shift (the score bias) in place of s, first.
    SIGMOID: log sigmoid(s) in place of s; the backward also stores 1 - sigmoid(s) at om_rows.
    """
    m_i = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    num_valid = 0
    for k0 in range(0, key_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx_k = _index(offs_k, INT64)
        k_rows = k_batch + idx_k[:, None] * sk_s
        s = _score_tile(q_rows, k_rows, v_ptr, b_ptr, q_in, offs_k[:, None] < Tk, H,
                        sq_h, sk_h, s_v, s_b, TANH_MODE, FAST_RCP, INT64,
                        BLOCK_Q, BLOCK_K, BLOCK_H)  # fmt: skip
        if HAS_SCORE_BIAS:
            s = s + shift
        valid = _valid_keys(offs_k, Tk, key_end, mask_row, sm_s, HAS_MASK, INT64)
        out_mask = q_in & (offs_k[None, :] < Tk)
        if SIGMOID:
            tail = tl.log(1.0 + tl.exp(-tl.abs(s)))
            if not FORWARD:
                om = tl.exp(_log_sigmoid(-s, tail))
                tl.store(om_rows + idx_k[None, :] * ss_s, om, mask=out_mask)
            s = _log_sigmoid(s, tail)
        if FORWARD:
            num_valid += tl.sum(valid.to(tl.int32), axis=0)
            s = tl.where(valid[None, :], s, float("-inf"))
            tl.store(out_rows + idx_k[None, :] * ss_s, s, mask=out_mask)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked: no -inf - -inf
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
            m_i = m_new
        else:
            p = tl.where(valid[None, :], tl.exp(s - lse[:, None]), 0.0)
            tl.store(out_rows + idx_k[None, :] * ss_s, p, mask=out_mask)
    return m_i, l_i, num_valid


# --- forward ---------------------------------------------------------------------------------------


@triton.jit
def _fwd_normalise(s_rows, w_rows, lse2, r_in, Tk, key_end, ss_s, sw_s,
                   RETURN_WEIGHTS: tl.constexpr, INT64: tl.constexpr, BLOCK_K2: tl.constexpr):  # fmt: skip
    """p = exp(s - lse) in place of s in the scratch (and to the weights), once per row, so the
    context loop reads p for each Dv block without recomputing exponentials."""
    for k0 in range(0, Tk, BLOCK_K2):
        offs_k = k0 + tl.arange(0, BLOCK_K2)
        idx_k = _index(offs_k, INT64)
        live = r_in & (offs_k[None, :] < key_end)
        s = tl.load(s_rows + idx_k[None, :] * ss_s, mask=live, other=float("-inf"))
        p = tl.exp(s - lse2[:, None])
        tl.store(s_rows + idx_k[None, :] * ss_s, p, mask=live)
        if RETURN_WEIGHTS:
            tl.store(w_rows + idx_k[None, :] * sw_s, p.to(w_rows.dtype.element_ty),
                     mask=r_in & (offs_k[None, :] < Tk))  # fmt: skip


@triton.jit
def _fwd_context(p_rows, x_batch, c_rows, r_in, key_end, Dv, ss_s, sx_s, sx_d, sc_d,
                 USE_DOT: tl.constexpr, LOWP_DOT: tl.constexpr, INT64: tl.constexpr,
                 ROWS2: tl.constexpr, BLOCK_K2: tl.constexpr, BLOCK_DV: tl.constexpr):  # fmt: skip
    """context rows = p rows @ values[:key_end], Dv chunk by Dv chunk."""
    for d0 in range(0, Dv, BLOCK_DV):
        offs_d = d0 + tl.arange(0, BLOCK_DV)
        d_in = offs_d < Dv
        idx_d = _index(offs_d, INT64)
        acc = tl.zeros((ROWS2, BLOCK_DV), dtype=tl.float32)
        for k0 in range(0, key_end, BLOCK_K2):
            offs_k = k0 + tl.arange(0, BLOCK_K2)
            idx_k = _index(offs_k, INT64)
            p = tl.load(p_rows + idx_k[None, :] * ss_s,
                        mask=r_in & (offs_k[None, :] < key_end), other=0.0)  # fmt: skip
            vals = tl.load(x_batch + idx_k[:, None] * sx_s + idx_d[None, :] * sx_d,
                           mask=(offs_k[:, None] < key_end) & d_in[None, :], other=0.0)  # fmt: skip
            acc = _matmul_acc(acc, p, vals, USE_DOT, LOWP_DOT)
        tl.store(c_rows + idx_d[None, :] * sc_d, acc.to(c_rows.dtype.element_ty),
                 mask=r_in & d_in[None, :])  # fmt: skip


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, x_ptr, v_ptr, b_ptr, len_ptr, mask_ptr, sb_ptr,  # inputs (x = values)
    c_ptr, w_ptr, s_ptr, lse_ptr,  # outputs: context, weights, fp32 score scratch, lse
    Tq, Tk, H, Dv, n_qt,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sx_b, sx_s, sx_d, s_v, s_b, s_len, sm_b, sm_s,
    sc_b, sc_t, sc_d, sw_b, sw_t, sw_s, ss_b, ss_t, ss_s, sl_b, sl_t,
    HAS_LENGTHS: tl.constexpr, HAS_MASK: tl.constexpr, RETURN_WEIGHTS: tl.constexpr,
    TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr, USE_DOT: tl.constexpr,
    LOWP_DOT: tl.constexpr, INT64: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, ROWS2: tl.constexpr, BLOCK_K2: tl.constexpr,
    SIGMOID: tl.constexpr = False, HAS_SCORE_BIAS: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_b = _index(pid // n_qt, INT64)
    row0 = (pid % n_qt) * BLOCK_Q
    key_end = _key_end(len_ptr, pid_b, s_len, Tk, HAS_LENGTHS)
    shift = 0.0
    if HAS_SCORE_BIAS:
        shift = tl.load(sb_ptr).to(tl.float32)

    # Phase 1: scores, online max / sum, raw scores parked in the fp32 scratch.
    offs_q = row0 + tl.arange(0, BLOCK_Q)
    q_in = (offs_q < Tq)[:, None]
    idx_q = _index(offs_q, INT64)
    m_i, l_i, num_valid = _scores_pass(
        q_ptr + pid_b * sq_b + idx_q[:, None] * sq_t, k_ptr + pid_b * sk_b, v_ptr, b_ptr,
        mask_ptr + pid_b * sm_b, s_ptr + pid_b * ss_b + idx_q[:, None] * ss_t, s_ptr, 0.0,
        q_in, Tk, key_end, H, sq_h, sk_s, sk_h, s_v, s_b, sm_s, ss_s, shift, HAS_MASK, TANH_MODE,
        FAST_RCP, INT64, BLOCK_Q, BLOCK_K, BLOCK_H, True, SIGMOID, HAS_SCORE_BIAS,
    )  # fmt: skip
    # +inf for a row with no valid key: exp(s - lse) is then 0 everywhere, never NaN. "No valid
    # key" comes from the count, not from l: a row whose scores are NaN or +-inf must come out
    # NaN, as the reference's softmax gives it, not as an empty row.
    has_key = num_valid > 0
    lse = tl.where(has_key, m_i + tl.log(tl.where(has_key, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + pid_b * sl_b + idx_q * sl_t, lse, mask=offs_q < Tq)
    # The scratch and lse written above are read back below in other thread layouts.
    tl.debug_barrier()

    # Phase 2 has its own tiling: ROWS2 rows (>= 16 where tl.dot applies; rows past this
    # program's BLOCK_Q read as masked and are never stored) x BLOCK_K2 keys x BLOCK_DV values.
    offs_r = row0 + tl.arange(0, ROWS2)
    r_in = ((tl.arange(0, ROWS2) < BLOCK_Q) & (offs_r < Tq))[:, None]
    idx_r = _index(offs_r, INT64)
    lse2 = tl.load(lse_ptr + pid_b * sl_b + idx_r * sl_t, mask=r_in.reshape(ROWS2),
                   other=float("inf"))  # fmt: skip
    s_rows = s_ptr + pid_b * ss_b + idx_r[:, None] * ss_t
    _fwd_normalise(s_rows, w_ptr + pid_b * sw_b + idx_r[:, None] * sw_t, lse2, r_in, Tk,
                   key_end, ss_s, sw_s, RETURN_WEIGHTS, INT64, BLOCK_K2)  # fmt: skip
    tl.debug_barrier()
    _fwd_context(s_rows, x_ptr + pid_b * sx_b, c_ptr + pid_b * sc_b + idx_r[:, None] * sc_t,
                 r_in, key_end, Dv, ss_s, sx_s, sx_d, sc_d, USE_DOT, LOWP_DOT, INT64, ROWS2,
                 BLOCK_K2, BLOCK_DV)  # fmt: skip


# --- backward --------------------------------------------------------------------------------------


@triton.jit
def _bwd_dp_pass(g_rows, gw_rows, x_batch, p_rows, ds_rows, r_in, Tk, key_end, Dv,
                 sg_d, sgw_s, sx_s, sx_d, ss_s, HAS_GRAD_WEIGHTS: tl.constexpr,
                 USE_DOT: tl.constexpr, LOWP_DOT: tl.constexpr, INT64: tl.constexpr,
                 ROWS2: tl.constexpr, BLOCK_K2: tl.constexpr, BLOCK_DV: tl.constexpr):  # fmt: skip
    """dp = dO . values^T (+ dWeights) into the ds scratch; returns delta = sum_s p * dp."""
    delta = tl.zeros((ROWS2,), dtype=tl.float32)
    for k0 in range(0, key_end, BLOCK_K2):
        offs_k = k0 + tl.arange(0, BLOCK_K2)
        idx_k = _index(offs_k, INT64)
        # Values past the row's length are not read (as in the forward): a non-finite value in
        # the padding must not reach dp, where p * dp = 0 * inf would poison delta and the row.
        k_in = offs_k[:, None] < key_end
        dp = tl.zeros((ROWS2, BLOCK_K2), dtype=tl.float32)
        for d0 in range(0, Dv, BLOCK_DV):
            offs_d = d0 + tl.arange(0, BLOCK_DV)
            d_in = offs_d < Dv
            idx_d = _index(offs_d, INT64)
            grad_out = tl.load(g_rows + idx_d[None, :] * sg_d, mask=r_in & d_in[None, :], other=0.0)
            vals = tl.load(x_batch + idx_k[:, None] * sx_s + idx_d[None, :] * sx_d,
                           mask=k_in & d_in[None, :], other=0.0)  # fmt: skip
            dp = _matmul_acc(dp, grad_out.to(tl.float32), tl.trans(vals), USE_DOT, LOWP_DOT)
        in_tile = r_in & (offs_k[None, :] < key_end)  # the scratch past key_end is never written
        if HAS_GRAD_WEIGHTS:
            dp += tl.load(gw_rows + idx_k[None, :] * sgw_s, mask=in_tile, other=0.0).to(tl.float32)
        p = tl.load(p_rows + idx_k[None, :] * ss_s, mask=in_tile, other=0.0)
        delta += tl.sum(p * dp, axis=1)
        tl.store(ds_rows + idx_k[None, :] * ss_s, dp, mask=in_tile)
    return delta


@triton.jit
def _bwd_ds_finish(p_rows, ds_rows, om_rows, delta, r_in, Tk, key_end, ss_s, INT64: tl.constexpr,
                   BLOCK_K2: tl.constexpr, SIGMOID: tl.constexpr):  # fmt: skip
    """ds = p * (dp - delta), in place of dp; SIGMOID: times 1 - sigmoid(s) from om_rows."""
    for k0 in range(0, key_end, BLOCK_K2):
        offs_k = k0 + tl.arange(0, BLOCK_K2)
        offsets = _index(offs_k, INT64)[None, :] * ss_s
        in_tile = r_in & (offs_k[None, :] < key_end)
        p = tl.load(p_rows + offsets, mask=in_tile, other=0.0)
        dp = tl.load(ds_rows + offsets, mask=in_tile, other=0.0)
        ds = p * (dp - delta[:, None])
        if SIGMOID:
            ds = ds * tl.load(om_rows + offsets, mask=in_tile, other=0.0)
        tl.store(ds_rows + offsets, ds, mask=in_tile)


@triton.jit
def _bwd_ds_kernel(
    g_ptr, gw_ptr, q_ptr, k_ptr, x_ptr, v_ptr, b_ptr, len_ptr, mask_ptr, lse_ptr, sb_ptr,  # inputs
    p_ptr, ds_ptr, om_ptr,  # outputs: fp32 scratch [B, Tq, Tk], p, ds and (SIGMOID) 1 - sigmoid(s)
    Tq, Tk, H, Dv, n_qt,
    sg_b, sg_t, sg_d, sgw_b, sgw_t, sgw_s, sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sx_b, sx_s, sx_d,
    s_v, s_b, s_len, sm_b, sm_s, sl_b, sl_t, ss_b, ss_t, ss_s,
    HAS_LENGTHS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_GRAD_WEIGHTS: tl.constexpr,
    TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr, USE_DOT: tl.constexpr,
    LOWP_DOT: tl.constexpr, INT64: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, ROWS2: tl.constexpr, BLOCK_K2: tl.constexpr,
    SIGMOID: tl.constexpr = False, HAS_SCORE_BIAS: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_b = _index(pid // n_qt, INT64)
    row0 = (pid % n_qt) * BLOCK_Q
    key_end = _key_end(len_ptr, pid_b, s_len, Tk, HAS_LENGTHS)
    shift = 0.0
    if HAS_SCORE_BIAS:
        shift = tl.load(sb_ptr).to(tl.float32)

    # Phase 1: recompute the scores, p = exp(s - lse) into the probs scratch. Padded query rows
    # get lse = +inf, hence p = 0 and ds = 0.
    offs_q = row0 + tl.arange(0, BLOCK_Q)
    idx_q = _index(offs_q, INT64)
    lse = tl.load(lse_ptr + pid_b * sl_b + idx_q * sl_t, mask=offs_q < Tq, other=float("inf"))
    _scores_pass(
        q_ptr + pid_b * sq_b + idx_q[:, None] * sq_t, k_ptr + pid_b * sk_b, v_ptr, b_ptr,
        mask_ptr + pid_b * sm_b, p_ptr + pid_b * ss_b + idx_q[:, None] * ss_t,
        om_ptr + pid_b * ss_b + idx_q[:, None] * ss_t, lse,
        (offs_q < Tq)[:, None], Tk, key_end, H, sq_h, sk_s, sk_h, s_v, s_b, sm_s, ss_s, shift,
        HAS_MASK, TANH_MODE, FAST_RCP, INT64, BLOCK_Q, BLOCK_K, BLOCK_H, False, SIGMOID,
        HAS_SCORE_BIAS,
    )  # fmt: skip
    tl.debug_barrier()

    # Phases 2 and 3, on the dot tiling of the forward's phase 2 (ROWS2 rows, rows past BLOCK_Q
    # masked): dp and delta, then ds = p * (dp - delta).
    offs_r = row0 + tl.arange(0, ROWS2)
    r_in = ((tl.arange(0, ROWS2) < BLOCK_Q) & (offs_r < Tq))[:, None]
    idx_r = _index(offs_r, INT64)
    scratch_rows = pid_b * ss_b + idx_r[:, None] * ss_t
    delta = _bwd_dp_pass(
        g_ptr + pid_b * sg_b + idx_r[:, None] * sg_t, gw_ptr + pid_b * sgw_b + idx_r[:, None] * sgw_t,
        x_ptr + pid_b * sx_b, p_ptr + scratch_rows, ds_ptr + scratch_rows, r_in, Tk, key_end, Dv,
        sg_d, sgw_s, sx_s, sx_d, ss_s, HAS_GRAD_WEIGHTS, USE_DOT, LOWP_DOT, INT64, ROWS2,
        BLOCK_K2, BLOCK_DV,
    )  # fmt: skip
    tl.debug_barrier()
    _bwd_ds_finish(p_ptr + scratch_rows, ds_ptr + scratch_rows, om_ptr + scratch_rows, delta, r_in,
                   Tk, key_end, ss_s, INT64, BLOCK_K2, SIGMOID)  # fmt: skip


@triton.jit
def _grad_key_tile(q_batch, ds_batch, gq_batch, k, v, bias, h_in, offs_k, idx_k, Tq, key_end,
                   accumulate, sq_t, ss_t, ss_s, sgq_t, TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr,
                   INT64: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_H: tl.constexpr):  # fmt: skip
    """One key tile x H chunk against every query: adds sum_s g v to grad query (in memory) and
    returns (sum_t g, sum_t ds u), g = ds (1 - u^2), u = tanh(q + k + bias).

    q_batch / gq_batch: [1, BLOCK_H] pointers to query / fp32 grad query [b, 0, h chunk];
    k: the [BLOCK_K, BLOCK_H] float32 keys of this tile; accumulate: false on the first key tile,
    whose grad query rows are written, not added to (no zero fill). ds is read below key_end.
    """
    grad_k_acc = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    grad_v_acc = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    for q0 in range(0, Tq, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        idx_q = _index(offs_q, INT64)
        q_in = offs_q[:, None] < Tq
        q = tl.load(q_batch + idx_q[:, None] * sq_t, mask=q_in & h_in[None, :], other=0.0)
        ds = tl.load(ds_batch + idx_q[:, None] * ss_t + idx_k[None, :] * ss_s,
                     mask=q_in & (offs_k[None, :] < key_end), other=0.0)[:, :, None]  # fmt: skip
        a = q.to(tl.float32) + bias[None, :]
        if TANH_MODE == 2:
            r = pair_factors(a, k, FAST_RCP)  # u = 1 - 2r, 1 - u^2 = 4 r (1 - r)
            w = ds * (1.0 - 2.0 * r)
            g = ds * (4.0 * (r - r * r))
        else:
            u = tanh(a[:, None, :] + k[None, :, :], TANH_MODE, FAST_RCP)
            w = ds * u  # d score / d v, weighted by ds
            g = ds - w * u  # ds * (1 - u^2): d loss / d pre, without the factor v
        grad_k_acc += tl.sum(g, axis=0)
        grad_v_acc += tl.sum(w, axis=0)
        gq_ptrs = gq_batch + idx_q[:, None] * sgq_t
        gq_mask = q_in & h_in[None, :]
        grad_q = tl.load(gq_ptrs, mask=gq_mask & accumulate, other=0.0)
        tl.store(gq_ptrs, grad_q + tl.sum(g, axis=1) * v[None, :], mask=gq_mask)
    return grad_k_acc, grad_v_acc


@triton.jit
def _max_abs_query(q_batch, bias, h_in, Tq, sq_t, INT64: tl.constexpr, BLOCK_Q: tl.constexpr,
                   BLOCK_H: tl.constexpr):  # fmt: skip
    """max |q + bias| over every query of this H chunk (for pair_clamp_may_matter)."""
    running = tl.zeros((BLOCK_Q, BLOCK_H), dtype=tl.float32)
    for q0 in range(0, Tq, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        q = tl.load(q_batch + _index(offs_q, INT64)[:, None] * sq_t,
                    mask=(offs_q[:, None] < Tq) & h_in[None, :], other=0.0)  # fmt: skip
        running = tl.maximum(running, tl.abs(q.to(tl.float32) + bias[None, :]))
    return tl.max(running)


@triton.jit
def _bwd_grad_kernel(
    q_ptr, k_ptr, v_ptr, b_ptr, len_ptr, ds_ptr,  # inputs
    gq_ptr, gk_ptr, gv_ptr,  # outputs: fp32 grad query [B, Tq, H] (zeroed), grad keys, fp32 [B, H]
    Tq, Tk, H, n_ht,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, s_v, s_b, s_len, ss_b, ss_t, ss_s,
    sgq_b, sgq_t, sgq_h, sgk_b, sgk_s, sgk_h, sgv_b,
    HAS_LENGTHS: tl.constexpr, TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr,
    INT64: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_b = _index(pid // n_ht, INT64)
    offs_h = (pid % n_ht) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_in = offs_h < H
    idx_h = _index(offs_h, INT64)
    v = tl.load(v_ptr + idx_h * s_v, mask=h_in, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + idx_h * s_b, mask=h_in, other=0.0).to(tl.float32)
    q_batch = q_ptr + pid_b * sq_b + idx_h[None, :] * sq_h
    k_batch = k_ptr + pid_b * sk_b + idx_h[None, :] * sk_h
    gq_batch = gq_ptr + pid_b * sgq_b + idx_h[None, :] * sgq_h
    gk_batch = gk_ptr + pid_b * sgk_b + idx_h[None, :] * sgk_h
    ds_batch = ds_ptr + pid_b * ss_b
    key_end = _key_end(len_ptr, pid_b, s_len, Tk, HAS_LENGTHS)
    max_abs_q = 0.0
    if TANH_MODE == 2:
        max_abs_q = _max_abs_query(q_batch, bias, h_in, Tq, sq_t, INT64, BLOCK_Q, BLOCK_H)

    grad_v_acc = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)
    for k0 in range(0, key_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx_k = _index(offs_k, INT64)
        # Keys past the row's length are not read: their ds is 0, but 0 * sech^2(NaN) would
        # still reach grad query (their grad keys rows are stored as 0).
        k = tl.load(k_batch + idx_k[:, None] * sk_s,
                    mask=(offs_k[:, None] < key_end) & h_in[None, :], other=0.0).to(tl.float32)  # fmt: skip
        # The product path, unless its clamp could matter here (never on sane data): exact tanh.
        exact = False
        if TANH_MODE == 2:
            max_abs_k = tl.max(tl.abs(k))
            exact = pair_clamp_may_matter(max_abs_q, max_abs_k) | product_too_coarse(
                max_abs_q, max_abs_k
            )
        if exact:
            grad_k_acc, grad_v_part = _grad_key_tile(
                q_batch, ds_batch, gq_batch, k, v, bias, h_in, offs_k, idx_k, Tq, key_end,
                k0 > 0, sq_t, ss_t, ss_s, sgq_t, 0, FAST_RCP, INT64, BLOCK_Q, BLOCK_K, BLOCK_H,
            )  # fmt: skip
        else:
            grad_k_acc, grad_v_part = _grad_key_tile(
                q_batch, ds_batch, gq_batch, k, v, bias, h_in, offs_k, idx_k, Tq, key_end,
                k0 > 0, sq_t, ss_t, ss_s, sgq_t, TANH_MODE, FAST_RCP, INT64, BLOCK_Q, BLOCK_K, BLOCK_H,
            )  # fmt: skip
        grad_v_acc += grad_v_part
        tl.store(gk_batch + idx_k[:, None] * sgk_s, (grad_k_acc * v[None, :]).to(gk_ptr.dtype.element_ty),
                 mask=(offs_k[:, None] < Tk) & h_in[None, :])  # fmt: skip
        # This program re-reads its grad-query rows in the next key tile.
        tl.debug_barrier()
    tl.store(gv_ptr + pid_b * sgv_b + idx_h, tl.sum(grad_v_acc, axis=0), mask=h_in)
    _zero_unvisited(gq_batch, gk_batch, h_in, Tq, Tk, key_end, sgq_t, sgk_s, INT64, BLOCK_Q,
                    BLOCK_K, BLOCK_H)  # fmt: skip


@triton.jit
def _zero_unvisited(gq_batch, gk_batch, h_in, Tq, Tk, key_end, sgq_t, sgk_s, INT64: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """Zeros where the key loop wrote nothing: grad keys past the last visited key tile, and the
    grad query rows of a batch row without keys (instead of zero-filling the buffers per call)."""
    for k0 in range(tl.cdiv(key_end, BLOCK_K) * BLOCK_K, Tk, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        tl.store(gk_batch + _index(offs_k, INT64)[:, None] * sgk_s,
                 tl.zeros((BLOCK_K, BLOCK_H), dtype=gk_batch.dtype.element_ty),
                 mask=(offs_k[:, None] < Tk) & h_in[None, :])  # fmt: skip
    if key_end == 0:
        for q0 in range(0, Tq, BLOCK_Q):
            offs_q = q0 + tl.arange(0, BLOCK_Q)
            tl.store(gq_batch + _index(offs_q, INT64)[:, None] * sgq_t,
                     tl.zeros((BLOCK_Q, BLOCK_H), dtype=tl.float32),
                     mask=(offs_q[:, None] < Tq) & h_in[None, :])  # fmt: skip


@triton.jit
def _bwd_dvalues_kernel(
    p_ptr, g_ptr, len_ptr, gx_ptr,  # fp32 probs scratch, grad context, lengths; grad values
    Tq, Tk, Dv, n_kt, n_dt,
    ss_b, ss_t, ss_s, sg_b, sg_t, sg_d, s_len, sgx_b, sgx_s, sgx_d,
    HAS_LENGTHS: tl.constexpr, USE_DOT: tl.constexpr, LOWP_DOT: tl.constexpr, INT64: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    pid_b = _index(pid // (n_kt * n_dt), INT64)
    pid_rest = pid % (n_kt * n_dt)
    offs_k = (pid_rest // n_dt) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = (pid_rest % n_dt) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    idx_k = _index(offs_k, INT64)
    idx_d = _index(offs_d, INT64)
    k_in = offs_k < Tk
    live = offs_k < _key_end(len_ptr, pid_b, s_len, Tk, HAS_LENGTHS)  # probs past it: unwritten
    d_in = offs_d < Dv
    p_batch = p_ptr + pid_b * ss_b + idx_k[None, :] * ss_s
    g_batch = g_ptr + pid_b * sg_b + idx_d[None, :] * sg_d

    acc = tl.zeros((BLOCK_K, BLOCK_DV), dtype=tl.float32)
    for q0 in range(0, Tq, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        idx_q = _index(offs_q, INT64)
        q_in = offs_q[:, None] < Tq
        p = tl.load(p_batch + idx_q[:, None] * ss_t, mask=q_in & live[None, :], other=0.0)
        grad_out = tl.load(g_batch + idx_q[:, None] * sg_t, mask=q_in & d_in[None, :], other=0.0)
        if USE_DOT:
            if LOWP_DOT:
                acc += tl.dot(tl.trans(p.to(grad_out.dtype)), grad_out)
            else:
                acc += tl.dot(tl.trans(p), grad_out.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.sum(p[:, :, None] * grad_out.to(tl.float32)[:, None, :], axis=0)
    tl.store(gx_ptr + pid_b * sgx_b + idx_k[:, None] * sgx_s + idx_d[None, :] * sgx_d,
             acc.to(gx_ptr.dtype.element_ty), mask=k_in[:, None] & d_in[None, :])  # fmt: skip


# --- launchers -------------------------------------------------------------------------------------


def needs_int64_offsets(*tensors: torch.Tensor | None) -> bool:
    """Whether an element offset of one of these tensors can reach 2^31 (then all index math is
    done in int64; below that int32 saves address instructions and registers)."""
    limit = 2**31 - 1
    for t in tensors:
        if t is not None and t.numel() > 0:
            span = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
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


def _optional_args(lengths, mask, fallback: torch.Tensor) -> tuple:
    """(lengths, its stride, mask as uint8, its two strides); ``fallback`` stands in for None."""
    if lengths is None:
        len_t, s_len = fallback, 0
    else:
        len_t = lengths if lengths.dtype == torch.int64 else lengths.to(torch.int64)
        s_len = len_t.stride(0)
    if mask is None:
        return len_t, s_len, fallback, 0, 0
    mask_u8 = mask.view(torch.uint8)  # bool is one byte: same storage, loadable as integers
    return len_t, s_len, mask_u8, mask_u8.stride(0), mask_u8.stride(1)


def _sigmoid(normalize: str) -> bool:
    """The SIGMOID constexpr of a ``normalize`` name (ValueError for any other name)."""
    if normalize not in ("softmax", "sigmoid"):
        raise ValueError(f"normalize must be 'softmax' or 'sigmoid', got {normalize!r}")
    return normalize == "sigmoid"


def _common_constexprs(dtype: torch.dtype, device: torch.device, tanh: str, int64: bool) -> dict:
    return {
        "TANH_MODE": TANH_CODES[resolve_tanh(tanh, dtype, device)],
        "FAST_RCP": fast_rcp(),
        "LOWP_DOT": _lowp_dot(dtype),
        "INT64": int64,
        "enable_fp_fusion": True,  # FMA contraction: Triton 3.10 turns it off by default
    }


@functools.cache
def _sms(device: torch.device) -> int:
    """Multiprocessors the tiles are planned for: the GPU's; 1 under the interpreter, which runs
    programs one after another (fewer, larger programs keep the CPU tests fast)."""
    if device.type == "cuda" and not is_interpreted():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1 if is_interpreted() else H200_SMS


def _mode_name(consts: dict) -> str:
    return {code: name for name, code in TANH_CODES.items()}[consts["TANH_MODE"]]


def _tile_constexprs(cfg: TileConfig) -> dict:
    return {
        "USE_DOT": cfg.use_dot, "BLOCK_Q": cfg.block_q, "BLOCK_K": cfg.block_k,
        "BLOCK_H": cfg.block_h, "BLOCK_DV": cfg.block_dv, "ROWS2": cfg.rows2,
        "BLOCK_K2": cfg.block_k2, "num_warps": cfg.num_warps,
    }  # fmt: skip


def _fwd_impl(query, keys, values, v, bias, lengths, mask, return_weights, config, tanh,
              normalize, score_bias=None):  # fmt: skip
    batch, num_queries, hidden = query.shape
    num_keys, value_dim = values.shape[1], values.shape[2]
    dtype, device = query.dtype, query.device
    if bias is None:
        bias = query.new_zeros(hidden)
    context = torch.empty((batch, num_queries, value_dim), dtype=dtype, device=device)
    weights_shape = (batch, num_queries, num_keys) if return_weights else (0,)
    weights = torch.empty(weights_shape, dtype=dtype, device=device)
    lse = torch.empty((batch, num_queries), dtype=torch.float32, device=device)
    if batch * num_queries == 0:
        return context, weights, lse

    consts = _common_constexprs(dtype, device, tanh, False)
    cfg = config or forward_config(num_queries, num_keys, hidden, value_dim, dtype=dtype,
                                   batch=batch, sms=_sms(device), mode=_mode_name(consts))  # fmt: skip
    scores = torch.empty((batch, num_queries, num_keys), dtype=torch.float32, device=device)
    len_t, s_len, mask_t, sm_b, sm_s = _optional_args(lengths, mask, lse)
    weights_t = weights if return_weights else scores
    consts["INT64"] = needs_int64_offsets(query, keys, values, context, weights_t, scores, mask)
    n_qt = triton.cdiv(num_queries, cfg.block_q)
    _fwd_kernel[(batch * n_qt,)](
        query, keys, values, v, bias, len_t, mask_t, lse if score_bias is None else score_bias,
        context, weights_t, scores, lse,
        num_queries, num_keys, hidden, value_dim, n_qt,
        *query.stride(), *keys.stride(), *values.stride(), v.stride(0), bias.stride(0), s_len,
        sm_b, sm_s, *context.stride(), *weights_t.stride(), *scores.stride(), *lse.stride(),
        HAS_LENGTHS=lengths is not None, HAS_MASK=mask is not None,
        RETURN_WEIGHTS=bool(return_weights), SIGMOID=_sigmoid(normalize),
        HAS_SCORE_BIAS=score_bias is not None, **consts, **_tile_constexprs(cfg),
    )  # fmt: skip
    return context, weights, lse


def _launch_bwd_ds(grad_context, grad_weights, query, keys, values, v, bias, lengths, mask,
                   lse, probs, ds, cfg, consts, one_minus=None, score_bias=None):  # fmt: skip
    batch, num_queries, hidden = query.shape
    num_keys, value_dim = values.shape[1], values.shape[2]
    len_t, s_len, mask_t, sm_b, sm_s = _optional_args(lengths, mask, lse)
    grad_weights_t = grad_weights if grad_weights is not None else probs
    n_qt = triton.cdiv(num_queries, cfg.block_q)
    _bwd_ds_kernel[(batch * n_qt,)](
        grad_context, grad_weights_t, query, keys, values, v, bias, len_t, mask_t, lse,
        lse if score_bias is None else score_bias, probs, ds, ds if one_minus is None else one_minus, num_queries, num_keys, hidden, value_dim, n_qt,
        *grad_context.stride(), *grad_weights_t.stride(), *query.stride(), *keys.stride(),
        *values.stride(), v.stride(0), bias.stride(0), s_len, sm_b, sm_s, *lse.stride(),
        *probs.stride(),
        HAS_LENGTHS=lengths is not None, HAS_MASK=mask is not None,
        HAS_GRAD_WEIGHTS=grad_weights is not None, SIGMOID=one_minus is not None,
        HAS_SCORE_BIAS=score_bias is not None, **consts, **_tile_constexprs(cfg),
    )  # fmt: skip


def _launch_bwd_grad(query, keys, v, bias, lengths, ds, grad_query_f32, grad_keys, grad_v_partial,
                     cfg, consts):  # fmt: skip
    batch, num_queries, hidden = query.shape
    len_t, s_len, _, _, _ = _optional_args(lengths, None, ds)
    n_ht = triton.cdiv(hidden, cfg.block_h)
    consts = {key: val for key, val in consts.items() if key != "LOWP_DOT"}
    _bwd_grad_kernel[(batch * n_ht,)](
        query, keys, v, bias, len_t, ds, grad_query_f32, grad_keys, grad_v_partial,
        num_queries, keys.shape[1], hidden, n_ht,
        *query.stride(), *keys.stride(), v.stride(0), bias.stride(0), s_len, *ds.stride(),
        *grad_query_f32.stride(), *grad_keys.stride(), grad_v_partial.stride(0),
        HAS_LENGTHS=lengths is not None, BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k,
        BLOCK_H=cfg.block_h, num_warps=cfg.num_warps, **consts,
    )  # fmt: skip


def _launch_bwd_dvalues(probs, grad_context, lengths, grad_values, cfg, consts):
    batch, num_queries, num_keys = probs.shape
    value_dim = grad_values.shape[2]
    len_t, s_len, _, _, _ = _optional_args(lengths, None, probs)
    n_kt = triton.cdiv(num_keys, cfg.block_k)
    n_dt = triton.cdiv(value_dim, cfg.block_dv)
    _bwd_dvalues_kernel[(batch * n_kt * n_dt,)](
        probs, grad_context, len_t, grad_values, num_queries, num_keys, value_dim, n_kt, n_dt,
        *probs.stride(), *grad_context.stride(), s_len, *grad_values.stride(),
        HAS_LENGTHS=lengths is not None, USE_DOT=min(cfg.block_q, cfg.block_k, cfg.block_dv) >= 16, LOWP_DOT=consts["LOWP_DOT"],
        INT64=consts["INT64"], BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k, BLOCK_DV=cfg.block_dv,
        num_warps=cfg.num_warps, enable_fp_fusion=True,
    )  # fmt: skip


def _bwd_impl(grad_context, grad_weights, query, keys, values, v, bias, lengths, mask, lse,
              configs, tanh, normalize, score_bias=None):  # fmt: skip
    batch, num_queries, hidden = query.shape
    num_keys, value_dim = values.shape[1], values.shape[2]
    dtype, device = query.dtype, query.device
    if bias is None:
        bias = query.new_zeros(hidden)
    inputs = (query, keys, values, v, bias) + (() if score_bias is None else (score_bias,))
    # contiguous whatever the inputs' strides, as the CPU kernels' and the fake kernels' outputs
    grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs)
    grad_query, grad_keys, grad_values, grad_v, grad_bias = grads[:5]
    if batch * num_queries * num_keys == 0:  # no (query, key) pair: every gradient is zero
        for grad in grads:
            grad.zero_()
        return grads

    consts = _common_constexprs(dtype, device, tanh, False)
    ds_cfg, grad_cfg, dvalues_cfg = configs or backward_configs(
        batch, num_queries, num_keys, hidden, value_dim, dtype=dtype, sms=_sms(device),
        mode=_mode_name(consts),
    )  # fmt: skip
    # No zero fills: the kernels read the scratch below each row's length only, and write every
    # element of the gradients (zeros where no key is visited).
    probs = torch.empty((batch, num_queries, num_keys), dtype=torch.float32, device=device)
    # (zero-filled for a score bias: its gradient is the sum of ds, written below the lengths)
    ds = torch.empty_like(probs) if score_bias is None else torch.zeros_like(probs)
    one_minus = torch.empty_like(probs) if _sigmoid(normalize) else None  # 1 - sigmoid(s)
    int64 = needs_int64_offsets(query, keys, values, grad_context, grad_weights, grad_keys,
                                grad_values, probs, mask)  # fmt: skip
    consts["INT64"] = int64
    _launch_bwd_ds(grad_context, grad_weights, query, keys, values, v, bias, lengths, mask, lse,
                   probs, ds, ds_cfg, consts, one_minus, score_bias)  # fmt: skip
    grad_query_f32 = torch.empty((batch, num_queries, hidden), dtype=torch.float32, device=device)
    grad_v_partial = torch.empty((batch, hidden), dtype=torch.float32, device=device)
    if hidden > 0:
        _launch_bwd_grad(query, keys, v, bias, lengths, ds, grad_query_f32, grad_keys,
                         grad_v_partial, grad_cfg, consts)  # fmt: skip
    if value_dim > 0:
        _launch_bwd_dvalues(probs, grad_context, lengths, grad_values, dvalues_cfg, consts)
    # Fixed-order reductions in torch: deterministic, no float atomics.
    grad_query.copy_(grad_query_f32)
    grad_v.copy_(grad_v_partial.sum(dim=0))
    grad_bias.copy_(grad_query_f32.sum(dim=(0, 1)))
    if score_bias is not None:
        grads[5].copy_(ds.sum().reshape(score_bias.shape))
    return grads


def additive_attention_fwd(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    lengths: torch.Tensor | None,
    mask: torch.Tensor | None,
    return_weights: bool,
    normalize: str = "softmax",
    score_bias: torch.Tensor | None = None,
    *,
    config: TileConfig | None = None,
    tanh: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of the op (contract in ``seq2seq_fast.ops.additive_attention``).

    Args:
        query [B, Tq, H], keys [B, Tk, H], values [B, Tk, Dv], v [H], bias [H] or None: one dtype
            (float32, float16 or bfloat16), any strides.
        lengths: int [B] (0 <= length <= Tk) or None. mask: bool [B, Tk] (True = attend) or None.
        return_weights: also write the [B, Tq, Tk] weights.
        normalize: "softmax" or "sigmoid" (sigmoid(e) / sum sigmoid(e); lse = log sum sigmoid(e)).
        score_bias: None or a one-element tensor b added to every score before the normalisation.
        config: tile override (benchmarks); None picks :func:`forward_config`.
        tanh: "auto" (default; see :func:`tanh_override`), "approx", "packed", "product", "exp".

    Returns:
        context [B, Tq, Dv] and weights [B, Tq, Tk] (an empty [0] tensor when not asked) in the
        input dtype; lse float32 [B, Tq] = max + log(sum(exp)) of the valid scores, +inf for a row
        without a valid key.
    """
    with _on_device(query.device):
        return _fwd_impl(query, keys, values, v, bias, lengths, mask, return_weights, config, tanh,
                         normalize, score_bias)  # fmt: skip


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
    normalize: str = "softmax",
    score_bias: torch.Tensor | None = None,
    *,
    configs: tuple[TileConfig, TileConfig, TileConfig] | None = None,
    tanh: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the op: grads for (query, keys, values, v, bias), each in its input's dtype.

    Args:
        grad_context [B, Tq, Dv]; grad_weights [B, Tq, Tk] or None; query, keys, values, v, bias,
        lengths, mask as in :func:`additive_attention_fwd`; context [B, Tq, Dv] (unused: delta is
        recomputed exactly from p and dp rather than from the rounded context); lse float32 [B, Tq]
        from the forward; weights: the forward's weights when the caller kept them (unused here:
        p = exp(e - lse) is recomputed in the score tiles, where it costs one exp per pair and
        saves reading a [B, Tq, Tk] tensor). configs: tile override (benchmarks); tanh: as in
        :func:`additive_attention_fwd`; normalize, score_bias: as in
        :func:`additive_attention_fwd` (with a score bias, a sixth gradient: the score bias's).
    """
    del context, weights
    with _on_device(query.device):
        return _bwd_impl(grad_context, grad_weights, query, keys, values, v, bias, lengths, mask,
                         lse, configs, tanh, normalize, score_bias)  # fmt: skip
