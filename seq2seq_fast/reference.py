"""``seq2seq_fast.reference``: the plain-PyTorch reference, importable here as it always was.

The code lives in :mod:`seq2seq_fast.ops.reference`.
"""

from seq2seq_fast.ops.reference import *  # noqa: F403
from seq2seq_fast.ops.reference import __all__  # noqa: F401
