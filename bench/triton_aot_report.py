"""Former name of ``bench/compile_check.py`` (kept so that older notes still run).

    python bench/triton_aot_report.py [--full] [--arch 90] [--json PATH] [--sass-dir DIR]

Compiles the Triton kernels for sm_90 through a stand-in driver, as the GPU would compile them,
and reports registers, spills, shared memory, blocks per SM and the tanh loop's instructions.
``--quick`` is accepted and means the default (CI) case list.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.compile_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main([arg for arg in sys.argv[1:] if arg != "--quick"]))
