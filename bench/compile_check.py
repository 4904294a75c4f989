"""Compile what the GPU will compile, on a machine without one, and check the machine code.

    python -m bench.compile_check [--full] [--arch 90] [--json PATH] [--sass-dir DIR]

The launchers (seq2seq_fast._triton.additive_attention) are called with the benchmark shapes and
dtypes on meta tensors through a stand-in Triton driver that compiles for sm_90 and never
launches: so the kernels are specialised exactly as on the GPU (argument types, divisibility,
constexprs, tiles from the cost model, the tanh path that "auto" takes on CUDA). ptxas and
cuobjdump ship with Triton's wheel. Each kernel is then checked:

    compiles                  no compiler error
    registers <= 255          and no local-memory (spill) loads / stores inside the tanh loop
                              (spill bytes elsewhere are reported, not failed)
    forward >= 3 blocks / SM  from registers (allocated per warp in steps of 8 per thread) and
                              shared memory (228 KB per SM, 1 KB reserved per block)
    instructions              MUFU.TANH on the approx path (MUFU.TANH.BF16 on the packed one:
                              sm_90 runs tanh.approx.bf16x2 as two MUFU ops, one per half),
                              MUFU.EX2 + MUFU.RCP and no MUFU.TANH on the product path,
                              tensor-core MMA (HMMA / HGMMA) in the bf16 value products

It needs TRITON_INTERPRET unset (the kernels must be JIT functions). The default set is what CI
runs (tests/reliability/test_compile_check.py, ~1-2 minutes on 2 cores); ``--full`` compiles every kernel at
every benchmark shape. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.shapes import FULL_SHAPES, Shape  # noqa: E402

REGISTERS_PER_SM, SHARED_PER_SM, RESERVED_SHARED = 65536, 228 * 1024, 1024
MIN_FORWARD_BLOCKS = 3
QUICK = (
    ("gnmt-train", "bf16", "auto"),
    ("gnmt-train", "fp32", "auto"),
    ("decode-step", "bf16", "auto"),
    ("decode-step", "fp32", "auto"),
    ("gnmt-train", "bf16", "packed"),
)
QUICK_KERNELS = {"_fwd_kernel", "_bwd_grad_kernel"}


# --- the stand-in driver ---------------------------------------------------------------------------


def install_stand_in_driver(arch: int):
    """Make Triton compile for ``sm_<arch>`` and record each binary instead of launching it."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class NoLaunch:
        def __init__(self, src, metadata) -> None:
            self.metadata = metadata

        def __call__(self, *args, **kwargs) -> None:
            pass

    class Utils:
        def __init__(self, owner) -> None:
            self.owner = owner

        def load_binary(self, name, kernel, shared, device):
            self.owner.binaries.append({"name": name, "cubin": kernel, "shared": shared})
            return 0, 0, 0, 0, 1024

        def get_device_properties(self, device) -> dict:
            return {
                "max_shared_mem": SHARED_PER_SM - RESERVED_SHARED,
                "multiprocessor_count": 132,
                "max_num_regs": REGISTERS_PER_SM,
                "warpSize": 32,
            }

    class StandInDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return True

        def __init__(self) -> None:
            self.target = GPUTarget("cuda", arch, 32)
            self.utils = Utils(self)
            self.launcher_cls = NoLaunch
            self.binaries: list[dict] = []

        def get_current_target(self):
            return self.target

        def get_current_device(self) -> int:
            return 0

        def set_current_device(self, device) -> None:
            pass

        def get_current_stream(self, device=None) -> int:
            return 0

        def get_active_torch_device(self):
            return torch.device("meta")

        def get_device_interface(self):
            return torch.cuda

        def get_benchmarker(self):
            raise RuntimeError("the stand-in driver launches nothing")

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

    driver = StandInDriver()
    triton.runtime.driver.set_active(driver)
    return driver


# --- the machine code ------------------------------------------------------------------------------


def _tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else name


def sass_and_usage(cubin: bytes, stem: str) -> tuple[str, dict]:
    with open(stem + ".cubin", "wb") as handle:
        handle.write(cubin)
    usage = subprocess.run(
        [_tool("cuobjdump"), "--dump-resource-usage", stem + ".cubin"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    sass = subprocess.run(
        [_tool("cuobjdump"), "--dump-sass", stem + ".cubin"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sass, {key.lower(): int(value) for key, value in found.items()}


def tanh_loop(sass: str) -> list[str]:
    """The instructions of the backward-branch loop densest in MUFU ops (the innermost tanh loop)."""
    addresses = {}
    for line in sass.splitlines():
        match = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if match:
            addresses[int(match.group(1), 16)] = match.group(2)
    best = None
    for address, text in addresses.items():
        branch = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
        if not branch or int(branch.group(1), 16) >= address:
            continue
        start = int(branch.group(1), 16)
        body = [addresses[a] for a in sorted(addresses) if start <= a <= address]
        mufu = sum("MUFU" in op for op in body)
        if mufu >= 4 and (best is None or mufu / len(body) > best[0]):
            best = (mufu / len(body), body)
    return best[1] if best else []


def _opcode(instruction: str) -> str:
    parts = instruction.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def blocks_per_sm(registers: int, warps: int, shared: int) -> int:
    per_thread = max(8, math.ceil(registers / 8) * 8)
    by_registers = REGISTERS_PER_SM // (per_thread * 32 * warps)
    by_shared = SHARED_PER_SM // (shared + RESERVED_SHARED)
    return min(by_registers, by_shared, 32)


def analyse(binary: dict, warps: int, stem: str) -> dict:
    sass, usage = sass_and_usage(binary["cubin"], stem)
    loop = tanh_loop(sass)
    opcodes = collections.Counter(_opcode(op) for op in loop)
    every = [
        _opcode(line.split("*/", 1)[1].strip())
        for line in sass.splitlines()
        if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)
    ]
    registers = usage.get("reg", 0)
    return {
        "registers": registers,
        "spill_bytes": usage.get("stack", 0) + usage.get("local", 0),
        "shared": binary["shared"],
        "warps": warps,
        "blocks_per_sm": blocks_per_sm(registers, warps, binary["shared"]),
        "loop_instructions": len(loop),
        "loop_mufu": sum(op.startswith("MUFU") for op in opcodes.elements()),
        "loop_local_memory": sum(op.startswith(("LDL", "STL")) for op in opcodes.elements()),
        "mufu_kinds": sorted({op for op in every if op.startswith("MUFU")}),
        "mma": sorted({op.split(".")[0] for op in every if op.startswith(("HMMA", "HGMMA"))}),
    }


# --- the cases -------------------------------------------------------------------------------------


def compile_case(
    driver, shape: Shape, dtype_name: str, tanh: str, kernels: set[str] | None, work_dir: str
) -> list[dict]:
    """Forward and backward launchers at ``shape`` on meta tensors; one entry per kernel."""
    import torch

    from seq2seq_fast._triton import additive_attention as tk
    from seq2seq_fast._triton.tanh import auto_tanh

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    mode = auto_tanh(dtype) if tanh == "auto" else tanh

    def empty(*size, dt=dtype):
        return torch.empty(*size, dtype=dt, device="meta")

    b, tq, tk_, h, dv = shape.batch, shape.q_len, shape.k_len, shape.hidden, shape.value_dim
    inputs = (empty(b, tq, h), empty(b, tk_, h), empty(b, tk_, dv), empty(h), empty(h))
    lengths = empty(b, dt=torch.int64)
    first = len(driver.binaries)
    start = time.monotonic()
    if kernels is None or "_fwd_kernel" in kernels:
        tk.additive_attention_fwd(*inputs, lengths, None, True, tanh=mode)
    if kernels is None:
        tk.additive_attention_bwd(
            empty(b, tq, dv),
            None,
            *inputs,
            lengths,
            None,
            empty(b, tq, dv),
            empty(b, tq, dt=torch.float32),
            tanh=mode,
        )
    elif "_bwd_grad_kernel" in kernels:  # the grad kernel alone, as the backward launches it
        _, grad_cfg, _ = tk.backward_configs(b, tq, tk_, h, dv, dtype=dtype, mode=mode)
        consts = tk._common_constexprs(dtype, torch.device("cuda"), mode, False)
        scratch = empty(b, tq, tk_, dt=torch.float32)
        tk._launch_bwd_grad(
            inputs[0],
            inputs[1],
            inputs[3],
            inputs[4],
            lengths,
            scratch,
            empty(b, tq, h, dt=torch.float32),
            empty(b, tk_, h),
            empty(b, h, dt=torch.float32),
            grad_cfg,
            consts,
        )
    seconds = time.monotonic() - start
    warps = {"_fwd_kernel": 4, "_bwd_ds_kernel": 4, "_bwd_grad_kernel": 4, "_bwd_dvalues_kernel": 4}
    entries = []
    for binary in driver.binaries[first:]:
        name = binary["name"]
        if kernels and name not in kernels:
            continue
        stem = os.path.join(work_dir, f"{shape.name.replace('/', '_')}_{dtype_name}_{mode}_{name}")
        entry = {
            "shape": shape.name,
            "dtype": dtype_name,
            "tanh": mode,
            "kernel": name,
            "tiles": tiles_of(name, shape, dtype, mode),
            **analyse(binary, warps.get(name, 4), stem),
        }
        entry["problems"] = problems(entry)
        entries.append(entry)
    if entries:
        entries[0]["compile_s"] = round(seconds, 1)
    return entries


def tiles_of(kernel: str, shape: Shape, dtype, mode: str) -> str:
    from seq2seq_fast._triton import tiles

    dims = (shape.batch, shape.q_len, shape.k_len, shape.hidden, shape.value_dim)
    ds_cfg, grad_cfg, dv_cfg = tiles.backward_configs(*dims, dtype=dtype, mode=mode)
    cfg = {"_bwd_grad_kernel": grad_cfg, "_bwd_dvalues_kernel": dv_cfg}.get(kernel, ds_cfg)
    text = f"{cfg.block_q}x{cfg.block_k}x{cfg.block_h}"
    if kernel in ("_fwd_kernel", "_bwd_ds_kernel"):
        text += f"/{cfg.rows2}x{cfg.block_k2}x{cfg.block_dv}"
    return text


def problems(entry: dict) -> list[str]:
    """What the GPU would get wrong or slow, per the module doc's checks."""
    found = []
    kernel, mufu = entry["kernel"], entry["mufu_kinds"]
    if entry["registers"] > 255:
        found.append(f"{entry['registers']} registers")
    if entry["loop_local_memory"]:
        found.append(f"{entry['loop_local_memory']} local-memory accesses in the tanh loop")
    if kernel == "_fwd_kernel" and entry["blocks_per_sm"] < MIN_FORWARD_BLOCKS:
        found.append(f"forward at {entry['blocks_per_sm']} blocks/SM (< {MIN_FORWARD_BLOCKS})")
    scores = kernel in ("_fwd_kernel", "_bwd_ds_kernel", "_bwd_grad_kernel")
    if scores and entry["tanh"] in ("approx", "packed") and not any("TANH" in m for m in mufu):
        found.append(f"no MUFU.TANH on the {entry['tanh']} path ({mufu})")
    if scores and entry["tanh"] == "packed" and not any("BF16" in m for m in mufu):
        found.append(f"no packed bf16 MUFU.TANH ({mufu})")
    if (
        scores
        and entry["tanh"] == "product"
        and (not {"MUFU.EX2", "MUFU.RCP"} <= set(mufu) or any("TANH" in m for m in mufu))
    ):
        found.append(f"product path without MUFU.EX2 + MUFU.RCP, or with MUFU.TANH ({mufu})")
    wants_mma = entry["dtype"] != "fp32" and kernel in (
        "_fwd_kernel",
        "_bwd_ds_kernel",
        "_bwd_dvalues_kernel",
    )
    if wants_mma and entry["shape"] != "decode-step" and not entry["mma"]:
        found.append("no tensor-core MMA in the value products")
    return found


def row_text(entry: dict) -> str:
    return (
        f"{entry['shape']:12s} {entry['dtype']:5s} {entry['tanh']:8s} {entry['kernel']:20s}"
        f" {entry['tiles']:18s}"
        f" {entry['registers']:4d} {entry['spill_bytes']:5d} {entry['shared']:6d}"
        f" {entry['blocks_per_sm']:3d} {entry['loop_instructions']:5d} {entry['loop_mufu']:4d}"
        f" {','.join(m.replace('MUFU.', '') for m in entry['mufu_kinds']):24s}"
        f" {','.join(entry['mma']) or '-':6s} {'; '.join(entry['problems']) or 'ok'}"
    )


HEADER = (
    f"{'shape':12s} {'dtype':5s} {'tanh':8s} {'kernel':20s} {'tiles (tanh/values)':18s}"
    f" {'regs':>4s} {'spill':>5s}"
    f" {'smem':>6s} {'b/SM':>3s} {'loop':>5s} {'mufu':>4s} {'MUFU kinds':24s} {'mma':6s}"
    " problems"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--full", action="store_true", help="every kernel at every shape")
    parser.add_argument("--json", help="write the entries here")
    parser.add_argument("--sass-dir", help="keep each kernel's cubin here")
    parser.add_argument(
        "--cases",
        help="comma-separated indices into the case list (to split the work over processes)",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: this compiles the kernels, it does not interpret them")
    import triton

    driver = install_stand_in_driver(args.arch)
    shapes = {shape.name: shape for shape in FULL_SHAPES}
    if args.full:
        cases = [(n, d, t) for n in shapes for d in ("bf16", "fp32") for t in ("auto",)]
        cases += [(n, "bf16", "packed") for n in shapes]
    else:
        cases = list(QUICK)
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    work_dir = args.sass_dir or tempfile.mkdtemp(prefix="compile_check_")
    os.makedirs(work_dir, exist_ok=True)
    print(f"triton {triton.__version__}, sm_{args.arch}, stand-in driver (compile, no launch)")
    print(HEADER)
    entries, failures = [], 0
    for name, dtype_name, tanh in cases:
        try:
            found = compile_case(
                driver,
                shapes[name],
                dtype_name,
                tanh,
                None if args.full else QUICK_KERNELS,
                work_dir,
            )
        except Exception as exc:  # noqa: BLE001 - a compile error is a result, and the rest runs
            failures += 1
            print(f"{name:12s} {dtype_name:5s} {tanh:8s} COMPILE FAILED: {exc!r:.400}")
            continue
        for entry in found:
            failures += bool(entry["problems"])
            print(row_text(entry), flush=True)
        entries += found
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"triton": triton.__version__, "arch": args.arch, "entries": entries},
                handle,
                indent=1,
            )
    print(f"{len(entries)} kernels, {failures} with problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
