"""``python -m seq2seq_fast`` is the ``seq2seq-fast`` command."""

import sys

from seq2seq_fast.seq2seq.cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())
