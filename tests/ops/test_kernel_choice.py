"""Kernel choice is made in one place, ``ops._library.kernel_unavailable_reason``: its cases, one
by one, and a check that the layers above ``ops`` do not test the kernels' availability
themselves."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from seq2seq_fast.ops import _library
from seq2seq_fast.ops._library import kernel_serves, kernel_unavailable_reason
from seq2seq_fast.ops.recurrent import prefer_packed

requires_cpp = pytest.mark.skipif(
    _library.CPU_KERNEL_ERROR is not None, reason="the C++ extension is not built"
)
PACKAGE = Path(__file__).resolve().parents[2] / "seq2seq_fast"
CPU_KERNELS = ("attention_step", "location", "location_conv", "recurrent")


def _t(dtype=torch.float32, device="cpu"):
    return torch.zeros(2, 3, dtype=dtype, device=device)


@requires_cpp
@pytest.mark.parametrize(
    ("kernel", "dtype", "served"),
    [
        ("attention", torch.float32, True),
        ("attention", torch.float64, True),
        ("attention", torch.bfloat16, True),
        ("attention", torch.float16, False),
        ("attention_step", torch.float32, True),
        ("attention_step", torch.bfloat16, True),
        ("attention_step", torch.float16, False),
        ("location", torch.float64, True),
        ("location", torch.bfloat16, True),
        ("location", torch.float16, False),
        ("location_conv", torch.float64, True),
        ("location_conv", torch.bfloat16, False),
        ("recurrent", torch.bfloat16, True),
        ("recurrent", torch.float16, False),
    ],
)
def test_cpu_dtypes(kernel, dtype, served):
    reason = kernel_unavailable_reason(kernel, _t(dtype), _t(dtype))
    assert (reason is None) == served, reason
    if not served:
        assert str(dtype) in reason


@pytest.mark.parametrize("kernel", ("attention", *CPU_KERNELS))
def test_meta_device_is_not_served(kernel):
    reason = kernel_unavailable_reason(kernel, _t(device="meta"))
    assert reason is not None and "meta" in reason


@requires_cpp
def test_a_tensor_on_another_device_or_dtype_among_several_refuses():
    assert kernel_serves("location", _t(), _t())
    assert not kernel_serves("location", _t(), _t(device="meta"))
    assert not kernel_serves("location", _t(), _t(torch.float16))


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_without_the_extension_no_cpu_kernel_serves(kernel, monkeypatch):
    monkeypatch.setattr(_library, "CPU_KERNEL_ERROR", "ImportError: not built (test)")
    reason = kernel_unavailable_reason(kernel, _t())
    assert reason is not None and "seq2seq_fast._C" in reason
    assert not kernel_serves("attention", _t())  # the op itself neither


@requires_cpp
@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_tracing_keeps_the_stateful_kernels_out_and_the_op_in(kernel, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not kernel_serves(kernel, _t())
    assert kernel_serves("attention", _t())  # the op has fake kernels: it traces


@requires_cpp
@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_torch_func_transforms_keep_the_stateful_kernels_out(kernel):
    seen = {}

    def f(x):
        seen["served"] = kernel_serves(kernel, x)
        return x.sum()

    torch.func.grad(f)(torch.zeros(3))
    assert seen["served"] is False
    assert kernel_serves(kernel, torch.zeros(3))


@requires_cpp
def test_autocast_rules():
    f32, bf16 = _t(), _t(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # the gathering kernels: only tensors already in the autocast dtype (the op casts others)
        assert kernel_serves("attention_step", bf16, bf16)
        assert not kernel_serves("attention_step", f32, bf16)
        assert kernel_serves("location", bf16, bf16)  # as the gathering kernels
        assert not kernel_serves("location", f32, bf16)
        assert not kernel_serves("location_conv", bf16)  # float32/64 only: never under autocast
        assert kernel_serves("recurrent", f32)  # the recurrent ops cast to bfloat16 themselves
        assert kernel_serves("attention", f32)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not kernel_serves("recurrent", f32)
        assert not kernel_serves("attention_step", _t(torch.float16))


def test_unknown_kernel_is_an_error():
    with pytest.raises(ValueError, match="kernel must be one of"):
        kernel_unavailable_reason("flash", _t())


def test_packed_or_padded_rnn(monkeypatch):
    x = torch.zeros(2, 3, 4)
    assert not prefer_packed(x)  # CPU training: padded, layer by layer (the fused GRU)
    with torch.no_grad():
        assert prefer_packed(x)  # decoding: packing skips the padding
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not prefer_packed(x)  # traced without a graph break


# Names that test the kernels' availability themselves; above ops, only ops may use them.
_AVAILABILITY_NAMES = {"CPU_KERNEL_ERROR", "CUDA_KERNEL_ERROR", "_CPU_DTYPES", "_CUDA_DTYPES"}
# Autocast state: above ops, ask ops (ops._checks.autocast_dtype) instead.
_AUTOCAST_CALLS = {"is_autocast_enabled", "get_autocast_dtype", "autocast"}
# Low-precision dtypes whose tests choose a kernel path or an accumulator (ops decides those);
# float32/float64 tests elsewhere choose tolerances or keep a mask's type, not a kernel.
_PRECISION_DTYPES = {"bfloat16", "float16", "half"}


def _is_device_type(node: ast.AST) -> bool:
    """``<x>.device.type``."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "type"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "device"
    )


def _is_dtype_test(node: ast.AST) -> bool:
    """``<x>.dtype == torch.bfloat16`` (or !=, either side, float16/half too)."""
    if not isinstance(node, ast.Compare) or not all(
        isinstance(op, ast.Eq | ast.NotEq) for op in node.ops
    ):
        return False
    sides = [node.left, *node.comparators]
    dtype_side = any(
        (isinstance(n, ast.Attribute) and n.attr == "dtype")
        or (isinstance(n, ast.Name) and n.id == "dtype")
        for n in sides
    )
    precision = any(isinstance(n, ast.Attribute) and n.attr in _PRECISION_DTYPES for n in sides)
    return dtype_side and precision


def _choice_offences(path: Path, root: Path = PACKAGE) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.alias):
            name = node.name
        if _is_device_type(node):
            name = "device.type"
        elif _is_dtype_test(node):
            name = "dtype test"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr if node.func.attr in _AUTOCAST_CALLS else None
            name = f"torch.{name}" if name else None
        elif name not in _AVAILABILITY_NAMES and name != "is_cuda":
            name = None
        if name is not None:
            found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')} {name}")
    return found


def test_no_kernel_choice_above_ops():
    """nn/ and the models choose no kernel by device, availability, precision or autocast:
    they ask ops."""
    files = sorted((PACKAGE / "nn").rglob("*.py")) + [PACKAGE / "seq2seq" / "models.py"]
    offences = [line for path in files for line in _choice_offences(path)]
    assert not offences, offences


def test_the_offence_finder_sees_what_it_must(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from seq2seq_fast.ops._library import CPU_KERNEL_ERROR\n"
        "def f(x):\n    return x.is_cuda or _library._CPU_DTYPES\n"
        "def g(x, dtype):\n"
        "    if x.device.type == 'cpu' and x.dtype == torch.bfloat16:\n"
        "        return torch.float32 if dtype == torch.bfloat16 else dtype\n"
        "    with torch.autocast('cpu'):\n"
        "        return torch.is_autocast_enabled('cpu') or torch.get_autocast_dtype('cpu')\n"
        "def fine(x, y):\n"
        "    return x.dtype == y.dtype or x.dtype == torch.float64 or x.device == y.device\n"
    )
    found = _choice_offences(probe, root=tmp_path)
    assert len(found) == 9, found
    assert not [line for line in found if ":10 " in line]  # the last function is fine


# --- force_reference and the one dispatch ----------------------------------------------------------


def test_force_reference_switches_kernels_off_for_a_block_and_back():
    from seq2seq_fast.ops import force_reference

    with force_reference(("recurrent",)) as served:
        reason = kernel_unavailable_reason("recurrent", _t())
        assert reason is not None and "force_reference" in reason
        assert _library.forced_reference("recurrent") and not _library.forced_reference("attention")
        with force_reference() as inner:  # nested: everything off, then back to the outer's
            assert all(_library.forced_reference(k) for k in _library.KERNELS)
            _library.note_served("op-a")
        assert not _library.forced_reference("attention")
        assert inner == {"op-a"} and served == {"op-a"}  # the outer sees the inner's too
    assert not any(_library.forced_reference(k) for k in _library.KERNELS)
    with pytest.raises(ValueError, match="kernels must be among"):
        with force_reference(("flash",)):
            pass


@requires_cpp
def test_force_reference_runs_the_reference_silently_whatever_the_backend(monkeypatch):
    import warnings

    from seq2seq_fast.ops import additive_attention as dispatch
    from seq2seq_fast.ops import force_reference

    q, k, val, v = torch.randn(2, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 3), torch.randn(4)
    ran = []
    real = dispatch._reference
    monkeypatch.setattr(dispatch, "_reference", lambda *a: ran.append(1) or real(*a))
    with force_reference(("attention",)), warnings.catch_warnings():
        warnings.simplefilter("error")
        forced, _ = dispatch.additive_attention(q, k, val, v, backend="fused")
    assert ran == [1]
    fused, _ = dispatch.additive_attention(q, k, val, v, backend="fused")
    assert ran == [1]  # outside the block: the fused kernel again
    torch.testing.assert_close(forced, fused)


@requires_cpp
def test_one_attention_call_checks_once_and_asks_once(monkeypatch):
    """A BahdanauAttention step through a StepwiseMemory (the decoder's training path): its
    inputs checked once, the kernel library asked once, by ops.additive_attention."""
    from seq2seq_fast.nn.attention import BahdanauAttention
    from seq2seq_fast.ops import additive_attention as dispatch
    from seq2seq_fast.ops.stepwise import StepwiseMemory

    module = BahdanauAttention(6, 5, 8)
    keys = torch.randn(2, 7, 5, requires_grad=True)
    projected = module.project_keys(keys)
    memory = StepwiseMemory.for_training(projected, keys, "auto")
    assert memory is not None
    counts = {"check": 0, "ask": 0}
    real_check, real_ask = dispatch.check_inputs, dispatch.kernel_unavailable_reason

    def check(*args, **kwargs):
        counts["check"] += 1
        return real_check(*args, **kwargs)

    def ask(*args):
        counts["ask"] += 1
        return real_ask(*args)

    monkeypatch.setattr(dispatch, "check_inputs", check)
    monkeypatch.setattr(dispatch, "kernel_unavailable_reason", ask)
    query = module.query_proj(torch.randn(2, 6))
    context, _ = module.attend_projected(query, memory.keys, memory.values, stepwise=memory)
    assert counts == {"check": 1, "ask": 1}
    step = context.grad_fn.next_functions[0][0]  # under the squeeze of the [B, 1, Dv] context
    assert type(step).__name__ == "StepAttentionBackward"  # the memory's step ran
    context.sum().backward()
    assert keys.grad is not None and module.v.grad is not None


def test_a_missing_extension_is_named_as_not_built():
    # Python's own words for a missing _C ("partially initialized module ... circular import")
    # send a user the wrong way: a module the import system cannot find is named as not built
    circular = ImportError("cannot import name '_C' from partially initialized module")
    said = _library._load_error(circular, "seq2seq_fast._no_such_extension")
    assert "not built" in said and "seq2seq_fast._no_such_extension" in said
    assert "pip install" in said and "circular" not in said
    # found, but failed to load (built against another torch): the import's own error
    said = _library._load_error(ImportError("undefined symbol: _ZN3c10"), "seq2seq_fast.ops")
    assert said == "ImportError: undefined symbol: _ZN3c10"
