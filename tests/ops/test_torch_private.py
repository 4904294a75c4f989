"""The private torch APIs the package uses (seq2seq_fast/ops/_torch_private.py): each still there
in the installed torch, and none used anywhere else in the package."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

from seq2seq_fast.ops import _torch_private
from seq2seq_fast.ops._torch_private import PRIVATE_APIS

PACKAGE = Path(__file__).resolve().parents[2] / "seq2seq_fast"
OURS = "ops.seq2seq_fast."  # torch.ops.seq2seq_fast._x: this package's own ops


def _resolve(dotted: str) -> object:
    """The object at ``dotted`` (a module path, then attributes), or AttributeError/ImportError."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize(("name", "used_by"), PRIVATE_APIS, ids=[n for n, _ in PRIVATE_APIS])
def test_each_private_api_is_still_in_this_torch(name, used_by):
    try:
        _resolve(name)
    except (AttributeError, ImportError) as exc:
        pytest.fail(
            f"torch {torch.__version__} no longer has {name} ({type(exc).__name__}: {exc}); "
            f"{used_by} needs it: replace it in seq2seq_fast/ops/_torch_private.py"
        )


def test_the_wrappers_answer():
    assert _torch_private.functorch_transforms_active() is False
    assert _torch_private.current_graph_task_id() == -1  # outside a backward pass
    assert _torch_private.saved_tensors_hooks_active() is False
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert _torch_private.saved_tensors_hooks_active() is True
    assert _torch_private.nn_linear() is torch._C._nn.linear
    assert _torch_private.mkldnn_bf16_supported() in (True, False, None)
    config = _torch_private.dynamo_config()
    before = config.recompile_limit
    with _torch_private.dynamo_tracing(recompile_limit=before + 5, allow_rnn=True):
        assert config.recompile_limit == before + 5 and config.allow_rnn is True
        with _torch_private.dynamo_tracing(recompile_limit=1):  # never lowered
            assert config.recompile_limit == before + 5 and config.allow_rnn is True
    assert config.recompile_limit == before and config.allow_rnn is False


def _private_uses(path: Path) -> list[str]:
    """``torch._x`` / ``torch.a._b`` attribute chains and ``from torch... import _x`` /
    ``from torch._x import`` in one file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            names = [node.module, *(a.name for a in node.names)]
            if any(part.startswith("_") for n in names for part in n.split(".")):
                found.append((f"{path.name}:{node.lineno}", f"from {node.module} import ..."))
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            dotted = ".".join(reversed(chain))
            if isinstance(inner, ast.Name) and inner.id == "torch" and not dotted.startswith(OURS):
                found.append((f"{path.name}:{node.lineno}:{inner.col_offset}", f"torch.{dotted}"))
    # torch._C._nn is one use, not two: the longest chain of each
    uses: dict[str, str] = {}
    for where, dotted in found:
        if len(dotted) > len(uses.get(where, "")):
            uses[where] = dotted
    return [f"{where} {dotted}" for where, dotted in uses.items()]


def test_no_private_torch_api_outside_the_one_module():
    files = [p for p in PACKAGE.rglob("*.py") if p.name != "_torch_private.py"]
    offences = [line for path in sorted(files) for line in _private_uses(path)]
    assert not offences, offences


def test_the_finder_sees_what_it_must(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import torch\nfrom torch.utils import _pytree\nfrom torch._dynamo import config\n"
        "x = torch._C._nn.linear\ny = torch.nn.functional.linear\nz = torch.__version__\n"
    )
    assert len(_private_uses(probe)) == 3


def test_scalar_capture_is_on_inside_for_this_thread_and_restored_after():
    import threading

    config = _torch_private.dynamo_config()
    assert not config.capture_scalar_outputs
    seen = []
    with _torch_private.dynamo_capture_scalars():
        assert config.capture_scalar_outputs
        with _torch_private.dynamo_capture_scalars():  # nested
            pass
        assert config.capture_scalar_outputs
        thread = threading.Thread(target=lambda: seen.append(config.capture_scalar_outputs))
        thread.start()
        thread.join()
    assert seen == [False], "torch's config is no longer per thread: see dynamo_capture_scalars"
    assert not config.capture_scalar_outputs
    config.capture_scalar_outputs = True  # the user's own setting is left as it is
    try:
        with _torch_private.dynamo_capture_scalars():
            pass
        assert config.capture_scalar_outputs
    finally:
        config.capture_scalar_outputs = False
