"""The README's API and command-line tables name only what exists: every ``name=`` keyword of
the API table is a parameter of that function, every ``--flag`` of the command table an option
of some ``seq2seq-fast`` command."""

import inspect
import re
from pathlib import Path

import pytest

import seq2seq_fast
from seq2seq_fast.seq2seq.cli import build_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
FUNCTIONS = {
    "additive_attention": seq2seq_fast.additive_attention,
    "fuse_attention": seq2seq_fast.fuse_attention,
    "BahdanauAttention": seq2seq_fast.BahdanauAttention,
}


def _table_rows(heading: str) -> list[list[str]]:
    section = README.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [
        [cell.strip() for cell in line.strip("|").split(" | ")]
        for line in section.splitlines()
        if line.startswith("| `")
    ]


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_api_table_keywords_exist(name):
    rows = [row for row in _table_rows("API") if row[0].startswith(f"`{name}`")]
    assert rows, f"README's API table has no row for {name}"
    listed = set(re.findall(r"\b([a-z_]+)=", rows[0][1]))
    fn = FUNCTIONS[name]
    params = set(inspect.signature(fn).parameters)
    if inspect.isclass(fn):  # the row gives the constructor's and the call's arguments
        params |= set(inspect.signature(fn.forward).parameters)
    assert listed <= params, f"{name}: README lists {sorted(listed - params)}, not parameters"


def test_command_table_flags_exist():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    options = {opt for p in sub.choices.values() for a in p._actions for opt in a.option_strings}
    rows = [row for row in _table_rows("Command line") if not row[0].startswith("`torchrun")]
    text = "\n".join(" | ".join(row) for row in rows)
    listed = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))
    assert listed, "no flag found in README's command-line table"
    assert listed <= options, f"README names flags no command has: {sorted(listed - options)}"
