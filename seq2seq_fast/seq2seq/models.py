"""Attention Seq2Seq models on :class:`~seq2seq_fast.BahdanauAttention`: encoder, two decoders, search.

    Encoder        embedding -> GRU/LSTM (optionally bidirectional, multi-layer) over variable-
                   length batches (backward direction on rows reversed within their lengths)
    BahdanauDecoder  the paper's recurrence, one step at a time:
                   c_t = attend(query=s_{t-1}), s_t = cell([y_{t-1}; c_t], s_{t-1}),
                   p(y_t) = softmax(W [s_t; c_t])
    GNMTDecoder    the first decoder layer runs over the whole target at once; the attention for all
                   target steps is ONE fused call (Tq = target length); its context feeds the later
                   layers (GNMT's layout) -- the fast training path
    Seq2Seq        encoder + bridge + decoder; ``forward`` gives teacher-forced logits
    compile_model  torch.compile of a model as one graph (RNN layers and the fused op inside)

Decoding (greedy, beam search, batched translation) lives in :mod:`seq2seq_fast.seq2seq.decoding`;
its names stay importable from here.

Both decoders mask padding with the source lengths and project the encoder states once per source
batch (``BahdanauAttention.project_keys``), passing them as ``projected_keys`` at every step.

Token ids: every vocabulary in this package puts <pad>=0, <unk>=1, <s>=2, </s>=3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from seq2seq_fast.nn.attention import BahdanauAttention
from seq2seq_fast.nn.stepwise import StepwiseMemory
from seq2seq_fast.ops import recurrent as fused_gru
from seq2seq_fast.ops._torch_private import dynamo_tracing
from seq2seq_fast.ops.linear_cross_entropy import linear_cross_entropy
from seq2seq_fast.seq2seq.data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID  # noqa: F401 (re-exported)
from seq2seq_fast.seq2seq.precision import cast_once

CELLS = ("gru", "lstm")
DECODERS = ("bahdanau", "gnmt")
# What the vocabulary projection reads: "concat" the decoder's features themselves (for [s; c]
# 768 wide at hidden 256), "attentional" a_t = tanh(W_a features) of the hidden width (Luong et
# al.'s attentional vector, OpenNMT-py's layout): ~3x fewer multiply-adds in the largest product.
OUTPUT_LAYERS = ("concat", "attentional")

# A decoder state is a tuple of per-layer entries: a Tensor [B, H] (GRU) or a (h, c) pair (LSTM).
State = tuple


@dataclass
class Seq2SeqConfig:
    """Everything needed to rebuild a model (stored in checkpoints)."""

    src_vocab_size: int
    tgt_vocab_size: int
    embed_size: int = 128
    hidden_size: int = 256
    attention_size: int | None = None  # None = hidden_size
    encoder_layers: int = 1
    decoder_layers: int = 1
    cell: str = "gru"
    bidirectional: bool = True
    decoder: str = "gnmt"
    dropout: float = 0.0
    normalize_attention: bool = True
    backend: str = "auto"  # attention backend: "auto", "fused" or "reference"
    output_layer: str = "concat"  # see OUTPUT_LAYERS; "concat" is every older checkpoint's
    # Tied embeddings (Press & Wolf 2017): the decoder's output projection is its input embedding
    # (needs the projection's input width to be embed_size: output_layer "attentional" then
    # projects to embed_size); share_embeddings: the encoder's embedding is the decoder's too
    # (one vocabulary for both sides). Both off: every older checkpoint's parameters and keys.
    tie_embeddings: bool = False
    share_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.output_layer not in OUTPUT_LAYERS:
            raise ValueError(
                f"output_layer must be one of {OUTPUT_LAYERS}, got {self.output_layer!r}"
            )
        if self.cell not in CELLS:
            raise ValueError(f"cell must be one of {CELLS}, got {self.cell!r}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {self.decoder!r}")
        for name in ("src_vocab_size", "tgt_vocab_size", "embed_size", "hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.encoder_layers < 1 or self.decoder_layers < 1:
            raise ValueError("encoder_layers and decoder_layers must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                f"share_embeddings needs one vocabulary for both sides, got src_vocab_size "
                f"{self.src_vocab_size} and tgt_vocab_size {self.tgt_vocab_size}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Seq2SeqConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**data)


class Memory(NamedTuple):
    """The encoded source, shared by every decoding step.

    values: [B, S, D] encoder outputs (zero at padding); keys: [B, S, A] projected once per batch;
    lengths: int64 [B] valid source positions.
    """

    values: Tensor
    keys: Tensor
    lengths: Tensor

    def index_select(self, index: Tensor) -> Memory:
        return Memory(*(t.index_select(0, index) for t in self))


def map_state(fn, state):
    """Apply ``fn`` to every tensor of a (nested) decoder state."""
    if isinstance(state, Tensor):
        return fn(state)
    return tuple(map_state(fn, s) for s in state)


def _rnn(cell: str, *args, **kwargs) -> nn.RNNBase:
    return (nn.GRU if cell == "gru" else nn.LSTM)(*args, **kwargs)


def _rnn_cell(cell: str, *args, **kwargs) -> nn.RNNCellBase:
    return (nn.GRUCell if cell == "gru" else nn.LSTMCell)(*args, **kwargs)


def _top_hidden(layer_state) -> Tensor:
    return layer_state if isinstance(layer_state, Tensor) else layer_state[0]


def _decoder_attention(config: Seq2SeqConfig, memory_size: int) -> BahdanauAttention:
    """The attention both decoders use: decoder state (query) against encoder states (memory)."""
    return BahdanauAttention(
        config.hidden_size,
        memory_size,
        config.attention_size or config.hidden_size,
        weight_norm=config.normalize_attention,
        backend=config.backend,
    )


def _add_output_layer(decoder: nn.Module, config: Seq2SeqConfig, features: int) -> None:
    """decoder.output: the vocabulary projection of ``features``-wide vectors; with
    output_layer "attentional" first decoder.attentional (W_a [hidden, features], no bias)."""
    if config.output_layer == "attentional":
        width = config.embed_size if config.tie_embeddings else config.hidden_size
        decoder.attentional = nn.Linear(features, width, bias=False)
        features = width
    decoder.output = nn.Linear(features, config.tgt_vocab_size)
    if config.tie_embeddings:
        if features != config.embed_size:
            raise ValueError(
                f"tie_embeddings needs the output projection's input ({features} wide with "
                f"output_layer {config.output_layer!r}) to be embed_size ({config.embed_size}) "
                "wide: use output_layer 'attentional'"
            )
        decoder.output.weight = decoder.embedding.weight


def _output_input(decoder: nn.Module, features: Tensor) -> Tensor:
    """What decoder.output reads: dropout(features), or dropout(tanh(W_a features))."""
    attentional = getattr(decoder, "attentional", None)
    if attentional is not None:
        features = torch.tanh(attentional(features))
    return decoder.dropout(features)


def reverse_within_lengths(lengths: Tensor, width: int) -> Tensor:
    """int64 [B, width]: the position that row b's position t comes from when each row is reversed
    within its length (length - 1 - t for t < length, t itself in the padding). An involution:
    gathering with it twice gives back the input."""
    positions = torch.arange(width, device=lengths.device)
    return torch.where(positions < lengths[:, None], lengths[:, None] - 1 - positions, positions)


def _gather_time(x: Tensor, index: Tensor) -> Tensor:
    """x [B, T, F], index [B, T] -> x[b, index[b, t]]."""
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def _rnn_direction(rnn: nn.RNNBase, layer: int, reverse: bool, x: Tensor) -> Tensor:
    """One layer, one direction of ``rnn`` (its own weights) over x [B, T, F] from zero state, left
    to right -> outputs [B, T, H]."""
    suffix = f"_l{layer}" + ("_reverse" if reverse else "")
    names = ("weight_ih", "weight_hh") + (("bias_ih", "bias_hh") if rnn.bias else ())
    weights = [getattr(rnn, name + suffix) for name in names]
    h0 = x.new_zeros(1, x.shape[0], rnn.hidden_size)
    if isinstance(rnn, nn.GRU):
        fused = fused_gru.gru_layer_or_none(x, h0[0], *weights)  # ops/recurrent.py decides
        if fused is not None:
            return fused[0]
        return torch.gru(x, h0, weights, rnn.bias, 1, 0.0, rnn.training, False, True)[0]
    return torch.lstm(x, (h0, h0), weights, rnn.bias, 1, 0.0, rnn.training, False, True)[0]


class Encoder(nn.Module):
    """Embedding and a (bi)directional multi-layer GRU/LSTM over variable-length batches.

    ``forward(src [B, S] int64, lengths [B]) -> (outputs [B, S, D] zero at padding, summary [B, D])``
    with D = hidden (x2 if bidirectional); summary = [last forward state; first backward state] of
    the top layer, read at each row's own length.

    Two ways to run the RNN that give the same results (tests/seq2seq/test_models.py checks outputs, final
    states and gradients): ``packed=True`` packs the batch (``pack_padded_sequence``);
    ``packed=False`` runs each layer and direction on the padded batch, the backward direction on
    rows reversed within their lengths (a gather), so padding never reaches a valid position. The
    default (``packed=None``) takes the padded path under ``torch.compile`` (traced without a graph
    break) and for CPU training (the packed backward zero-fills a [total tokens, 3H] gradient per
    time step), and packs otherwise: without autograd (decoding) packing skips the padding, and
    cuDNN runs packed batches natively on the module's flattened weights.
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(config.src_vocab_size, config.embed_size, padding_idx=PAD_ID)
        self.rnn = _rnn(
            config.cell,
            config.embed_size,
            config.hidden_size,
            num_layers=config.encoder_layers,
            batch_first=True,
            bidirectional=config.bidirectional,
            dropout=config.dropout if config.encoder_layers > 1 else 0.0,
        )
        self.dropout = nn.Dropout(config.dropout)
        self.hidden_size = config.hidden_size
        self.bidirectional = config.bidirectional
        self.output_size = config.hidden_size * (2 if config.bidirectional else 1)

    def run_rnn(
        self, x: Tensor, lengths: Tensor, *, packed: bool | None = None
    ) -> tuple[Tensor, Tensor]:
        """x [B, S, E], lengths int64 [B] (>= 1) -> (outputs [B, S, D] zero at padding, final
        hidden states [layers * directions, B, H] as nn.GRU/nn.LSTM order them)."""
        if packed is None:
            packed = fused_gru.prefer_packed(x)  # ops/recurrent.py decides
        if packed:
            sequence = pack_padded_sequence(
                x, lengths.cpu(), batch_first=True, enforce_sorted=False
            )
            out, final = self.rnn(sequence)
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
            return out, _top_hidden(final)
        rnn, width = self.rnn, x.shape[1]
        rows = torch.arange(x.shape[0], device=x.device)
        last = (lengths - 1).clamp(min=0)
        reverse = reverse_within_lengths(lengths, width) if self.bidirectional else None
        finals = []
        for layer in range(rnn.num_layers):
            if layer > 0 and rnn.dropout > 0:
                x = F.dropout(x, rnn.dropout, self.training)
            out = _rnn_direction(rnn, layer, False, x)
            finals.append(out[rows, last])
            if reverse is not None:
                out_reverse = _gather_time(
                    _rnn_direction(rnn, layer, True, _gather_time(x, reverse)), reverse
                )
                finals.append(out_reverse[:, 0])
                out = torch.cat([out, out_reverse], dim=-1)
            x = out
        valid = torch.arange(width, device=x.device)[None, :] < lengths[:, None]
        return x * valid.unsqueeze(-1).to(x.dtype), torch.stack(finals)

    def forward(
        self, src: Tensor, lengths: Tensor, *, packed: bool | None = None
    ) -> tuple[Tensor, Tensor]:
        # bf16 autocast: cast once for both directions' input products (precision.py)
        embedded = cast_once(self.dropout(self.embedding(src)))
        outputs, final = self.run_rnn(embedded, lengths, packed=packed)
        summary = torch.cat([final[-2], final[-1]], dim=-1) if self.bidirectional else final[-1]
        return self.dropout(outputs), summary


def _cell_update(cell_type: str, gates_in: Tensor, gates_hidden: Tensor, layer_state):
    """The GRUCell/LSTMCell update from the two gate projections (biases included):
    gates_in = W_ih x + b_ih, gates_hidden = W_hh h + b_hh, each [B, 3H] (GRU) or [B, 4H] (LSTM)."""
    # split (not slicing) so that each backward is one cat, not a zero-filled buffer per slice
    if cell_type == "gru":
        fused = fused_gru.gru_cell_or_none(gates_in, gates_hidden, layer_state)
        if fused is not None:  # one op each way (ops/recurrent.py decides where it serves)
            return fused
        hidden = layer_state.shape[-1]
        in_rz, in_n = gates_in.split([2 * hidden, hidden], dim=1)
        hidden_rz, hidden_n = gates_hidden.split([2 * hidden, hidden], dim=1)
        reset, update = torch.sigmoid(in_rz + hidden_rz).chunk(2, dim=1)
        new = torch.tanh(torch.addcmul(in_n, reset, hidden_n))
        return torch.lerp(new, layer_state, update)  # (1 - z) n + z h
    h, c = layer_state
    fused = fused_gru.lstm_cell_or_none(gates_in, gates_hidden, c)
    if fused is not None:
        return fused
    i, f, g, o = (gates_in + gates_hidden).chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


class _StepWeights(NamedTuple):
    """The Bahdanau decoder's weights arranged once per sequence (see BahdanauDecoder._weights)."""

    embedded_in: Tensor  # [G, E]: layer 0's W_ih on the embedding
    context_in: Tensor  # [G, D]: layer 0's W_ih on the context
    bias_in: Tensor | None  # [G]: layer 0's b_ih
    # The top layer's W_hh [G, H] and b_hh; with query None, W_q is stacked below them ([G + A, H],
    # bias padded with zeros) so that one product gives both the top cell's gates and the query.
    top: Tensor
    top_bias: Tensor | None
    query: Tensor | None  # [A, H]: the attention's W_q when not stacked
    score: tuple  # the attention's (v_eff, bias), computed once


class BahdanauDecoder(nn.Module):
    """The recurrence of Bahdanau et al. (2015), one target step at a time.

    At step t: c_t = attention(query = s_{t-1} (top layer), encoder states), the first cell consumes
    [emb(y_{t-1}); c_t], further layers consume the layer below, and logits = W [s_t; c_t].

    The cells are nn.GRUCell/nn.LSTMCell (parameters, state_dict), evaluated with the same math but
    arranged to do less per step: layer 0's input projection of the embeddings is one matrix
    product over all target steps, only the context part is projected per step; s_{t-1} is
    multiplied once by [W_hh (top layer); W_q] for both the top cell and the attention query; the
    attention's score vector is formed once per sequence; the output layer runs once on all steps.
    """

    def __init__(self, config: Seq2SeqConfig, memory_size: int) -> None:
        super().__init__()
        hidden, layers = config.hidden_size, config.decoder_layers
        self.cell_type = config.cell
        self.embed_size = config.embed_size
        self.embedding = nn.Embedding(config.tgt_vocab_size, config.embed_size, padding_idx=PAD_ID)
        self.attention = _decoder_attention(config, memory_size)
        self.cells = nn.ModuleList(
            [_rnn_cell(config.cell, config.embed_size + memory_size, hidden)]
            + [_rnn_cell(config.cell, hidden, hidden) for _ in range(layers - 1)]
        )
        self.dropout = nn.Dropout(config.dropout)
        _add_output_layer(self, config, hidden + memory_size)

    def _weights(self, stack_query: bool = True) -> _StepWeights:
        """The weights as the steps use them; ``stack_query`` stacks W_q below the top W_hh (a copy
        per call: worth it over a sequence, not for a single decoding step)."""
        first, top = self.cells[0], self.cells[-1]
        query_weight = self.attention.query_proj.weight
        top_weight, top_bias = top.weight_hh, top.bias_hh
        if stack_query:
            top_weight = torch.cat([top_weight, query_weight])
            if top_bias is not None:
                top_bias = torch.cat([top_bias, top_bias.new_zeros(query_weight.shape[0])])
        # Under bf16 autocast: cast once here, not at every step's use (precision.py).
        return _StepWeights(
            cast_once(first.weight_ih[:, : self.embed_size]),
            cast_once(first.weight_ih[:, self.embed_size :]),
            cast_once(first.bias_ih),
            cast_once(top_weight),
            cast_once(top_bias),
            None if stack_query else cast_once(query_weight),
            tuple(cast_once(t) for t in self.attention.score_vector()),
        )

    def _step(
        self,
        gates_embedded: Tensor,
        state: State,
        memory: Memory,
        weights: _StepWeights,
        stepwise: StepwiseMemory | None = None,
    ) -> tuple[Tensor, Tensor, State, Tensor]:
        """gates_embedded [B, G] (= W_ih emb(y_{t-1}) + b_ih of layer 0) -> (s_t [B, H], c_t [B, D],
        new state, attention weights [B, S])."""
        top_hidden = _top_hidden(state[-1])
        gates_top = F.linear(top_hidden, weights.top, weights.top_bias)
        if weights.query is None:  # W_q stacked below W_hh
            gates = weights.embedded_in.shape[0]
            gates_top, query = gates_top.split([gates, gates_top.shape[1] - gates], dim=1)
        else:
            query = F.linear(top_hidden, weights.query)
        context, attention_weights = self.attention.attend_projected(
            query,
            memory.keys,
            memory.values,
            lengths=memory.lengths,
            score_vector=weights.score,
            stepwise=stepwise,
        )
        gates_in = torch.addmm(gates_embedded, context, weights.context_in.t())
        new_state, x = [], context
        last = len(self.cells) - 1
        for i, (cell, layer_state) in enumerate(zip(self.cells, state, strict=True)):
            if i > 0:
                gates_in = F.linear(self.dropout(x), cell.weight_ih, cell.bias_ih)
            if i == last:
                gates_hidden = gates_top
            else:
                gates_hidden = F.linear(_top_hidden(layer_state), cell.weight_hh, cell.bias_hh)
            layer_state = _cell_update(self.cell_type, gates_in, gates_hidden, layer_state)
            new_state.append(layer_state)
            x = _top_hidden(layer_state)
        return x, context, tuple(new_state), attention_weights

    def _gates_embedded(self, embedded: Tensor, weights: _StepWeights) -> Tensor:
        return F.linear(embedded, weights.embedded_in, weights.bias_in)

    def forward(
        self, tgt_in: Tensor, state: State, memory: Memory, *, features_only: bool = False
    ) -> tuple[Tensor, Tensor, State]:
        """Teacher forcing: tgt_in [B, T] -> (logits [B, T, V], weights [B, T, S], final state);
        with ``features_only`` the output layer's input [B, T, F] in place of the logits."""
        weights = self._weights()
        # Training on CPU: the steps' key and value gradients are gathered once (stepwise.py).
        stepwise = StepwiseMemory.for_training(
            memory.keys, memory.values, getattr(self.attention, "backend", "reference")
        )
        if stepwise is not None:
            memory = memory._replace(keys=stepwise.keys, values=stepwise.values)
        # Time-major, so that each step reads a contiguous [B, G] slice.
        embedded = self.dropout(self.embedding(tgt_in.t()))
        # [T, B, G] in one product; unbind (not indexing) so the backward is one stack
        gates_embedded = self._gates_embedded(embedded, weights).unbind(0)
        outputs, contexts, all_weights = [], [], []
        for gates_t in gates_embedded:
            s_t, c_t, state, attention_weights = self._step(
                gates_t, state, memory, weights, stepwise
            )
            outputs.append(s_t)
            contexts.append(c_t)
            all_weights.append(attention_weights)
        features = torch.cat([torch.stack(outputs, 1), torch.stack(contexts, 1)], dim=-1)
        features = _output_input(self, features)
        logits = features if features_only else self.output(features)
        return logits, torch.stack(all_weights, 1), state

    def step(self, y_prev: Tensor, state: State, memory: Memory) -> tuple[Tensor, Tensor, State]:
        """One decoding step: y_prev [B] -> (logits [B, V], weights [B, S], state)."""
        weights = self._weights(stack_query=False)
        gates_embedded = self._gates_embedded(self.embedding(y_prev), weights)
        s_t, c_t, state, attention_weights = self._step(gates_embedded, state, memory, weights)
        logits = self.output(_output_input(self, torch.cat([s_t, c_t], dim=-1)))
        return logits, attention_weights, state


class GNMTDecoder(nn.Module):
    """GNMT's decoder layout: attention on the first layer's outputs, its context fed upwards.

    Layer 0 runs over the whole target; the attention for all T target steps is one call with
    query [B, T, H]; layers 1.. consume [h; c] (residual connections from the third layer on, as in
    GNMT), and logits = W h_top (W [h; c] with a single layer). Decoding step by step is the same
    code with T = 1.
    """

    def __init__(self, config: Seq2SeqConfig, memory_size: int) -> None:
        super().__init__()
        hidden, layers = config.hidden_size, config.decoder_layers
        self.embedding = nn.Embedding(config.tgt_vocab_size, config.embed_size, padding_idx=PAD_ID)
        self.attention = _decoder_attention(config, memory_size)
        self.rnns = nn.ModuleList(
            [_rnn(config.cell, config.embed_size, hidden, batch_first=True)]
            + [
                _rnn(config.cell, hidden + memory_size, hidden, batch_first=True)
                for _ in range(layers - 1)
            ]
        )
        self.dropout = nn.Dropout(config.dropout)
        # GNMT's classifier reads the top layer, which has consumed the context already; a single
        # layer has not, so it reads [h; c] like the bahdanau decoder.
        self.output_uses_context = layers == 1
        features = hidden + (memory_size if self.output_uses_context else 0)
        _add_output_layer(self, config, features)

    @staticmethod
    def _run_layer(rnn: nn.RNNBase, x: Tensor, layer_state):
        if isinstance(rnn, nn.GRU):
            names = ("weight_ih_l0", "weight_hh_l0") + (
                ("bias_ih_l0", "bias_hh_l0") if rnn.bias else ()
            )
            weights = [getattr(rnn, n) for n in names]
            fused = fused_gru.gru_layer_or_none(x, layer_state, *weights)  # ops/recurrent.py
            if fused is not None:
                return fused
        # nn.GRU/LSTM states are [1, B, H]; ours are [B, H].
        hx = map_state(lambda s: s.unsqueeze(0).contiguous(), layer_state)
        out, hx = rnn(x, hx)
        return out, map_state(lambda s: s.squeeze(0), hx)

    def forward(
        self, tgt_in: Tensor, state: State, memory: Memory, *, features_only: bool = False
    ) -> tuple[Tensor, Tensor, State]:
        """Teacher forcing: tgt_in [B, T] -> (logits [B, T, V], weights [B, T, S], final state);
        with ``features_only`` the output layer's input [B, T, F] in place of the logits."""
        x = self.dropout(self.embedding(tgt_in))
        h, first_state = self._run_layer(self.rnns[0], x, state[0])
        # One attention call for every target step: query [B, T, H].
        context, weights = self.attention(
            h, memory.values, lengths=memory.lengths, projected_keys=memory.keys
        )
        new_state = [first_state]
        for i, rnn in enumerate(self.rnns[1:], start=1):
            out, layer_state = self._run_layer(
                rnn, self.dropout(torch.cat([h, context], dim=-1)), state[i]
            )
            h = out + h if i >= 2 else out
            new_state.append(layer_state)
        features = torch.cat([h, context], dim=-1) if self.output_uses_context else h
        features = _output_input(self, features)
        logits = features if features_only else self.output(features)
        return logits, weights, tuple(new_state)

    def step(self, y_prev: Tensor, state: State, memory: Memory) -> tuple[Tensor, Tensor, State]:
        """One decoding step: y_prev [B] -> (logits [B, V], weights [B, S], state)."""
        logits, weights, state = self.forward(y_prev.unsqueeze(1), state, memory)
        return logits.squeeze(1), weights.squeeze(1), state


class Seq2Seq(nn.Module):
    """Encoder, a bridge giving the decoder's initial states, and a decoder.

    ``forward(src [B,S], src_lengths [B], tgt_in [B,T]) -> (logits [B,T,V], weights [B,T,S])``;
    given ``tgt_out`` [B,T] it returns (the mean token loss, 0-dim, weights) instead, the output
    layer and loss computed together by chunks (:func:`~seq2seq_fast.ops.linear_cross_entropy.
    linear_cross_entropy`: no [B,T,V] logits held). Through forward, so DDP sees the call.
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        decoder_cls = BahdanauDecoder if config.decoder == "bahdanau" else GNMTDecoder
        self.decoder = decoder_cls(config, self.encoder.output_size)
        if config.share_embeddings:  # one table for the encoder, decoder input (and output)
            self.decoder.embedding.weight = self.encoder.embedding.weight
            if config.tie_embeddings:
                self.decoder.output.weight = self.encoder.embedding.weight
        # s_0 = tanh(W summary), as the paper initialises from the backward encoder state.
        self.bridge = nn.Linear(
            self.encoder.output_size, config.hidden_size * config.decoder_layers
        )

    @property
    def attention(self) -> BahdanauAttention:
        return self.decoder.attention

    def encode(self, src: Tensor, src_lengths: Tensor) -> tuple[Memory, State]:
        """-> (Memory with keys projected once for the whole batch, initial decoder state)."""
        src_lengths = src_lengths.to(device=src.device, dtype=torch.int64)
        outputs, summary = self.encoder(src, src_lengths)
        memory = Memory(outputs, self.attention.project_keys(outputs), src_lengths)
        hidden = torch.tanh(self.bridge(summary)).chunk(self.config.decoder_layers, dim=-1)
        if self.config.cell == "gru":
            state = tuple(h.contiguous() for h in hidden)
        else:
            state = tuple((h.contiguous(), torch.zeros_like(h)) for h in hidden)
        return memory, state

    def forward(
        self,
        src: Tensor,
        src_lengths: Tensor,
        tgt_in: Tensor,
        tgt_out: Tensor | None = None,
        *,
        label_smoothing: float = 0.0,
    ) -> tuple[Tensor, Tensor]:
        memory, state = self.encode(src, src_lengths)
        if tgt_out is None:
            logits, weights, _ = self.decoder(tgt_in, state, memory)
            return logits, weights
        features, weights, _ = self.decoder(tgt_in, state, memory, features_only=True)
        output = self.decoder.output
        loss = linear_cross_entropy(
            features,
            output.weight,
            output.bias,
            tgt_out,
            label_smoothing=label_smoothing,
            ignore_index=PAD_ID,
        )
        return loss, weights


def compile_model(model: nn.Module, **options) -> Callable[..., Any]:
    """``torch.compile(model, **options)`` traced as one graph: the encoder's and the GNMT decoder's
    GRU/LSTM layers included (dynamo's ``allow_rnn``, set only while the compiled model runs), the
    fused attention op inside. Returns a callable with the model's call signature."""
    compiled = torch.compile(model, **options)

    def run(*args: Any, **kwargs: Any) -> Any:
        with dynamo_tracing(allow_rnn=True):
            return compiled(*args, **kwargs)

    return run


def sequence_loss(logits: Tensor, tgt_out: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean token cross-entropy over non-pad targets: logits [B,T,V], tgt_out [B,T]."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        tgt_out.reshape(-1),
        ignore_index=PAD_ID,
        label_smoothing=label_smoothing,
    )
