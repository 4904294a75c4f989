"""Plain-PyTorch attention modules in the layouts that fuse_attention recognises (written for the tests).

TutorialAttention follows the PyTorch seq2seq translation tutorial's layout and call convention;
GNMTAttention follows NVIDIA's PyTorch GNMT attention (batch_first or time-major, set_mask).
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
