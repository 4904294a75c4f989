"""Decoding with a trained :class:`~seq2seq_fast.seq2seq.models.Seq2Seq`: batched greedy decoding and
beam search (GNMT scoring), both returning the attention matrices, and batched translation of id
sequences and of text.

    greedy_decode, beam_search   src [B, S], src_lengths [B] -> B hypotheses
    decode                       id sequences in length-sorted batches, results in input order
    translate_text               one sentence of text (normalised as the corpus was)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from seq2seq_fast.seq2seq.data import BOS_ID, EOS_ID, PAD_ID, make_batch, normalize_text
from seq2seq_fast.seq2seq.models import Seq2Seq, map_state


@dataclass
class Hypothesis:
    """One decoded sequence: ``tokens`` without <s>/</s>; ``attention`` [len(tokens) (+1 for </s>
    when it was produced), src_length] float32 on CPU; ``score`` the (normalised) log-probability."""

    tokens: list[int]
    attention: Tensor
    score: float


def max_output_lengths(src_lengths: Tensor, max_len_factor: float, max_len: int | None) -> Tensor:
    """Per row: at most ceil(factor * src_length) + 1 output steps (the +1 leaves room for </s>)."""
    limit = torch.ceil(src_lengths.double() * max_len_factor).long() + 1
    if max_len is not None:
        limit = limit.clamp(max=max_len)
    return limit.clamp(min=1)


@torch.no_grad()
def greedy_decode(
    model: Seq2Seq,
    src: Tensor,
    src_lengths: Tensor,
    *,
    max_len_factor: float = 2.0,
    max_len: int | None = None,
) -> list[Hypothesis]:
    """Batched greedy decoding: src [B, S], src_lengths [B] -> B hypotheses with attention."""
    was_training = model.training
    model.eval()
    try:
        memory, state = model.encode(src, src_lengths)
        batch = src.shape[0]
        limits = max_output_lengths(memory.lengths, max_len_factor, max_len)
        y = torch.full((batch,), BOS_ID, dtype=torch.long, device=src.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
        out_tokens, out_weights, scores = [], [], torch.zeros(batch, dtype=torch.float64)
        for t in range(int(limits.max())):
            logits, weights, state = model.decoder.step(y, state, memory)
            logp = logits.double().log_softmax(-1)
            logp[:, PAD_ID] = -math.inf
            at_limit = limits.to(src.device) <= t + 1
            logp[at_limit] = torch.where(
                torch.arange(logp.shape[1], device=src.device) == EOS_ID, 0.0, -math.inf
            ).double()
            y = logp.argmax(-1)
            y = torch.where(finished, torch.full_like(y, PAD_ID), y)
            scores += torch.where(
                finished, 0.0, logp.gather(1, y.clamp(min=0)[:, None])[:, 0]
            ).cpu()
            out_tokens.append(y)
            out_weights.append(weights.float())
            finished |= y == EOS_ID
            if bool(finished.all()):
                break
        tokens = torch.stack(out_tokens, 1).cpu()
        weights = torch.stack(out_weights, 1).cpu()
    finally:
        model.train(was_training)
    results = []
    for b in range(batch):
        row = tokens[b].tolist()
        n = row.index(EOS_ID) if EOS_ID in row else len(row)
        rows = n + 1 if n < len(row) else n
        src_len = int(src_lengths[b])
        results.append(Hypothesis(row[:n], weights[b, :rows, :src_len].clone(), float(scores[b])))
    return results


def length_penalty(length: int | Tensor, alpha: float):
    """GNMT's length normalisation ((5 + len) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def coverage_penalty(attention_sum: Tensor, beta: float) -> Tensor:
    """GNMT's coverage penalty beta * sum_s log(min(attention_sum_s, 1)) over valid positions
    (attention_sum [..., S], each entry clamped below at 1e-10 so unattended words cost a finite
    amount)."""
    return beta * torch.log(attention_sum.clamp(min=1e-10, max=1.0)).sum(-1)


@torch.no_grad()
def beam_search(
    model: Seq2Seq,
    src: Tensor,
    src_lengths: Tensor,
    *,
    beam_size: int = 5,
    alpha: float = 0.6,
    beta: float = 0.0,
    max_len_factor: float = 2.0,
    max_len: int | None = None,
) -> list[Hypothesis]:
    """Batched beam search with GNMT scoring: log p / lp(len) + cp, over B*K rows at once.

    A hypothesis ending in </s> is scored (log p / ((5+len)/6)^alpha + beta * sum log min(cov, 1))
    and set aside; a row stops when it holds ``beam_size`` finished hypotheses or hits its length
    limit (ceil(max_len_factor * src_len) + 1 steps). With beam_size=1 this is greedy decoding.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    was_training = model.training
    model.eval()
    try:
        return _beam_search(
            model, src, src_lengths, beam_size, alpha, beta, max_len_factor, max_len
        )
    finally:
        model.train(was_training)


def _beam_search(model, src, src_lengths, beam, alpha, beta, max_len_factor, max_len):
    device = src.device
    batch, src_max = src.shape
    memory, state = model.encode(src, src_lengths)
    limits = max_output_lengths(memory.lengths, max_len_factor, max_len).tolist()
    expand = torch.arange(batch, device=device).repeat_interleave(beam)
    memory = memory.index_select(expand)
    state = map_state(lambda s: s.index_select(0, expand), state)
    valid = (
        torch.arange(src_max, device=device)[None, :] < memory.lengths[:, None]
    ).float()  # [B*K, S]

    scores = torch.full((batch, beam), -math.inf, device=device, dtype=torch.float64)
    scores[:, 0] = 0.0
    y = torch.full((batch * beam,), BOS_ID, dtype=torch.long, device=device)
    history = torch.empty((batch * beam, 0), dtype=torch.long, device=device)
    attn_history = torch.empty((batch * beam, 0, src_max), device=device)
    finished: list[list[tuple[float, list[int], Tensor, float]]] = [[] for _ in range(batch)]
    done = [False] * batch
    vocab_ids = None
    for t in range(max(limits)):
        logits, weights, state = model.decoder.step(y, state, memory)
        logp = logits.double().log_softmax(-1)
        vocab = logp.shape[-1]
        if vocab_ids is None:
            vocab_ids = torch.arange(vocab, device=device)
        logp[:, PAD_ID] = -math.inf
        at_limit = torch.tensor([limits[b] <= t + 1 for b in range(batch)], device=device)
        at_limit = at_limit.repeat_interleave(beam)
        logp[at_limit] = torch.where(vocab_ids == EOS_ID, 0.0, -math.inf).double()
        candidates = (scores.reshape(-1, 1) + logp).reshape(batch, beam * vocab)
        top_scores, top_ids = candidates.topk(min(2 * beam, beam * vocab), dim=-1)
        origin = top_ids // vocab  # beam index within the row
        token = top_ids % vocab
        is_eos = token == EOS_ID
        weights = weights.float()
        attn_now = torch.cat([attn_history, weights[:, None, :]], dim=1)

        # Set aside hypotheses that end here (only among the top `beam` candidates).
        eos_hits = (is_eos[:, :beam] & torch.isfinite(top_scores[:, :beam])).nonzero().tolist()
        for b, rank in eos_hits:
            if done[b]:
                continue
            row = b * beam + int(origin[b, rank])
            length = t + 1
            raw = float(top_scores[b, rank])
            score = raw / float(length_penalty(length, alpha))
            if beta > 0:
                coverage = (attn_now[row].sum(0) * valid[row])[: int(memory.lengths[row])]
                score += float(coverage_penalty(coverage, beta))
            finished[b].append((score, history[row].tolist(), attn_now[row].cpu(), raw))
        for b in range(batch):
            if not done[b] and (len(finished[b]) >= beam or limits[b] <= t + 1):
                done[b] = True
        if all(done):
            break

        # Keep the best `beam` continuations that do not end here.
        order = torch.sort(is_eos.to(torch.int8), dim=1, stable=True).indices[:, :beam]
        keep_scores = top_scores.gather(1, order)
        keep_origin = origin.gather(1, order)
        keep_token = token.gather(1, order)
        done_rows = torch.tensor(done, device=device)
        keep_scores[done_rows] = -math.inf
        rows = (torch.arange(batch, device=device)[:, None] * beam + keep_origin).reshape(-1)
        state = map_state(lambda s, rows=rows: s.index_select(0, rows), state)
        y = keep_token.reshape(-1)
        history = torch.cat([history.index_select(0, rows), y[:, None]], dim=1)
        attn_history = attn_now.index_select(0, rows)
        scores = keep_scores

    results = []
    for b in range(batch):
        src_len = int(src_lengths[b])
        if finished[b]:
            score, tokens, attn, _ = max(finished[b], key=lambda h: h[0])
            results.append(Hypothesis(tokens, attn[:, :src_len].clone(), score))
        else:  # cannot happen with length limits; kept for safety
            row = b * beam
            results.append(
                Hypothesis(
                    history[row].tolist(), attn_history[row, :, :src_len].cpu(), float(scores[b, 0])
                )
            )
    return results


def decode(
    model: Seq2Seq,
    sources: list[list[int]],
    *,
    device: torch.device | str = "cpu",
    beam: int = 1,
    batch_size: int = 256,
    max_len_factor: float = 2.0,
    alpha: float = 0.6,
    beta: float = 0.0,
) -> list[Hypothesis]:
    """Decode id sequences in length-sorted batches; results in input order."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: list[Hypothesis | None] = [None] * len(sources)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = make_batch([(sources[i] or [0], [0]) for i in idx]).to(device)
        if beam == 1:
            hyps = greedy_decode(model, batch.src, batch.src_lengths, max_len_factor=max_len_factor)
        else:
            hyps = beam_search(
                model, batch.src, batch.src_lengths, beam_size=beam,
                max_len_factor=max_len_factor, alpha=alpha, beta=beta,
            )  # fmt: skip
        for i, hyp in zip(idx, hyps, strict=True):
            results[i] = hyp
    return results  # type: ignore[return-value]


def translate_text(
    model: Seq2Seq,
    src_vocab,
    tgt_vocab,
    text: str,
    *,
    beam: int = 1,
    alpha: float = 0.6,
    beta: float = 0.0,
    max_len_factor: float = 2.0,
    device: torch.device | str = "cpu",
) -> tuple[Hypothesis, list[int]]:
    """Translate one sentence (normalised as the training corpus was): -> (hypothesis, source ids)."""
    ids = src_vocab.encode(normalize_text(text))
    if not ids:
        raise ValueError("the input sentence is empty")
    src = torch.tensor([ids], dtype=torch.long, device=device)
    lengths = torch.tensor([len(ids)], dtype=torch.long, device=device)
    if beam <= 1:
        hyp = greedy_decode(model, src, lengths, max_len_factor=max_len_factor)[0]
    else:
        hyp = beam_search(
            model, src, lengths, beam_size=beam, alpha=alpha, beta=beta,
            max_len_factor=max_len_factor,
        )[0]  # fmt: skip
    return hyp, ids
