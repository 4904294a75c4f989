"""The converter is imported on first use: ``import seq2seq_fast`` stays light (start-up time of
``seq2seq-fast translate``), and its names still resolve from the package and from ``nn``."""

import subprocess
import sys


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_leaves_the_converter_unloaded_until_used():
    out = _run(
        "import sys, seq2seq_fast, seq2seq_fast.nn as nn\n"
        "print('BEFORE', 'seq2seq_fast.nn.convert' in sys.modules)\n"
        "from seq2seq_fast import fuse_attention\n"
        "import seq2seq_fast.nn.convert as convert\n"
        "print('AFTER', 'seq2seq_fast.nn.convert' in sys.modules)\n"
        "print('SAME', fuse_attention is convert.fuse_attention is nn.fuse_attention,\n"
        "      nn.ConversionReport is convert.ConversionReport,\n"
        "      nn.fuse_attention_report is convert.fuse_attention_report)\n"
        "print('DIR', all(n in dir(nn) for n in nn.__all__), 'fuse_attention' in dir(seq2seq_fast))\n"
    )
    assert "BEFORE False" in out, out
    assert "AFTER True" in out, out
    assert "SAME True True True" in out, out
    assert "DIR True True" in out, out


def test_unknown_names_still_raise_attribute_error():
    out = _run(
        "import seq2seq_fast, seq2seq_fast.nn as nn\n"
        "for module in (seq2seq_fast, nn):\n"
        "    try:\n"
        "        module.no_such_name\n"
        "    except AttributeError as e:\n"
        "        print('RAISED', 'no_such_name' in str(e))\n"
    )
    assert out.count("RAISED True") == 2, out
