"""Evaluation of a model during and after training: held-out accuracy (reverse), sacreBLEU
(translate), and the one-line description of the metrics in the log."""

from __future__ import annotations

from typing import Any

import torch

from seq2seq_fast.seq2seq.data.tasks import ReverseTask
from seq2seq_fast.seq2seq.decoding import DecodeOptions, decode
from seq2seq_fast.seq2seq.models import Seq2Seq


def reverse_accuracy(model: Seq2Seq, pairs, device: torch.device) -> dict[str, float]:
    hyps = decode(model, [s for s, _ in pairs], DecodeOptions(max_len_factor=1.0), device=device)
    seq_ok = tok_ok = tok_total = 0
    for hyp, (_, ref) in zip(hyps, pairs, strict=True):
        seq_ok += hyp.tokens == ref
        tok_ok += sum(a == b for a, b in zip(hyp.tokens, ref, strict=False))
        tok_total += len(ref)
    return {"seq_acc": seq_ok / len(pairs), "tok_acc": tok_ok / tok_total}


def bleu_score(
    model: Seq2Seq, pairs: list[tuple[str, str]], src_vocab, tgt_vocab, device, beam: int = 1
) -> float:
    import sacrebleu

    sources = [src_vocab.encode(s) for s, _ in pairs]
    hyps = decode(model, sources, DecodeOptions(beam=beam), device=device)
    outputs = [tgt_vocab.decode(h.tokens) for h in hyps]
    return float(sacrebleu.BLEU().corpus_score(outputs, [[t for _, t in pairs]]).score)


def bleu_signature() -> str:
    """sacreBLEU's signature of the BLEU that :func:`bleu_score` computes (one reference)."""
    import sacrebleu

    metric = sacrebleu.BLEU()
    metric.corpus_score(["a"], [["a"]])  # the signature counts the references of the last call
    return str(metric.get_signature())


def describe(metrics: dict[str, float]) -> str:
    """One line for the log: accuracies for reverse, BLEU scores for translate."""
    if "seq_acc" in metrics:
        return (
            f"held-out sequence accuracy {metrics['seq_acc']:.2%} (token {metrics['tok_acc']:.2%})"
        )
    return ", ".join(f"{k} {v:.2f}" for k, v in metrics.items())


def evaluate(job: Any, final: bool = False, model: Seq2Seq | None = None) -> dict[str, float]:
    """reverse: held-out accuracies; translate: valid BLEU (``eval_size`` pairs, greedy), or with
    ``final`` the test BLEU (beam ``eval_beam``). Of ``model``, default the job's (last) model."""
    config, task, device = job.config, job.task, job.ctx.device
    model = job.model if model is None else model
    if isinstance(task, ReverseTask):
        return reverse_accuracy(model, task.heldout_pairs, device)
    if final:
        if not task.corpus.test:  # official splits without a test file
            return {}
        return {
            "test_bleu": bleu_score(
                model,
                task.corpus.test,
                task.src_vocab,
                task.tgt_vocab,
                device,
                beam=config.eval_beam,
            )
        }
    return {
        "valid_bleu": bleu_score(
            model, task.corpus.valid[: config.eval_size], task.src_vocab, task.tgt_vocab, device
        )
    }


def score_of(metrics: dict[str, float]) -> float | None:
    return metrics.get("valid_bleu", metrics.get("seq_acc"))
