"""Look-alikes of additive attention (tests/convert/layouts_lookalikes.py) are left alone, in
float64 and float32, and their outputs stay the original's (the same checks as every traced case:
tests/convert/test_convert_traced.py::test_converted_or_left_alone)."""

from __future__ import annotations

import pytest
import torch

from tests.convert.layouts_lookalikes import LOOKALIKES
from tests.convert.test_convert_traced import test_converted_or_left_alone as _check


@pytest.mark.parametrize("case", LOOKALIKES, ids=[case.name for case in LOOKALIKES])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_lookalike_left_alone(case, dtype):
    assert case.converts is None
    _check(case, dtype)
