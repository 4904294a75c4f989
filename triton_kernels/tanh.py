"""tanh paths of the Triton kernels, and the choice between them.

    "product"  tanh(a + b) = 1 - 2 / (1 + e^{2a} e^{2b}) with a = q + bias, b = k: the two
               exponentials are taken on the 2D operand tiles and shared by the other operand's
               rows, so each tanh costs one FMA and one reciprocal (rcp.approx.ftz.f32, one MUFU
               op, <= 1 ulp) plus (1/BLOCK_Q + 1/BLOCK_K) exponentials. A score becomes
               sum_h v - 2 sum_h v r. Operands are clamped to +-43 before exponentiation (finite,
               nonzero factors: no inf * 0); a tile whose operands exceed +-34 on both sides,
               where the clamp could change a result, is recomputed with the "exp" path (never
               on sane data; tested on crafted inputs). Error: a few float32 ulps of 1, absolute:
               a tile whose operands all lie within max |a| + max |b| < 2 takes "exp" too.
               At BLOCK_Q = 1 (the decoding step) the key exponentials cost one MUFU op per tanh.
    "approx"   PTX tanh.approx.f32: one MUFU op per tanh, CUDA only. Maximum relative error
               2^-10.987 (~4.9e-4) per the PTX ISA; bench/gpu_check.py measures it.
    "packed"   PTX tanh.approx.bf16x2 (sm_90+), the argument rounded to bfloat16 first and the
               result a bfloat16 (relative error ~2^-8). sm_90 runs it as two MUFU.TANH.BF16 ops,
               one per half (bench/compile_check.py reads the SASS): no fewer MUFU ops than
               "approx", ~6% fewer instructions in the forward's tanh loop. Opt-in until a GPU
               run has measured it (bench/gpu_check.py probes its error).
    "exp"      tanh|x| = (1 - t) / (1 + t), t = exp(-2|x|), sign restored, and the odd Taylor
               series to x^7 for |x| < 0.125 where 1 - t cancels. Absolute error <= ~1e-7.
               Two MUFU ops and ~17 FP32 ops per tanh: the exact fallback of "product".

Choice (:func:`resolve_tanh`): an explicit ``tanh=`` argument of the launchers wins; else the
innermost :func:`tanh_override` context; else "auto": "approx" for float16 / bfloat16 on CUDA
(their input rounding, 2^-11 and 2^-8, is as coarse), "product" for float32. Under Triton's
interpreter (no inline PTX) "approx" and "packed" run as "product".
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

__all__ = [
    "TANH_CODES",
    "auto_tanh",
    "TANH_MODES",
    "is_interpreted",
    "resolve_tanh",
    "tanh_override",
    "tanh_probe",
]

TANH_MODES = ("auto", "approx", "packed", "product", "exp")
TANH_CODES = {"exp": 0, "approx": 1, "product": 2, "packed": 3}  # the kernels' TANH_MODE constexpr
# Product path: each operand of tanh(a + b) is clamped to +-PAIR_CLAMP before exponentiation; a
# tile is recomputed exactly unless that cannot matter (see pair_clamp_may_matter).
PAIR_CLAMP = tl.constexpr(43.0)
PAIR_SAFE_OTHER = tl.constexpr(34.0)
SUM_ABS_V_LIMIT = tl.constexpr(1.0e37)  # FLT_MAX / 34: sum_h v - 2 sum_h v r cannot overflow
# Smallest max |a| + max |b| of a tile for the product path (the C++ kernels' kProductMinSum,
# csrc/kernels/kernels.h): its error is absolute (a few ulps of 1) while tanh(x) ~ x near 0, so a
# tile whose pre-activations all lie within +-1/4 takes the "exp" path (relative near 0).
PRODUCT_MIN_SUM = tl.constexpr(0.25)

_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "seq2seq_fast_tanh", default=None
)


# --- device helpers --------------------------------------------------------------------------------


@triton.jit
def rcp(x, FAST_RCP: tl.constexpr):
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
def _tanh_exp(x):
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    y = (1.0 - t) / (1.0 + t)
    # Near 0, 1 - t cancels; the odd Taylor series to x^7 is exact to < 2e-9 relative there.
    x2 = x * x
    series = x + x * x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0)))
    return tl.where(ax < 0.125, series, tl.where(x < 0.0, -y, y))


@triton.jit
def tanh(x, TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr):
    """Elementwise tanh of a float32 tensor (float32 result); the module doc gives the errors."""
    if TANH_MODE == 1:  # approx
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    elif TANH_MODE == 3:  # packed: two bfloat16 per 32-bit register, one MUFU op for both
        y = tl.inline_asm_elementwise(
            "tanh.approx.bf16x2 $0, $1;",
            "=r,r",
            [x.to(tl.bfloat16)],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=2,
        )
        return y.to(tl.float32)
    elif TANH_MODE == 2:  # product (here with the second factor 1: exp(2x) = e^{2x} * e^0)
        e = tl.exp(_clamp_pair_operand(2.0 * x))
        return 1.0 - 2.0 * rcp(e + 1.0, FAST_RCP)
    else:
        return _tanh_exp(x)


@triton.jit
def pair_factors(a, b, FAST_RCP: tl.constexpr):
    """r = 1 / (1 + e^{2a} e^{2b}) for a [M, H] and b [N, H] -> [M, N, H]; tanh(a + b) = 1 - 2r.

    The exponentials are taken on the 2D operands (amortised over the other operand's rows), so
    each 3D element costs one FMA and one reciprocal. Each operand is clamped to +-PAIR_CLAMP
    (both exponentials stay finite and nonzero: never inf * 0); the callers recompute exactly
    where that clamp could change a result (see pair_clamp_may_matter).
    """
    ea = tl.exp(_clamp_pair_operand(2.0 * a))
    eb = tl.exp(_clamp_pair_operand(2.0 * b))
    return rcp(ea[:, None, :] * eb[None, :, :] + 1.0, FAST_RCP)


@triton.jit
def product_too_coarse(max_abs_a, max_abs_b):
    """Whether the product path's absolute error is too coarse for pre-activations this small
    (every |a + b| below PRODUCT_MIN_SUM): the caller then takes the "exp" path."""
    return max_abs_a + max_abs_b < PRODUCT_MIN_SUM


@triton.jit
def pair_clamp_may_matter(max_abs_a, max_abs_b):
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
def _tanh_probe_kernel(
    x_ptr, y_ptr, n, TANH_MODE: tl.constexpr, FAST_RCP: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, tanh(x, TANH_MODE, FAST_RCP), mask=offs < n)


# --- host side -------------------------------------------------------------------------------------


def is_interpreted() -> bool:
    """True when the kernels were defined under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    return type(_tanh_probe_kernel).__name__ == "InterpretedFunction"


def fast_rcp() -> bool:
    """rcp.approx through inline PTX, which the interpreter cannot run."""
    return not is_interpreted()


def _check_mode(mode: str, what: str) -> str:
    if mode not in TANH_MODES:
        raise ValueError(f"{what} must be one of {', '.join(TANH_MODES)}, got {mode!r}")
    return mode


@contextlib.contextmanager
def tanh_override(mode: str) -> Iterator[None]:
    """Within the block, launchers called with ``tanh="auto"`` take path ``mode`` instead.

    For callers that reach the kernels through ``torch.ops.seq2seq_fast.*`` (which have no tanh
    argument): benchmarks and tests. Thread- and task-local (a context variable); nests.
    """
    token = _OVERRIDE.set(_check_mode(mode, "tanh_override(mode)"))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def resolve_tanh(mode: str, dtype: torch.dtype, device: torch.device | str) -> str:
    """The path the kernels take: "approx", "packed", "product" or "exp" (see the module doc).

    ``mode``: "auto" (the :func:`tanh_override` in force, else the dtype's default) or a path.
    The PTX paths need compiled kernels: under the interpreter they run as "product".
    """
    _check_mode(mode, "tanh")
    if mode == "auto":
        mode = _OVERRIDE.get() or "auto"
    if mode == "auto":
        on_gpu = torch.device(device).type == "cuda" and not is_interpreted()
        mode = auto_tanh(dtype, on_gpu)
    if mode in ("approx", "packed") and is_interpreted():
        mode = "product"
    return mode


def auto_tanh(dtype: torch.dtype, on_gpu: bool = True) -> str:
    """The default path: "approx" for float16 / bfloat16 on a GPU, else "product"."""
    return "approx" if on_gpu and dtype in (torch.float16, torch.bfloat16) else "product"


def tanh_probe(x: torch.Tensor, mode: str) -> torch.Tensor:
    """The kernels' tanh path ``mode`` (approx / packed / product / exp) on a float32 tensor."""
    if x.dtype != torch.float32:
        raise TypeError(f"tanh_probe: x must be float32, got {x.dtype}")
    code = TANH_CODES[resolve_tanh(mode, x.dtype, x.device)]
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        with contextlib.ExitStack() as stack:
            if x.device.type == "cuda":
                stack.enter_context(torch.cuda.device(x.device))
            _tanh_probe_kernel[(triton.cdiv(x.numel(), 1024),)](
                x, y, x.numel(), TANH_MODE=code, FAST_RCP=fast_rcp(), BLOCK=1024,
                enable_fp_fusion=True,
            )  # fmt: skip
    return y
