"""Attention heatmaps (matplotlib, Agg canvas: no display needed, no global backend change)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from seq2seq_fast.seq2seq.decoding import DecodeOptions
from seq2seq_fast.seq2seq.models import Seq2Seq
from seq2seq_fast.seq2seq.translate import Translation, Translator


def image_path(path: str | Path) -> Path:
    """``path`` as the heatmap is written: ".png" added to a path without an ending (matplotlib
    would add it itself, and the path reported be wrong); an ending no format has refused
    (ValueError naming it and the endings there are)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    kinds = FigureCanvasAgg.get_supported_filetypes()
    if path.suffix[1:].lower() not in kinds:
        raise ValueError(
            f"{path}: no image format has the ending {path.suffix!r}; give one of "
            + ", ".join(f".{kind}" for kind in sorted(kinds))
        )
    return path


def plot_attention(
    weights: Tensor,
    source_tokens: Sequence[str],
    target_tokens: Sequence[str],
    path: str | Path,
    *,
    title: str | None = None,
) -> Path:
    """Save a heatmap of ``weights`` [len(target_tokens), len(source_tokens)] to ``path``, in the
    format its ending names (.png, .pdf, .svg, ...; none: .png is added). Returns the path written.

    Rows are output tokens (y axis), columns source tokens (x axis).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = image_path(path)
    weights = torch.as_tensor(weights, dtype=torch.float32).cpu()
    rows, cols = len(target_tokens), len(source_tokens)
    if weights.shape != (rows, cols):
        raise ValueError(
            f"weights must be [targets={rows}, sources={cols}], got {list(weights.shape)}"
        )
    width = min(2.0 + 0.35 * cols, 30.0)
    height = min(1.5 + 0.35 * rows, 30.0)
    figure = Figure(figsize=(max(width, 4.0), max(height, 3.0)), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    image = axes.imshow(weights.numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    axes.set_xticks(range(cols))
    axes.set_xticklabels(list(source_tokens), rotation=90)
    axes.set_yticks(range(rows))
    axes.set_yticklabels(list(target_tokens))
    axes.set_xlabel("source")
    axes.set_ylabel("output")
    if title:
        axes.set_title(title, fontsize=9)
    figure.colorbar(image, ax=axes, fraction=0.046, pad=0.04)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def plot_result(result: Translation, src_vocab, tgt_vocab, text: str, path: str | Path) -> Path:
    """Save the alignment heatmap of a translated sentence (its best hypothesis), source and
    output tokens on the axes, ``text`` and the translation as the title."""
    hyp = result.hypotheses[0]
    target = tgt_vocab.pieces(hyp.tokens)
    if hyp.attention.shape[0] > len(target):
        target.append("</s>")
    return plot_attention(
        hyp.attention,
        src_vocab.pieces(result.source_ids),
        target,
        path,
        title=f"{text}  ->  {result.text}",
    )


def plot_translation(
    model: Seq2Seq,
    src_vocab,
    tgt_vocab,
    text: str,
    path: str | Path,
    *,
    beam: int = 1,
    device: torch.device | str = "cpu",
) -> Path:
    """Translate ``text`` and save the alignment heatmap with source/output tokens on the axes."""
    translator = Translator(
        model, src_vocab, tgt_vocab, options=DecodeOptions(beam=beam), device=device
    )
    result = translator.translate([text])[0]
    if result.warning is not None:
        raise ValueError(f"cannot plot {text!r}: {result.warning.replace('line 1: ', '')}")
    return plot_result(result, src_vocab, tgt_vocab, text, path)
