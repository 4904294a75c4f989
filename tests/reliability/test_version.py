"""One version: pyproject.toml's, in the installed metadata; ``__version__`` and CHANGELOG agree."""

import importlib.metadata
import re
from pathlib import Path

import seq2seq_fast

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_metadata_version():
    assert seq2seq_fast.__version__ == importlib.metadata.version("seq2seq-fast")
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    # an editable install made before a version bump keeps the old metadata: reinstall then
    assert declared and declared.group(1) == seq2seq_fast.__version__, "reinstall the package"


def test_changelog_names_the_version():
    headings = re.findall(r"^## (\d+\.\d+\.\d+)", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings and headings[0] == seq2seq_fast.__version__, headings[:3]
