"""Compile the Triton kernels for a GPU target on a machine without one; report their resources.

    python bench/triton_aot_report.py [--arch 90] [--quick] [--sass-dir DIR]

For each kernel at the tile choices of the benchmark shapes (bf16 with tanh.approx, fp32 with the
exp tanh) this prints registers, spilled bytes (stack / local), shared memory, and the instruction
mix of the innermost tanh loop from the SASS (MUFU = special-function unit ops: one per tanh on
the approx path, two on the exp path). It needs only Triton's wheel (ptxas and cuobjdump ship with
it), no GPU and no driver, so it shows on any machine whether a kernel change compiles for sm_90
and what it costs in registers: the CPU interpreter checks the arithmetic, not the compilation.
TRITON_INTERPRET must be unset (the kernels must be JIT functions, not interpreted ones).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("unset TRITON_INTERPRET: the report compiles the kernels, it does not interpret them")

import torch  # noqa: E402
import triton  # noqa: E402
from seq2seq_fast._triton import additive_attention as tk  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

FP32_POINTERS = {"s_ptr", "lse_ptr", "p_ptr", "ds_ptr", "gq_ptr", "gv_ptr"}
SHAPES = {"gnmt-train": (128, 50, 50, 1024), "decode-step": (1280, 1, 66, 1024)}
SHAPES_FULL = {**SHAPES, "long-both": (32, 74, 75, 1024), "long-source": (128, 10, 128, 1024)}
BIN_DIR = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def signature(kernel, dtype: str, constexprs: dict) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name in FP32_POINTERS:
                sig[name] = "*fp32"
            elif name == "len_ptr":
                sig[name] = "*i64"
            elif name == "mask_ptr":
                sig[name] = "*u8"
            else:
                sig[name] = "*" + dtype
        else:
            sig[name] = "i32"
    return sig


def compile_kernel(kernel, dtype: str, constexprs: dict, num_warps: int, arch: int):
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    source = triton.compiler.ASTSource(
        fn=kernel, signature=signature(kernel, dtype, constexprs), constexprs=constexprs
    )
    options = backend.parse_options({"num_warps": num_warps, "enable_fp_fusion": True})
    return triton.compile(source, target=target, options=options.__dict__)


def resource_usage(cubin_path: str) -> dict:
    out = subprocess.run(
        [os.path.join(BIN_DIR, "cuobjdump"), "--dump-resource-usage", cubin_path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {key.lower(): int(value) for key, value in found.items()}


def innermost_tanh_loop_mix(sass: str) -> collections.Counter:
    """Opcode counts of the backward-branch loop densest in MUFU instructions (the tanh loop)."""
    lines = sass.splitlines()
    addresses = {}
    for index, line in enumerate(lines):
        match = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if match:
            addresses[int(match.group(1), 16)] = (index, match.group(2))
    best = None
    for address, (_, text) in addresses.items():
        branch = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
        if not branch:
            continue
        start = int(branch.group(1), 16)
        if start >= address:
            continue
        body = [addresses[a][1] for a in sorted(addresses) if start <= a <= address]
        mufu = sum("MUFU" in op for op in body)
        # The densest loop in MUFU ops: the innermost tanh loop, not a loop around it.
        if mufu >= 4 and (best is None or mufu / len(body) > best[0]):
            best = (mufu / len(body), body)
    mix = collections.Counter()
    for op in best[1] if best else []:
        opcode = op.split()[0]
        if opcode.startswith("@"):
            opcode = op.split()[1]
        mix[opcode.split(".")[0]] += 1
    return mix


def kernel_cases(shape: tuple[int, int, int, int], dtype: str):
    batch, num_queries, num_keys, hidden = shape
    tanh = tk._TANH_CODES["approx" if dtype != "fp32" else "product"]
    lowp = dtype != "fp32"
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    fwd = tk.forward_config(num_queries, num_keys, hidden, hidden, dtype=torch_dtype)
    ds_cfg, grad_cfg, dv_cfg = tk.backward_configs(
        batch, num_queries, num_keys, hidden, hidden, dtype=torch_dtype
    )
    common = {"HAS_LENGTHS": True, "INT64": False}
    yield "fwd", tk._fwd_kernel, fwd, {
        **common, "HAS_MASK": False, "RETURN_WEIGHTS": True, "TANH_MODE": tanh, "FAST_RCP": True,
        "USE_DOT": fwd.use_dot, "LOWP_DOT": lowp, "BLOCK_Q": fwd.block_q,
        "BLOCK_K": fwd.block_k, "BLOCK_H": fwd.block_h, "BLOCK_DV": fwd.block_dv,
        "ROWS2": fwd.rows2, "BLOCK_K2": fwd.block_k2,
    }  # fmt: skip
    yield "bwd_ds", tk._bwd_ds_kernel, ds_cfg, {
        **common, "HAS_MASK": False, "HAS_GRAD_WEIGHTS": True, "TANH_MODE": tanh, "FAST_RCP": True,
        "USE_DOT": ds_cfg.use_dot, "LOWP_DOT": lowp, "BLOCK_Q": ds_cfg.block_q,
        "BLOCK_K": ds_cfg.block_k, "BLOCK_H": ds_cfg.block_h, "BLOCK_DV": ds_cfg.block_dv,
        "ROWS2": ds_cfg.rows2, "BLOCK_K2": ds_cfg.block_k2,
    }  # fmt: skip
    yield "bwd_grad", tk._bwd_grad_kernel, grad_cfg, {
        **common, "TANH_MODE": tanh, "FAST_RCP": True, "BLOCK_Q": grad_cfg.block_q,
        "BLOCK_K": grad_cfg.block_k, "BLOCK_H": grad_cfg.block_h,
    }  # fmt: skip
    yield "bwd_dvalues", tk._bwd_dvalues_kernel, dv_cfg, {
        "INT64": False, "LOWP_DOT": lowp,
        "USE_DOT": min(dv_cfg.block_q, dv_cfg.block_k, dv_cfg.block_dv) >= 16,
        "BLOCK_Q": dv_cfg.block_q, "BLOCK_K": dv_cfg.block_k, "BLOCK_DV": dv_cfg.block_dv,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, 90 = Hopper")
    parser.add_argument(
        "--quick", action="store_true", help="one shape; the forward and grad kernels only"
    )
    parser.add_argument("--full", action="store_true", help="all four benchmark shapes")
    parser.add_argument("--int64", action="store_true", help="also the int64-offset variants")
    parser.add_argument("--sass-dir", help="write each kernel's SASS here")
    args = parser.parse_args(argv)
    shapes = SHAPES_FULL if args.full else SHAPES
    if args.quick:
        shapes = {"gnmt-train": SHAPES["gnmt-train"]}
    if args.sass_dir:
        os.makedirs(args.sass_dir, exist_ok=True)
    work_dir = args.sass_dir or os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"triton_aot_{os.getpid()}"
    )
    os.makedirs(work_dir, exist_ok=True)
    header = (
        f"{'shape':12s} {'dtype':5s} {'kernel':12s} {'blocks (q,k,h,dv) warps':28s} {'regs':>4s}"
        f" {'spill':>5s} {'smem':>6s} {'s':>5s}  inner tanh loop: instructions (MUFU, FP32, other)"
    )
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    print(header)
    failures = 0
    for shape_name, shape in shapes.items():
        for dtype in ("bf16", "fp32"):
            for kernel_name, kernel, cfg, constexprs in kernel_cases(shape, dtype):
                if args.quick and kernel_name not in ("fwd", "bwd_grad"):
                    continue
                variants = [False, True] if args.int64 else [False]
                for int64 in variants:
                    constexprs = {**constexprs, "INT64": int64}
                    label = kernel_name + ("/i64" if int64 else "")
                    start = time.monotonic()
                    try:
                        compiled = compile_kernel(
                            kernel, dtype, constexprs, cfg.num_warps, args.arch
                        )
                    except Exception as exc:
                        failures += 1
                        print(
                            f"{shape_name:12s} {dtype:5s} {label:12s} COMPILE FAILED: {exc!r:.300}"
                        )
                        continue
                    seconds = time.monotonic() - start
                    stem = os.path.join(work_dir, f"{shape_name}_{dtype}_{label.replace('/', '_')}")
                    with open(stem + ".cubin", "wb") as handle:
                        handle.write(compiled.asm["cubin"])
                    usage = resource_usage(stem + ".cubin")
                    sass = subprocess.run(
                        [os.path.join(BIN_DIR, "cuobjdump"), "--dump-sass", stem + ".cubin"],
                        capture_output=True,
                        text=True,
                        check=True,
                    ).stdout
                    if args.sass_dir:
                        with open(stem + ".sass", "w") as handle:
                            handle.write(sass)
                    mix = innermost_tanh_loop_mix(sass)
                    fp32 = sum(mix[op] for op in ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL"))
                    total = sum(mix.values())
                    blocks = f"({cfg.block_q},{cfg.block_k},{cfg.block_h},{cfg.block_dv}) w{cfg.num_warps}"
                    spill = usage.get("stack", 0) + usage.get("local", 0)
                    print(
                        f"{shape_name:12s} {dtype:5s} {label:12s} {blocks:28s} {usage.get('reg', 0):4d}"
                        f" {spill:5d} {usage.get('shared', 0):6d} {seconds:5.1f}  {total} "
                        f"({mix['MUFU']}, {fp32}, {total - mix['MUFU'] - fp32})"
                    )
                    if spill:
                        print("   ^ spills registers to local memory")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
