"""Plain-PyTorch attention modules in the layouts that fuse_attention recognises (written for the tests).

TutorialAttention follows the PyTorch seq2seq translation tutorial's layout and call convention;
GNMTAttention follows NVIDIA's PyTorch GNMT attention (batch_first or time-major, set_mask).
The NLP families below, each written from its project's published math and call convention:

- ``ConcatAttention``: bentrevett/pytorch-seq2seq notebooks 3 and 4 (``Attention``: time-major
  encoder outputs, decoder state [B, Dq], optional mask with 0 = padding filled with -1e10,
  returns the weights [B, S]); ``batch_first=True`` gives the batch-first copies.
- ``ChatbotAttn``: the PyTorch chatbot tutorial's ``Attn`` ("dot", "general", "concat").
- ``GlobalAttention``: OpenNMT-py's (attn_type "dot", "general", "mlp"; softmax; coverage),
  batch-major returns with ``src_len``, or (``old_release=True``) time-major returns with
  ``memory_lengths``.
- ``BahdanauAttention``: JoeyNMT's (key/query/energy layers, compute_proj_keys, mask [B, 1, S]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TutorialAttention(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.Wa = nn.Linear(hidden_size, hidden_size)
        self.Ua = nn.Linear(hidden_size, hidden_size)
        self.Va = nn.Linear(hidden_size, 1)

    def forward(self, query, keys):
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys)))  # [B, S, 1]
        scores = scores.squeeze(2).unsqueeze(1)  # [B, 1, S]
        weights = F.softmax(scores, dim=-1)
        context = torch.bmm(weights, keys)
        return context, weights


class TutorialDecoder(nn.Module):
    """A GRU decoder step that uses TutorialAttention, as the tutorial's AttnDecoderRNN does."""

    def __init__(self, hidden_size: int, vocab: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden_size)
        self.attention = TutorialAttention(hidden_size)
        self.gru = nn.GRU(2 * hidden_size, hidden_size, batch_first=True)
        self.out = nn.Linear(hidden_size, vocab)

    def forward(self, tokens, hidden, encoder_outputs):
        embedded = self.embedding(tokens)  # [B, 1, H]
        query = hidden.permute(1, 0, 2)
        context, weights = self.attention(query, encoder_outputs)
        output, hidden = self.gru(torch.cat((embedded, context), dim=2), hidden)
        return self.out(output), hidden, weights


class GNMTAttention(nn.Module):
    def __init__(self, query_size, key_size, num_units, normalize=False, batch_first=False):
        super().__init__()
        self.normalize = normalize
        self.batch_first = batch_first
        self.num_units = num_units
        self.linear_q = nn.Linear(query_size, num_units, bias=False)
        self.linear_k = nn.Linear(key_size, num_units, bias=False)
        self.linear_att = nn.Parameter(torch.empty(num_units).uniform_(-0.1, 0.1))
        self.mask = None
        if normalize:
            self.normalize_scalar = nn.Parameter(torch.tensor([1.0 / num_units**0.5]))
            self.normalize_bias = nn.Parameter(torch.empty(num_units).uniform_(-0.1, 0.1))
        else:
            self.register_parameter("normalize_scalar", None)
            self.register_parameter("normalize_bias", None)

    def set_mask(self, context_len, context):
        max_len = context.size(1) if self.batch_first else context.size(0)
        indices = torch.arange(0, max_len, dtype=torch.int64, device=context.device)
        self.mask = indices >= context_len.unsqueeze(1)

    def calc_score(self, att_query, att_keys):
        b, t_k, n = att_keys.size()
        t_q = att_query.size(1)
        sum_qk = att_query.unsqueeze(2).expand(b, t_q, t_k, n) + att_keys.unsqueeze(1).expand(
            b, t_q, t_k, n
        )
        if self.normalize:
            sum_qk = sum_qk + self.normalize_bias
            linear_att = self.linear_att / self.linear_att.norm() * self.normalize_scalar
        else:
            linear_att = self.linear_att
        return torch.tanh(sum_qk).matmul(linear_att)

    def forward(self, query, keys):
        if not self.batch_first:
            keys = keys.transpose(0, 1)
            if query.dim() == 3:
                query = query.transpose(0, 1)
        single_query = query.dim() == 2
        if single_query:
            query = query.unsqueeze(1)
        b, t_k, t_q = query.size(0), keys.size(1), query.size(1)
        scores = self.calc_score(self.linear_q(query), self.linear_k(keys))
        if self.mask is not None:
            scores = scores.masked_fill(self.mask.unsqueeze(1).expand(b, t_q, t_k), -65504.0)
        weights = F.softmax(scores, dim=-1)
        context = torch.bmm(weights, keys)
        if single_query:
            context, weights = context.squeeze(1), weights.squeeze(1)
        elif not self.batch_first:
            context, weights = context.transpose(0, 1), weights.transpose(0, 1)
        return context, weights


class GNMTDecoderLayer(nn.Module):
    """An LSTM layer followed by GNMT attention over the encoder outputs (time-major)."""

    def __init__(self, hidden_size: int, normalize: bool, batch_first: bool) -> None:
        super().__init__()
        self.rnn = nn.LSTM(hidden_size, hidden_size, batch_first=batch_first)
        self.attn = GNMTAttention(hidden_size, hidden_size, hidden_size, normalize, batch_first)

    def forward(self, inputs, context, context_len):
        self.attn.set_mask(context_len, context)
        output, _ = self.rnn(inputs)
        attn_context, weights = self.attn(output, context)
        return output + attn_context, weights


# --- NLP families ----------------------------------------------------------------------------------


class ConcatAttention(nn.Module):
    def __init__(self, enc_hid_dim, dec_hid_dim, batch_first=False, vector_score=False):
        super().__init__()
        self.batch_first = batch_first
        self.attn = nn.Linear(enc_hid_dim * 2 + dec_hid_dim, dec_hid_dim)
        if vector_score:
            self.v = nn.Parameter(torch.rand(dec_hid_dim))
        else:
            self.v = nn.Linear(dec_hid_dim, 1, bias=False)

    def forward(self, hidden, encoder_outputs, mask=None):
        if not self.batch_first:
            encoder_outputs = encoder_outputs.permute(1, 0, 2)
        src_len = encoder_outputs.shape[1]
        hidden = hidden.unsqueeze(1).repeat(1, src_len, 1)
        energy = torch.tanh(self.attn(torch.cat((hidden, encoder_outputs), dim=2)))
        if isinstance(self.v, nn.Parameter):
            attention = (energy * self.v).sum(dim=2)
        else:
            attention = self.v(energy).squeeze(2)
        if mask is not None:
            attention = attention.masked_fill(mask == 0, -1e10)
        return F.softmax(attention, dim=1)


class ChatbotAttn(nn.Module):
    def __init__(self, method, hidden_size):
        super().__init__()
        self.method = method
        self.hidden_size = hidden_size
        if method == "general":
            self.attn = nn.Linear(hidden_size, hidden_size)
        elif method == "concat":
            self.attn = nn.Linear(hidden_size * 2, hidden_size)
            self.v = nn.Parameter(torch.empty(hidden_size).uniform_(-0.1, 0.1))

    def forward(self, hidden, encoder_outputs):  # hidden [1, B, H], encoder_outputs [S, B, H]
        if self.method == "dot":
            energies = torch.sum(hidden * encoder_outputs, dim=2)
        elif self.method == "general":
            energies = torch.sum(hidden * self.attn(encoder_outputs), dim=2)
        else:
            expanded = hidden.expand(encoder_outputs.size(0), -1, -1)
            energy = self.attn(torch.cat((expanded, encoder_outputs), 2)).tanh()
            energies = torch.sum(self.v * energy, dim=2)
        return F.softmax(energies.t(), dim=1).unsqueeze(1)


class GlobalAttention(nn.Module):
    def __init__(
        self, dim, coverage=False, attn_type="dot", attn_func="softmax", old_release=False
    ):
        super().__init__()
        self.dim, self.attn_type, self.attn_func = dim, attn_type, attn_func
        self.old_release = old_release
        if attn_type == "general":
            self.linear_in = nn.Linear(dim, dim, bias=False)
        elif attn_type == "mlp":
            self.linear_context = nn.Linear(dim, dim, bias=False)
            self.linear_query = nn.Linear(dim, dim, bias=True)
            self.v = nn.Linear(dim, 1, bias=False)
        self.linear_out = nn.Linear(dim * 2, dim, bias=attn_type == "mlp")
        if coverage:
            self.linear_cover = nn.Linear(1, dim, bias=False)

    def score(self, h_t, h_s):
        if self.attn_type != "mlp":
            if self.attn_type == "general":
                h_t = self.linear_in(h_t)
            return torch.bmm(h_t, h_s.transpose(1, 2))
        wq = self.linear_query(h_t).unsqueeze(2)  # [B, Tt, 1, dim]
        uh = self.linear_context(h_s).unsqueeze(1)  # [B, 1, S, dim]
        return self.v(torch.tanh(wq + uh)).squeeze(3)

    def forward(self, source, memory_bank, src_len=None, coverage=None):
        one_step = source.dim() == 2
        if one_step:
            source = source.unsqueeze(1)
        if coverage is not None:
            cover = self.linear_cover(coverage.unsqueeze(2))
            memory_bank = torch.tanh(memory_bank + cover)
        align = self.score(source, memory_bank)
        if src_len is not None:
            positions = torch.arange(align.size(-1), device=align.device)
            valid = (positions.unsqueeze(0) < src_len.unsqueeze(1)).unsqueeze(1)
            align = align.masked_fill(~valid, -float("inf"))
        if self.attn_func != "softmax":
            raise NotImplementedError("sparsemax is not re-created here")
        align_vectors = F.softmax(align, -1)
        c = torch.bmm(align_vectors, memory_bank)
        attn_h = self.linear_out(torch.cat([c, source], 2))
        if self.attn_type in ("general", "dot"):
            attn_h = torch.tanh(attn_h)
        if one_step:
            return attn_h.squeeze(1), align_vectors.squeeze(1)
        if self.old_release:
            return attn_h.transpose(0, 1).contiguous(), align_vectors.transpose(0, 1).contiguous()
        return attn_h, align_vectors


class BahdanauAttention(nn.Module):
    """JoeyNMT's."""

    def __init__(self, hidden_size=1, key_size=1, query_size=1):
        super().__init__()
        self.key_layer = nn.Linear(key_size, hidden_size, bias=False)
        self.query_layer = nn.Linear(query_size, hidden_size, bias=False)
        self.energy_layer = nn.Linear(hidden_size, 1, bias=False)
        self.proj_keys = None
        self.proj_query = None

    def forward(self, query, mask, values):
        assert mask is not None and self.proj_keys is not None
        self.compute_proj_query(query)
        scores = self.energy_layer(torch.tanh(self.proj_query + self.proj_keys))
        scores = scores.squeeze(2).unsqueeze(1)
        scores = torch.where(mask > 0, scores, scores.new_full([1], -float("inf")))
        alphas = F.softmax(scores, dim=-1)
        return alphas @ values, alphas

    def compute_proj_keys(self, keys):
        self.proj_keys = self.key_layer(keys)

    def compute_proj_query(self, query):
        self.proj_query = self.query_layer(query)
