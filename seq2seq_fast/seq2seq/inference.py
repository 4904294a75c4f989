"""Decoding as deployed: a trained model prepared once for a precision, and ensembles of them.

    PRECISIONS              "fp32", "bf16", "int8"
    DecodingModel(model, precision)  the model's weights arranged once for decoding; ``encode``
                            and ``step_log_probs`` are what the searches (decoding.py) call
    Ensemble(models)        several DecodingModels of one vocabulary pair as one: at each step the
                            mean of their log-probabilities (and of their attention weights)
    quantize_int8(weight)   symmetric int8 per output row, and the rows' scales (export)

What each precision changes (the README says the same). In every precision the GNMT decoder's
first layer takes its input gates W_ih emb(y) + b_ih from a float32 table of every target word's,
made at load (no product per step), and a sentence's beam rows attend as the K queries of its one
memory (which is therefore neither copied per row nor reordered).

fp32   the weights as trained. On CPU the decoder step's products (the recurrent cell's input and
       hidden products, the attention's query projection, the attentional layer, the vocabulary
       projection) run through oneDNN with their weights packed once at load (PyTorch's default
       float32 product, MKL's sgemm, ran 1.8-2x slower at these shapes on the AMD CPUs measured;
       bench/RESULTS.md); the encoder, the key projection and the bridge run once per batch as
       trained.
bf16   every weight cast to bfloat16 once at load; the products in bfloat16 (oneDNN, weights
       packed on CPU), the attention and the recurrent cells through the fused kernels with
       bfloat16 inputs and float32 arithmetic inside; the decoder's recurrent state, the
       log-softmax and the search in float32. Needs AVX512-BF16 or AMX on CPU (else fp32, with
       a notice).
int8   dynamic int8 quantisation (``torch.ao.nn.quantized.dynamic.Linear``: fbgemm/oneDNN int8
       kernels, weights int8 per output row, activations quantised at each call) of the
       vocabulary projection, the attentional layer, the attention's query projection and the
       decoder cells' products (input products from the second layer on, hidden products); the encoder, the key projection and the
       attention op itself in float32. On CUDA (no int8 kernels in PyTorch for this) the weights
       are kept int8 and expanded to float32 at each use.

Every precision gives the searches float32 log-probabilities; a DecodingModel never changes the
model it was made from (its weights are copies).
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq_fast.ops import _torch_private
from seq2seq_fast.ops.additive_attention import additive_attention
from seq2seq_fast.seq2seq.models import (
    GNMTDecoder,
    Memory,
    Seq2Seq,
    _cell_update,
    _gather_time,
    _top_hidden,
    reverse_within_lengths,
)

PRECISIONS = ("fp32", "bf16", "int8")
# The layers --precision int8 quantises (the GNMT decoder's; the Bahdanau decoder's output layers).
INT8_LAYERS = ("output", "attentional", "query", "recurrent")
# Rows the packed oneDNN weights are laid out for (a hint only: any row count works): a batch's
# decoder rows by default (translate.ROWS_PER_BATCH).
_PACK_ROWS = 320


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


@functools.cache
def _cpu_flags() -> frozenset[str] | None:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def bf16_unavailable_reason(device: torch.device | str) -> str | None:
    """None when bfloat16 products run natively on ``device``, else why not (one line)."""
    device = torch.device(device)
    if device.type == "cuda":
        return None if torch.cuda.is_bf16_supported() else "this GPU has no bfloat16 support"
    if device.type != "cpu":
        return f"bf16 decoding serves CPU and CUDA devices, not {device.type}"
    flags = _cpu_flags()
    if flags is None:
        return "the CPU's features could not be read (/proc/cpuinfo) to find AVX512-BF16 or AMX"
    if not flags & {"avx512_bf16", "amx_bf16"}:
        return "this CPU has neither AVX512-BF16 nor AMX"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch was built without oneDNN"
    return None


def _packs_on(device: torch.device) -> bool:
    """Whether linear weights are packed for oneDNN's products (CPU, oneDNN present)."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and _torch_private.mkldnn_linear_available()
    )


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] -> (int8 [N, K], float32 scales [N]): symmetric per output row, each row's
    largest magnitude mapped to 127 (an all-zero row gets scale 1)."""
    weight = weight.detach().float()
    amax = weight.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class PreparedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` in one precision's form, arranged once: float32 or bfloat16
    (on CPU packed for oneDNN), or int8 (CPU: PyTorch's dynamic quantized Linear; elsewhere int8
    storage expanded at each call). Returns float32 for float32 and int8, bfloat16 for bf16."""

    def __init__(
        self, weight: Tensor, bias: Tensor | None, precision: str, *, portable: bool = False
    ) -> None:
        super().__init__()
        device = weight.device
        self.precision = check_precision(precision)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # portable: the plain products a GPU runs (tests take this path on CPU tensors)
        self.packed = precision != "int8" and not portable and _packs_on(device)
        self.quantized = None
        if precision == "int8":
            q, scale = quantize_int8(weight)
            self.bias = None if bias is None else bias.detach().float().clone()
            if device.type == "cpu" and not portable:
                self.quantized = _dynamic_int8_linear(q, scale, self.bias)
            else:
                self.weight, self.scale = q, scale
            self.dtype = torch.float32
            return
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        weight = weight.detach().to(self.dtype).contiguous()
        self.bias = None if bias is None else bias.detach().to(self.dtype).clone()
        if self.packed:
            weight = _torch_private.mkldnn_pack_linear_weight(weight, _PACK_ROWS)
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        if self.quantized is not None:
            return self.quantized(x.float())
        if self.precision == "int8":  # int8 storage off the CPU: expanded at each use
            weight = self.weight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
            return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))
        x = x.to(self.dtype)
        if self.packed:
            return _torch_private.mkldnn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"precision={self.precision}, packed={self.packed}"
        )


def _dynamic_int8_linear(q: Tensor, scale: Tensor, bias: Tensor | None) -> nn.Module:
    """PyTorch's dynamic int8 Linear (fbgemm/oneDNN kernels) holding these int8 rows and scales."""
    from torch.ao.nn.quantized import dynamic as nnqd

    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices
        warnings.simplefilter("ignore")
        qweight = _torch_private.per_channel_qint8(q, scale)
        module = nnqd.Linear(q.shape[1], q.shape[0], dtype=torch.qint8)
        module.set_weight_bias(qweight, bias)
    return module


# A first recurrent layer's input gates of every word, W_ih emb(y) + b_ih, are kept as a
# [V, gates] float32 table (one product at load, a row lookup per use) up to this many bytes.
GATE_TABLE_BYTES = 64 << 20


class _Cell(nn.Module):
    """One recurrent layer (one direction), one step: its two products prepared, the update
    through the fused cell ops (models._cell_update). The state stays float32. Given the
    ``embedding`` that feeds it (a first layer), its input gates come from a table of every
    word's, and ``gates_in`` takes the word ids."""

    def __init__(
        self,
        rnn: nn.RNNBase,
        product: str,
        portable: bool,
        embedding: nn.Embedding | None = None,
        suffix: str = "_l0",
    ) -> None:
        super().__init__()
        self.cell_type = "gru" if isinstance(rnn, nn.GRU) else "lstm"
        weight_ih, weight_hh = (
            getattr(rnn, "weight_ih" + suffix),
            getattr(rnn, "weight_hh" + suffix),
        )
        bias_ih = getattr(rnn, "bias_ih" + suffix) if rnn.bias else None
        bias_hh = getattr(rnn, "bias_hh" + suffix) if rnn.bias else None
        self.table = self.ih = self.embedding = None
        gates = weight_ih.shape[0]
        if embedding is not None and embedding.num_embeddings * gates * 4 <= GATE_TABLE_BYTES:
            with torch.no_grad():  # float32, through oneDNN on CPU (the product MKL is slow at)
                gates_of = PreparedLinear(weight_ih.float(), bias_ih, "fp32", portable=portable)
                self.table = gates_of(embedding.weight.float())
        else:
            self.embedding = embedding
            self.ih = PreparedLinear(weight_ih, bias_ih, product, portable=portable)
        self.hh = PreparedLinear(weight_hh, bias_hh, product, portable=portable)

    def gates_in(self, x: Tensor) -> Tensor:
        """x: the layer's input [..., F], or for a first layer the word ids [...] -> float32
        input gates [..., G]."""
        if self.table is not None:
            return F.embedding(x, self.table)
        if self.embedding is not None:
            x = self.embedding(x)
        return self.ih(x).float()

    def update(self, gates_in: Tensor, state):
        gates_hidden = self.hh(_top_hidden(state)).float()
        return _cell_update(self.cell_type, gates_in, gates_hidden, state)

    def forward(self, x: Tensor, state):
        return self.update(self.gates_in(x), state)


class _EncoderRNN(nn.Module):
    """The encoder's (bi)directional GRU/LSTM layers step by step on the padded batch through
    prepared products (the first layer's input gates from per-word tables), as
    ``Encoder.run_rnn(packed=False)`` computes them: the backward direction on rows reversed
    within their lengths, outputs zero at padding. -> (outputs float32 [B, S, D], summary
    float32 [B, D])."""

    def __init__(self, encoder, product: str, portable: bool) -> None:
        super().__init__()
        rnn = encoder.rnn
        self.layers, self.bidirectional = rnn.num_layers, encoder.bidirectional
        self.hidden_size, self.lstm = rnn.hidden_size, isinstance(rnn, nn.LSTM)
        directions = ("", "_reverse") if self.bidirectional else ("",)
        self.cells = nn.ModuleList(
            _Cell(
                rnn, product, portable, encoder.embedding if layer == 0 else None, f"_l{layer}" + d
            )
            for layer in range(self.layers)
            for d in directions
        )

    def forward(self, src: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        batch, width = src.shape
        rows = torch.arange(batch, device=src.device)
        last = (lengths - 1).clamp(min=0)
        reverse = reverse_within_lengths(lengths, width) if self.bidirectional else None
        zeros = torch.zeros(batch, self.hidden_size, device=src.device)
        x, finals, per_layer = src, [], 2 if self.bidirectional else 1
        for layer in range(self.layers):
            outs = []
            for direction in range(per_layer):
                cell = self.cells[layer * per_layer + direction]
                if direction == 0:
                    inputs = x
                elif layer == 0:
                    inputs = x.gather(1, reverse)
                else:
                    inputs = _gather_time(x, reverse)
                gates = cell.gates_in(inputs)  # [B, S, G]: every step's input product at once
                state = (zeros, zeros) if self.lstm else zeros
                steps = []
                for t in range(width):
                    state = cell.update(gates[:, t], state)
                    steps.append(_top_hidden(state))
                out = torch.stack(steps, 1)
                if direction == 0:
                    finals.append(out[rows, last])
                else:
                    out = _gather_time(out, reverse)
                    finals.append(out[:, 0])
                outs.append(out)
            x = torch.cat(outs, -1) if per_layer == 2 else outs[0]
        valid = torch.arange(width, device=src.device)[None, :] < lengths[:, None]
        summary = torch.cat(finals[-2:], -1) if self.bidirectional else finals[-1]
        return x * valid.unsqueeze(-1).to(x.dtype), summary


class DecodingModel(nn.Module):
    """A :class:`Seq2Seq` arranged once for decoding at ``precision``: -> ``encode(src,
    src_lengths)`` (Memory, initial state) and ``step_log_probs(y, state, memory)`` (float32
    log-probabilities [R, V], float32 attention weights [R, S], state). ``notices``: what could
    not be done as asked (e.g. bf16 on a CPU without bf16 products), one line each.
    ``portable``: the products as a GPU runs them (plain F.linear, int8 weights expanded at each
    use), whatever the device: the tests run the GPU path's code on CPU tensors.

    The GNMT decoder (the default) steps through prepared products (see the module docstring);
    the Bahdanau decoder steps through its own code with its output layers prepared."""

    def __init__(
        self,
        model: Seq2Seq,
        precision: str = "fp32",
        *,
        int8_layers=INT8_LAYERS,
        portable: bool = False,
    ) -> None:
        super().__init__()
        check_precision(precision)
        unknown = set(int8_layers) - set(INT8_LAYERS)
        if unknown:
            raise ValueError(f"int8_layers must be among {INT8_LAYERS}, got {sorted(unknown)}")
        device = next(model.parameters()).device
        self.notices: list[str] = []
        if precision == "bf16" and not portable:
            reason = bf16_unavailable_reason(device)
            if reason is not None:
                self.notices.append(f"--precision bf16: {reason}; decoding in fp32")
                precision = "fp32"
        if precision == "int8" and device.type != "cpu" and not portable:
            self.notices.append(
                f"--precision int8 on {device.type}: weights stored int8, products in float32 "
                "(PyTorch's int8 kernels are CPU-only)"
            )
        self.precision = precision
        self.config = model.config
        # A copy, in the precision's dtype: the prepared model never changes the one it came from.
        base = copy.deepcopy(model).eval()
        if precision == "bf16":
            base = base.to(torch.bfloat16)
        self.base = base
        decoder = base.decoder
        self.encoder_dtype = next(base.parameters()).dtype
        # the encoder's products in the precision's float form (int8 decodes with a float32
        # encoder): run once per batch, they are not where int8 pays
        self.encoder_rnn = _EncoderRNN(
            base.encoder, "fp32" if precision == "int8" else precision, portable
        )

        def kind(layer: str) -> str:  # int8 for the layers asked, fp32 for the others
            return "fp32" if precision == "int8" and layer not in int8_layers else precision

        # The output layers: prepared for either decoder (modules called as modules).
        decoder.output = PreparedLinear(
            decoder.output.weight, decoder.output.bias, kind("output"), portable=portable
        )
        if getattr(decoder, "attentional", None) is not None:
            decoder.attentional = PreparedLinear(
                decoder.attentional.weight, None, kind("attentional"), portable=portable
            )
        self.gnmt = isinstance(decoder, GNMTDecoder)
        if self.gnmt:
            attention = decoder.attention
            self.query = PreparedLinear(
                attention.query_proj.weight, None, kind("query"), portable=portable
            )
            self.cells = nn.ModuleList(
                _Cell(rnn, kind("recurrent"), portable, decoder.embedding if i == 0 else None)
                for i, rnn in enumerate(decoder.rnns)
            )
            with torch.no_grad():
                v, bias = attention.score_vector()
                self.v = v.detach().clone()
                self.score_bias = None if bias is None else bias.detach().clone()
        self.eval()

    @property
    def backend(self) -> str:
        return self.base.attention.backend

    def encode(self, src: Tensor, src_lengths: Tensor):
        """-> (Memory, initial decoder state: float32 for the GNMT steps), as Seq2Seq.encode
        with the encoder's layers through prepared products (_EncoderRNN)."""
        base, dtype = self.base, self.encoder_dtype
        lengths = src_lengths.to(device=src.device, dtype=torch.int64)
        outputs, summary = self.encoder_rnn(src, lengths)
        outputs = outputs.to(dtype)
        memory = Memory(outputs, base.attention.project_keys(outputs), lengths)
        layers = base.config.decoder_layers
        hidden = torch.tanh(base.bridge(summary.to(dtype))).chunk(layers, dim=-1)
        if not self.gnmt:
            hidden = [h.contiguous() for h in hidden]
        else:
            hidden = [h.float().contiguous() for h in hidden]
        if base.config.cell == "gru":
            return memory, tuple(hidden)
        return memory, tuple((h, torch.zeros_like(h)) for h in hidden)

    def step_log_probs(self, y: Tensor, state, memory: Memory):
        """One decoding step: y [R] -> (log-probabilities float32 [R, V], attention weights
        float32 [R, S], new state)."""
        logits, weights, state = self.step_logits(y, state, memory)
        return logits.log_softmax(-1), weights, state

    def step_logits(self, y: Tensor, state, memory: Memory):
        """One decoding step: y [R] -> (logits float32 [R, V], attention weights float32
        [R, S], new state)."""
        if not self.gnmt:
            logits, weights, state = self.base.decoder.step(y, state, memory)
            return logits.float(), weights.float(), state
        decoder = self.base.decoder
        layer_state = self.cells[0](y, state[0])  # the embedding's gates: a table lookup
        h = _top_hidden(layer_state)
        context, weights = self._attend(h, memory)
        new_state = [layer_state]
        for i, cell in enumerate(self.cells[1:], start=1):
            layer_state = cell(torch.cat([h, context], dim=-1), state[i])
            out = _top_hidden(layer_state)
            h = out + h if i >= 2 else out
            new_state.append(layer_state)
        features = torch.cat([h, context], dim=-1) if decoder.output_uses_context else h
        attentional = getattr(decoder, "attentional", None)
        if attentional is not None:
            features = torch.tanh(attentional(features))
        logits = decoder.output(features)
        return logits.float(), weights.float(), tuple(new_state)

    @property
    def groups_rows(self) -> bool:
        """Whether the steps take a memory of one row per sentence for R = sentences x K rows
        (the K rows of a sentence attend as K queries of its memory): the GNMT steps do."""
        return self.gnmt

    def _attend(self, h: Tensor, memory: Memory) -> tuple[Tensor, Tensor]:
        """The attention of the GNMT step: query projection and the fused op -> (context
        float32 [R, D], weights [R, S]). ``memory`` has R rows, or one per sentence for K
        consecutive rows each (beam search): then the K rows are K queries of one call."""
        query = self.query(h)
        sentences = memory.keys.shape[0]
        rows = query.shape[0]
        if rows % sentences:
            raise ValueError(
                f"{rows} decoder rows for a memory of {sentences} sentences: need a multiple"
            )
        if rows != sentences:
            query = query.view(sentences, rows // sentences, query.shape[-1])
        context, weights = additive_attention(
            query,
            memory.keys,
            memory.values,
            self.v,
            self.score_bias,
            lengths=memory.lengths,
            backend=self.backend,
        )
        return context.float().reshape(rows, -1), weights.reshape(rows, -1)


class EnsembleMemory:
    """The encoded source of each model of an :class:`Ensemble` (lengths shared)."""

    def __init__(self, memories: tuple) -> None:
        self.memories = memories

    @property
    def lengths(self) -> Tensor:
        return self.memories[0].lengths

    def index_select(self, index: Tensor) -> EnsembleMemory:
        return EnsembleMemory(tuple(m.index_select(index) for m in self.memories))


class Ensemble(nn.Module):
    """Several models of one vocabulary pair decoding as one: each step's log-probabilities are
    the mean of the models' (and the attention weights the mean of theirs); each model keeps its
    own encoded source and state. The models may differ in shape."""

    def __init__(self, models) -> None:
        super().__init__()
        models = list(models)
        if not models:
            raise ValueError("an ensemble needs at least one model")
        vocab = {m.config.tgt_vocab_size for m in models}
        if len(vocab) > 1:
            raise ValueError(f"ensemble models have different target vocabulary sizes {vocab}")
        self.members = nn.ModuleList(models)
        # the searches keep one memory row per sentence only if every member takes that
        self.groups_rows = all(getattr(m, "groups_rows", False) for m in models)
        self.notices = [n for m in models for n in getattr(m, "notices", [])]

    def encode(self, src: Tensor, src_lengths: Tensor):
        encoded = [m.encode(src, src_lengths) for m in self.members]
        return EnsembleMemory(tuple(e[0] for e in encoded)), tuple(e[1] for e in encoded)

    def step_log_probs(self, y: Tensor, state, memory: EnsembleMemory):
        total = weights = None
        states = []
        for member, member_state, member_memory in zip(
            self.members, state, memory.memories, strict=True
        ):
            logp, w, s = member.step_log_probs(y, member_state, member_memory)
            total = logp if total is None else total + logp
            weights = w if weights is None else weights + w
            states.append(s)
        count = len(self.members)
        return total / count, weights / count, tuple(states)
