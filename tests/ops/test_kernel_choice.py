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
        if name in _AVAILABILITY_NAMES or name == "is_cuda":
            found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')} {name}")
    return found


def test_no_kernel_choice_above_ops():
    """nn/ and the models choose no kernel by device or availability: they ask ops."""
    files = sorted((PACKAGE / "nn").rglob("*.py")) + [PACKAGE / "seq2seq" / "models.py"]
    offences = [line for path in files for line in _choice_offences(path)]
    assert not offences, offences


def test_the_offence_finder_sees_what_it_must(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from seq2seq_fast.ops._library import CPU_KERNEL_ERROR\n"
        "def f(x):\n    return x.is_cuda or _library._CPU_DTYPES\n"
    )
    assert len(_choice_offences(probe, root=tmp_path)) == 3
