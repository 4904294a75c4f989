"""Decoding with a trained :class:`~seq2seq_fast.seq2seq.models.Seq2Seq`: batched greedy decoding and
beam search (GNMT scoring), both returning the attention matrices, and batched decoding of id
sequences and of text.

    DecodeOptions          how to search: beam (1 = greedy), n_best, alpha, beta, length limit
    search                 src [B, S], src_lengths [B], options -> B lists of hypotheses, best
                           first: the one entry, greedy or beam as ``options.beam`` says
    greedy_search          the greedy search itself: -> B hypotheses
    beam_search            the beam search itself: -> B lists of the n best hypotheses
    decode                 id sequences in length-sorted batches, results in input order

Both searches run every sentence of the batch at once (B rows, or B x beam rows) and drop a
sentence's rows from the batch as soon as it is finished, so the batch shrinks as it goes. Rows
never interact: padding is masked in the encoder (packed sequences or per-row reversal) and in the
attention (source lengths), so a sentence decodes to the same tokens, and the same scores up to
float rounding, in any batch (tests/seq2seq/test_translate.py checks it against one sentence at a time).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from seq2seq_fast.seq2seq.data.batching import make_batch
from seq2seq_fast.seq2seq.data.vocab import BOS_ID, EOS_ID, PAD_ID
from seq2seq_fast.seq2seq.models import Memory, Seq2Seq, map_state


@dataclass
class Hypothesis:
    """One decoded sequence: ``tokens`` without <s>/</s>; ``attention`` [len(tokens) (+1 for </s>
    when it was produced), src_length] float32 on CPU; ``score`` the log-probability (greedy) or
    the GNMT-normalised log-probability (beam search)."""

    tokens: list[int]
    attention: Tensor
    score: float


@dataclass(frozen=True)
class DecodeOptions:
    """How to search; the one place that holds the defaults. ``beam`` 1 = greedy; ``n_best``
    (<= beam) hypotheses per sentence, best first; ``alpha``/``beta`` GNMT's length and coverage
    penalties (beam only); at most ceil(max_len_factor * source length) + 1 output steps, and at
    most ``max_len`` when set."""

    beam: int = 1
    n_best: int = 1
    alpha: float = 0.6
    beta: float = 0.0
    max_len_factor: float = 2.0
    max_len: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.beam, int) or self.beam < 1:
            raise ValueError(f"beam must be an int >= 1, got {self.beam!r}")
        if not isinstance(self.n_best, int) or self.n_best < 1:
            raise ValueError(f"n_best must be an int >= 1, got {self.n_best!r}")
        if self.n_best > self.beam:
            raise ValueError(f"n_best {self.n_best} needs beam >= {self.n_best}, got {self.beam}")
        for name in ("alpha", "beta"):  # GNMT's penalties: weights >= 0
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if not (math.isfinite(self.max_len_factor) and self.max_len_factor > 0):
            raise ValueError(f"max_len_factor must be finite and > 0, got {self.max_len_factor!r}")
        if self.max_len is not None and (not isinstance(self.max_len, int) or self.max_len < 1):
            raise ValueError(f"max_len must be an int >= 1 or None, got {self.max_len!r}")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> DecodeOptions:
        """Options from the entries of ``kwargs`` named as fields, which are removed from it."""
        return cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in cls.__dataclass_fields__})


def search(
    model: Seq2Seq, src: Tensor, src_lengths: Tensor, options: DecodeOptions = DecodeOptions()
) -> list[list[Hypothesis]]:
    """Decode a batch, src [B, S] int64 and src_lengths [B]: -> B lists of up to
    ``options.n_best`` hypotheses, best first; greedy when ``options.beam`` is 1, else beam
    search."""
    if options.beam == 1:
        return [[hyp] for hyp in greedy_search(model, src, src_lengths, options)]
    return beam_search(model, src, src_lengths, options)


def max_output_lengths(src_lengths: Tensor, max_len_factor: float, max_len: int | None) -> Tensor:
    """Per row: at most ceil(factor * src_length) + 1 output steps (the +1 leaves room for </s>)."""
    limit = torch.ceil(src_lengths.double() * max_len_factor).long() + 1
    if max_len is not None:
        limit = limit.clamp(max=max_len)
    return limit.clamp(min=1)


def _step_log_probs(model: Seq2Seq, y: Tensor, state, memory: Memory, at_limit: Tensor):
    """One decoder step: -> (log-probabilities float32 [R, V] with <pad> excluded and only </s>
    allowed on rows ``at_limit`` [R] bool, attention weights float32 [R, S], new state).

    The log-softmax in float32 (in float64 it took ~7% of a beam search's time); the searches
    add these up in float64, so that scores stay batch-independent to ~1e-7."""
    step = getattr(model, "step_log_probs", None)
    if step is not None:  # a DecodingModel or an Ensemble (inference.py)
        logp, weights, state = step(y, state, memory)
    else:
        logits, weights, state = model.decoder.step(y, state, memory)
        logp, weights = logits.float().log_softmax(-1), weights.float()
    logp[:, PAD_ID] = -math.inf
    if bool(at_limit.any()):
        only_eos = torch.full_like(logp[0], -math.inf)
        only_eos[EOS_ID] = 0.0
        logp[at_limit] = only_eos
    return logp, weights, state


def _topk_rows(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest entries of each row of x [R, V], largest first (values, int64 indices):
    on CPU float32 rows of 256+ entries through the extension's ``_topk_rows`` (torch.topk spent
    ~3 us per row on its own bookkeeping, 12-16% of a beam search), else torch.topk."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] >= 256:
        op = _topk_op()
        if op is not None:
            return op(x, k)
    return x.topk(k, dim=-1)


@functools.cache
def _topk_op():
    from seq2seq_fast.ops import _library  # loads the extension

    if _library.CPU_KERNEL_ERROR is not None or not hasattr(torch.ops.seq2seq_fast, "_topk_rows"):
        return None  # an extension built before the op: torch.topk
    return torch.ops.seq2seq_fast._topk_rows


def _step_topk(model, y: Tensor, state, memory, at_limit: Tensor, k: int):
    """One decoder step's k best tokens per row: -> (log-probabilities float32 [R, k], tokens
    int64 [R, k], attention weights float32 [R, S], new state), best first; <pad> never, and
    only </s> (log-probability 0, the rest -inf) on rows ``at_limit``. As
    :func:`_step_log_probs` and a top-k, but for a model with ``step_logits`` (a DecodingModel)
    on CPU one pass of the extension's ``_log_softmax_topk`` over the logits: the [R, V]
    log-probabilities are never written."""
    step_logits = getattr(model, "step_logits", None)
    op = _log_softmax_topk_op() if step_logits is not None else None
    if op is not None:
        logits, weights, state = step_logits(y, state, memory)
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and k < logits.shape[-1]:
            values, tokens = op(logits, k, PAD_ID)
            if bool(at_limit.any()):
                values[at_limit] = -math.inf
                values[at_limit, 0] = 0.0
                tokens[at_limit, 0] = EOS_ID
            return values, tokens, weights, state
        logp = logits.log_softmax(-1)
        logp[:, PAD_ID] = -math.inf
        if bool(at_limit.any()):
            logp[at_limit] = -math.inf
            logp[at_limit, EOS_ID] = 0.0
    else:
        logp, weights, state = _step_log_probs(model, y, state, memory, at_limit)
    values, tokens = _topk_rows(logp, k)
    return values, tokens, weights, state


@functools.cache
def _log_softmax_topk_op():
    _topk_op()  # loads the extension
    if not hasattr(torch.ops.seq2seq_fast, "_log_softmax_topk"):
        return None
    return torch.ops.seq2seq_fast._log_softmax_topk


class _Rows:
    """The rows still decoding: their batch indices, memory, state and length limits."""

    def __init__(self, index: Tensor, memory: Memory, state, limits: Tensor) -> None:
        self.index, self.memory, self.state, self.limits = index, memory, state, limits

    def keep(self, rows: Tensor) -> None:
        """Keep only ``rows`` (int64 positions among the current rows), in that order."""
        self.index = self.index.index_select(0, rows)
        self.memory = self.memory.index_select(rows)
        self.state = map_state(lambda s: s.index_select(0, rows), self.state)
        self.limits = self.limits.index_select(0, rows)


@torch.no_grad()
def greedy_search(
    model: Seq2Seq, src: Tensor, src_lengths: Tensor, options: DecodeOptions = DecodeOptions()
) -> list[Hypothesis]:
    """Batched greedy decoding: src [B, S] int64, src_lengths [B] -> B hypotheses with attention
    (of ``options``, only the length limit applies).

    A row leaves the batch when it produces </s> (at the latest at its length limit).
    """
    was_training = model.training
    model.eval()
    try:
        memory, state = model.encode(src, src_lengths)
        batch, device = src.shape[0], src.device
        limits = max_output_lengths(memory.lengths, options.max_len_factor, options.max_len)
        steps = int(limits.max())
        tokens = torch.full((batch, steps), PAD_ID, dtype=torch.long, device=device)
        weights = torch.zeros(batch, steps, src.shape[1], device=device)
        scores = torch.zeros(batch, dtype=torch.float64, device=device)
        rows = _Rows(torch.arange(batch, device=device), memory, state, limits)
        y = torch.full((batch,), BOS_ID, dtype=torch.long, device=device)
        for t in range(steps):
            best, best_token, step_weights, rows.state = _step_topk(
                model, y, rows.state, rows.memory, rows.limits <= t + 1, 1
            )
            y = best_token[:, 0]
            tokens[rows.index, t] = y
            weights[rows.index, t] = step_weights
            scores[rows.index] += best[:, 0]
            going = (y != EOS_ID).nonzero()[:, 0]
            if going.numel() == 0:
                break
            if going.numel() < y.numel():
                rows.keep(going)
                y = y.index_select(0, going)
    finally:
        model.train(was_training)
    return _greedy_results(tokens.cpu(), weights.cpu(), scores.cpu(), src_lengths.cpu())


def _greedy_results(tokens: Tensor, weights: Tensor, scores: Tensor, src_lengths: Tensor):
    results = []
    for b in range(tokens.shape[0]):
        row = tokens[b].tolist()
        n = row.index(EOS_ID) if EOS_ID in row else len(row)
        steps = n + 1 if n < len(row) else n
        src_len = int(src_lengths[b])
        results.append(Hypothesis(row[:n], weights[b, :steps, :src_len].clone(), float(scores[b])))
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
    model: Seq2Seq, src: Tensor, src_lengths: Tensor, options: DecodeOptions
) -> list[list[Hypothesis]]:
    """Batched beam search with GNMT scoring, log p / lp(len) + cp, over B*K rows at once (K =
    ``options.beam``): -> for each row of src [B, S] the ``options.n_best`` best finished
    hypotheses, best first.

    A hypothesis ending in </s> is scored (log p / ((5+len)/6)^alpha + beta * sum log min(cov, 1))
    and set aside; a sentence stops (and leaves the batch) when it holds K finished hypotheses or
    hits its length limit (ceil(max_len_factor * src_len) + 1 steps). With K=1 this is greedy
    decoding.
    """
    was_training = model.training
    model.eval()
    try:
        limits = max_output_lengths(src_lengths, options.max_len_factor, options.max_len)
        search = _BeamSearch(
            model, src, src_lengths, limits, options.beam, options.alpha, options.beta
        )
        search.run()
    finally:
        model.train(was_training)
    return search.results(options.n_best)


class _BeamSearch:
    """The state of one batched beam search: K rows per sentence still searching, their scores,
    tokens and attention so far, and each sentence's finished hypotheses."""

    def __init__(
        self, model: Seq2Seq, src: Tensor, src_lengths: Tensor, limits: Tensor, beam, alpha, beta
    ):
        self.model, self.beam, self.alpha, self.beta = model, beam, alpha, beta
        config = getattr(model, "config", None) or model.members[0].config  # an Ensemble's
        self.model_vocabulary = config.tgt_vocab_size
        self.src_lengths = src_lengths.cpu()
        self.limits = limits.tolist()  # output steps per sentence
        self.device = device = src.device
        batch, src_max = src.shape
        memory, state = model.encode(src, src_lengths)
        expand = torch.arange(batch, device=device).repeat_interleave(beam)
        # A model that attends with the K rows of a sentence as K queries of its one memory
        # (DecodingModel) keeps the memory per sentence: not copied K times, nor reordered.
        self.grouped = bool(getattr(model, "groups_rows", False))
        self.rows = _Rows(  # index: the sentence of each row
            expand,
            memory if self.grouped else memory.index_select(expand),
            map_state(lambda s: s.index_select(0, expand), state),
            limits.to(device).index_select(0, expand),
        )
        self.scores = torch.full((batch, beam), -math.inf, device=device, dtype=torch.float64)
        self.scores[:, 0] = 0.0
        self.y = torch.full((batch * beam,), BOS_ID, dtype=torch.long, device=device)
        self.history = torch.empty((batch * beam, 0), dtype=torch.long, device=device)
        self.attn_history = torch.empty((batch * beam, 0, src_max), device=device)
        self.finished: list[list[tuple[float, list[int], Tensor]]] = [[] for _ in range(batch)]

    def run(self) -> None:
        """Search until every sentence is done."""
        for t in range(max(self.limits)):
            sentences = self.rows.index[:: self.beam].tolist()
            # A sentence's 2K best continuations are among its rows' 2K best tokens each: take
            # those first (float32, [rows, V]), then add the rows' scores to these few only,
            # instead of forming and searching all K x V float64 candidates (5% of a search).
            vocabulary = self.model_vocabulary
            per_row = min(2 * self.beam, vocabulary - 1)
            row_logp, row_token, weights, self.rows.state = _step_topk(
                self.model,
                self.y,
                self.rows.state,
                self.rows.memory,
                self.rows.limits <= t + 1,
                per_row,
            )
            candidates = (self.scores.reshape(-1, 1) + row_logp).reshape(len(sentences), -1)
            top_scores, top_ids = candidates.topk(min(2 * self.beam, candidates.shape[1]), dim=-1)
            origin = top_ids // per_row
            token = row_token.reshape(len(sentences), -1).gather(1, top_ids)
            is_eos = token == EOS_ID
            attn_now = torch.cat([self.attn_history, weights[:, None, :]], dim=1)
            self._set_aside(t, sentences, top_scores, origin, is_eos, attn_now)
            done = [
                len(self.finished[s]) >= self.beam or self.limits[s] <= t + 1 for s in sentences
            ]
            if all(done):
                break
            self._advance(done, top_scores, origin, token, is_eos, attn_now)

    def _set_aside(self, t, sentences, top_scores, origin, is_eos, attn_now) -> None:
        """Score and keep the hypotheses ending in </s> among each sentence's top K candidates."""
        beam = self.beam
        hits = (is_eos[:, :beam] & torch.isfinite(top_scores[:, :beam])).nonzero().tolist()
        for local, rank in hits:
            row = local * beam + int(origin[local, rank])
            score = float(top_scores[local, rank]) / float(length_penalty(t + 1, self.alpha))
            if self.beta > 0:
                length = int(self.src_lengths[sentences[local]])
                coverage = attn_now[row, :, :length].sum(0)
                score += float(coverage_penalty(coverage, self.beta))
            self.finished[sentences[local]].append(
                (score, self.history[row].tolist(), attn_now[row].cpu())
            )

    def _advance(self, done, top_scores, origin, token, is_eos, attn_now) -> None:
        """Keep the best K continuations that do not end here, for the sentences not done; drop
        the rows of the sentences that are."""
        beam = self.beam
        order = torch.sort(is_eos.to(torch.int8), dim=1, stable=True).indices[:, :beam]
        keep_scores = top_scores.gather(1, order)
        keep_origin = origin.gather(1, order)
        going = torch.tensor([not d for d in done], device=self.device).nonzero()[:, 0]
        local = torch.arange(len(done), device=self.device)[:, None]
        rows = (local * beam + keep_origin).index_select(0, going).reshape(-1)
        # The state follows the kept hypotheses; the memory, lengths and limits are the same for
        # the K rows of a sentence, so they change only when sentences leave.
        self.rows.state = map_state(lambda s: s.index_select(0, rows), self.rows.state)
        if going.numel() < len(done):
            sentence_rows = going[:, None] * beam + torch.arange(beam, device=self.device)
            sentence_rows = sentence_rows.reshape(-1)
            self.rows.index = self.rows.index.index_select(0, sentence_rows)
            self.rows.memory = self.rows.memory.index_select(
                going if self.grouped else sentence_rows
            )
            self.rows.limits = self.rows.limits.index_select(0, sentence_rows)
        self.scores = keep_scores.index_select(0, going)
        self.y = token.gather(1, order).index_select(0, going).reshape(-1)
        self.history = torch.cat([self.history.index_select(0, rows), self.y[:, None]], dim=1)
        self.attn_history = attn_now.index_select(0, rows)

    def results(self, n_best: int) -> list[list[Hypothesis]]:
        out = []
        for b, finished in enumerate(self.finished):
            src_len = int(self.src_lengths[b])
            ranked = sorted(finished, key=lambda h: -h[0])[:n_best]  # stable: first found first
            out.append([Hypothesis(t, a[:, :src_len].clone(), s) for s, t, a in ranked])
        return out


def decode(
    model: Seq2Seq,
    sources: Sequence[Sequence[int]],
    options: DecodeOptions = DecodeOptions(),
    *,
    device: torch.device | str = "cpu",
    batch_size: int = 256,
) -> list[Hypothesis]:
    """Decode id sequences in length-sorted batches: -> the best hypothesis of each, in input
    order."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: list[Hypothesis | None] = [None] * len(sources)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = make_batch([(sources[i] or [0], [0]) for i in idx]).to(device)
        for i, hyps in zip(idx, search(model, batch.src, batch.src_lengths, options), strict=True):
            results[i] = hyps[0]
    return results  # type: ignore[return-value]
