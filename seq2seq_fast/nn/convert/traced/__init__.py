"""The general path of ``fuse_attention``: additive attention recognised by what it computes.

After the named layouts have taken what they recognise, every other module that has parameters
(built-in ``torch.nn`` layers aside) is watched until its first call. In order:

1. ``watching.py``: the first call runs as it is, under a TorchFunctionMode that notes every
   ``tanh`` of a sum and every softmax over one; the innermost module whose call holds both is
   chosen (a module with only the tanh is reported, not converted).
2. ``runtime.py``: once the outermost watched call has returned, the chosen module's ``forward``
   is traced by TorchDynamo and the pattern is replaced in its graph
   (``pattern.py`` finds it, after the graph passes of ``passes.py``, on the helpers of
   ``nodes.py``, and returns a typed ``Plan``, ``plan.py``; ``rewrite.py`` turns the plan into
   one ``TracedWeights`` call; ``key_terms.py`` computes the key side at run time); a float64 probe of outputs and every gradient on the first
   call's input decides; then the module's class is swapped for a traced subclass, in place.

What was found for each watched module goes into the :class:`ConversionReport` that
``fuse_attention_report`` returned, as the calls happen (``ConversionReport.watching`` lists the
modules not called yet).
"""

from __future__ import annotations

from torch import nn

from seq2seq_fast.nn.convert._base import ConversionReport
from seq2seq_fast.nn.convert.traced import runtime, watching
from seq2seq_fast.nn.convert.traced.watching import LAYOUT

__all__ = ["LAYOUT", "traced_class", "watch_model"]

traced_class = runtime.traced_class


def watch_model(model: nn.Module, report: ConversionReport, backend: str) -> None:
    """Watch the modules of ``model`` the general path may convert; each converts (or is reported)
    after its first call (see the module docstring)."""
    watching.watch_model(model, report, backend, runtime.convert)
