"""Plain-PyTorch re-creations of the additive attentions of speech and NLP toolkits (for the tests).

Each class is written from the project's published math and call convention, with the same child
and parameter names (so state_dicts match) and the same state, masks and return values:

- ``AttAdd``, ``AttLoc``: ESPnet (espnet/nets/pytorch_backend/rnn/attentions.py). Batch-first,
  ``forward(enc_hs_pad, enc_hs_len, dec_z, att_prev, scaling=2.0)`` -> (context [B, D_enc],
  weights [B, T]); the projected memory and the padding mask are cached until ``reset()``.
- ``ContentBasedAttention``, ``LocationAwareAttention``: SpeechBrain
  (speechbrain/nnet/attention.py).
  ``forward(enc_states, enc_len, dec_states)`` -> (mlp_out(context) [B, out], weights [B, T]); the
  location-aware one keeps the previous weights (detached) in ``prev_attn``.
- ``MLPAttention``: fairseq's speech-to-text Berard model (time-major source, re-projected at
  every call); ``LocationAttention``: fairseq/modules/location_attention.py (batch-first, cache
  cleared by ``clear_cache()``).
- ``NvidiaTacotron2Attention``: NVIDIA tacotron2 and DeepLearningExamples' Tacotron2 (Linear and
  Conv1d wrapped in ``LinearNorm.linear_layer`` / ``ConvNorm.conv``);
  ``TorchaudioTacotron2Attention``:
  torchaudio's ``_Attention`` (plain Linear / Conv1d). Same math: the client passes the processed
  memory, the weights' location features come from [previous, cumulative] weights.
- ``AllenNLPAdditiveAttention``: allennlp.modules.attention.AdditiveAttention (returns weights
  only; AllenNLP's masked_softmax renormalises with a 1e-13 guard).
- ``D2LAdditiveAttention`` (LazyLinear, d2l-en) and ``D2LAdditiveAttentionSized`` (older d2l,
  sized Linear): dropout on the weights, masked scores filled with -1e6.
- ``CoquiOriginalAttention``: Coqui TTS ``OriginalAttention`` (softmax or sigmoid normalisation,
  optional location layer; windowing and forward attention are not re-created here);
  ``CoquiOriginalAttentionInPlace`` the same in the original's call conventions (a padding fill
  in place through ``.data``, helper methods).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# --- ESPnet ---------------------------------------------------------------------------------------


def espnet_pad_mask(lengths) -> Tensor:
    """Bool [B, max(lengths)], True at padded positions (ESPnet's make_pad_mask for 1-D lengths)."""
    lengths = torch.as_tensor(lengths).long()
    positions = torch.arange(int(lengths.max()), device=lengths.device)
    return positions.unsqueeze(0) >= lengths.unsqueeze(1)


class AttAdd(nn.Module):
    def __init__(self, eprojs, dunits, att_dim, han_mode=False):
        super().__init__()
        self.mlp_enc = nn.Linear(eprojs, att_dim)
        self.mlp_dec = nn.Linear(dunits, att_dim, bias=False)
        self.gvec = nn.Linear(att_dim, 1)
        self.dunits, self.eprojs, self.att_dim = dunits, eprojs, att_dim
        self.han_mode = han_mode
        self.reset()

    def reset(self):
        self.h_length = None
        self.enc_h = None
        self.pre_compute_enc_h = None
        self.mask = None

    def _memory(self, enc_hs_pad):
        if self.pre_compute_enc_h is None or self.han_mode:
            self.enc_h = enc_hs_pad
            self.h_length = enc_hs_pad.size(1)
            self.pre_compute_enc_h = self.mlp_enc(enc_hs_pad)

    def _query(self, enc_hs_pad, dec_z):
        batch = len(enc_hs_pad)
        if dec_z is None:
            dec_z = enc_hs_pad.new_zeros(batch, self.dunits)
        return self.mlp_dec(dec_z.view(batch, self.dunits)).view(batch, 1, self.att_dim)

    def _normalise(self, e, enc_hs_len, scaling):
        if self.mask is None:
            self.mask = espnet_pad_mask(enc_hs_len).to(e.device)
        e = e.masked_fill(self.mask, float("-inf"))
        return F.softmax(scaling * e, dim=1)

    def forward(self, enc_hs_pad, enc_hs_len, dec_z, att_prev, scaling=2.0):
        self._memory(enc_hs_pad)
        e = self.gvec(torch.tanh(self.pre_compute_enc_h + self._query(enc_hs_pad, dec_z)))
        w = self._normalise(e.squeeze(2), enc_hs_len, scaling)
        c = (self.enc_h * w.unsqueeze(2)).sum(dim=1)
        return c, w


class AttLoc(AttAdd):
    def __init__(self, eprojs, dunits, att_dim, aconv_chans, aconv_filts, han_mode=False):
        nn.Module.__init__(self)  # children in ESPnet's order (the state_dict's key order)
        self.mlp_enc = nn.Linear(eprojs, att_dim)
        self.mlp_dec = nn.Linear(dunits, att_dim, bias=False)
        self.mlp_att = nn.Linear(aconv_chans, att_dim, bias=False)
        self.loc_conv = nn.Conv2d(
            1, aconv_chans, (1, 2 * aconv_filts + 1), padding=(0, aconv_filts), bias=False
        )
        self.gvec = nn.Linear(att_dim, 1)
        self.dunits, self.eprojs, self.att_dim = dunits, eprojs, att_dim
        self.han_mode = han_mode
        self.reset()

    def forward(
        self,
        enc_hs_pad,
        enc_hs_len,
        dec_z,
        att_prev,
        scaling=2.0,
        last_attended_idx=None,
        backward_window=1,
        forward_window=3,
    ):
        batch = len(enc_hs_pad)
        self._memory(enc_hs_pad)
        query = self._query(enc_hs_pad, dec_z)
        if att_prev is None:  # uniform over the valid frames
            valid = (~espnet_pad_mask(enc_hs_len)).to(device=query.device, dtype=query.dtype)
            att_prev = valid / valid.new_tensor(enc_hs_len).unsqueeze(-1)
        conv = self.loc_conv(att_prev.view(batch, 1, 1, self.h_length))  # [B, C, 1, T]
        location = self.mlp_att(conv.squeeze(2).transpose(1, 2))  # [B, T, att_dim]
        e = self.gvec(torch.tanh(location + self.pre_compute_enc_h + query)).squeeze(2)
        if self.mask is None:
            self.mask = espnet_pad_mask(enc_hs_len).to(e.device)
        e = e.masked_fill(self.mask, float("-inf"))
        if last_attended_idx is not None:  # monotonic constraint (TTS), batch of one
            start, stop = last_attended_idx - backward_window, last_attended_idx + forward_window
            e = e.clone()
            if start > 0:
                e[:, :start] = float("-inf")
            if stop < e.size(1):
                e[:, stop:] = float("-inf")
        w = F.softmax(scaling * e, dim=1)
        c = (self.enc_h * w.unsqueeze(2)).sum(dim=1)
        return c, w


def _espnet_uniform(enc_hs_len, like: Tensor) -> Tensor:
    valid = (~espnet_pad_mask(enc_hs_len)).to(device=like.device, dtype=like.dtype)
    return valid / valid.new_tensor(enc_hs_len).unsqueeze(-1)


def _coverage_step(att, term, enc_hs_pad, enc_hs_len, dec_z, att_prev_list, scaling):
    """ESPnet's coverage attentions' step: e = gvec(tanh(term(coverage) + mlp_enc(h) + query)),
    coverage the sum of the list of all previous steps' weights (uniform first); this step's
    weights are appended to the list, returned with the context."""
    batch = len(enc_hs_pad)
    att._memory(enc_hs_pad)
    query = att._query(enc_hs_pad, dec_z)
    if att_prev_list is None:
        att_prev_list = [_espnet_uniform(enc_hs_len, query)]
    cov_vec = sum(att_prev_list)  # [B, T]
    e = att.gvec(torch.tanh(term(cov_vec) + att.pre_compute_enc_h + query)).squeeze(2)
    w = att._normalise(e, enc_hs_len, scaling)
    att_prev_list += [w]
    c = torch.sum(att.enc_h * w.view(batch, att.h_length, 1), dim=1)
    return c, att_prev_list


class AttCovLoc(AttLoc):
    """ESPnet's coverage + location attention: AttLoc's parts, the location convolution over the
    coverage; the call appends this step's weights to the list and returns (context, the list)."""

    def _location(self, cov_vec):
        conv = self.loc_conv(cov_vec.view(cov_vec.shape[0], 1, 1, -1))  # [B, C, 1, T]
        return self.mlp_att(conv.squeeze(2).transpose(1, 2))  # [B, T, att_dim]

    def forward(self, enc_hs_pad, enc_hs_len, dec_z, att_prev_list, scaling=2.0):
        args = (enc_hs_pad, enc_hs_len, dec_z, att_prev_list, scaling)
        return _coverage_step(self, self._location, *args)


class AttCov(AttAdd):
    """ESPnet's coverage attention: e = gvec(tanh(wvec(coverage) + mlp_enc(h) + mlp_dec(s))),
    wvec a Linear(1, att_dim) over each frame's coverage; the call appends this step's weights
    to the list and returns (context, the list)."""

    def __init__(self, eprojs, dunits, att_dim, han_mode=False):
        nn.Module.__init__(self)  # children in ESPnet's order
        self.mlp_enc = nn.Linear(eprojs, att_dim)
        self.mlp_dec = nn.Linear(dunits, att_dim, bias=False)
        self.wvec = nn.Linear(1, att_dim)
        self.gvec = nn.Linear(att_dim, 1)
        self.dunits, self.eprojs, self.att_dim = dunits, eprojs, att_dim
        self.han_mode = han_mode
        self.reset()

    def forward(self, enc_hs_pad, enc_hs_len, dec_z, att_prev_list, scaling=2.0):
        args = (enc_hs_pad, enc_hs_len, dec_z, att_prev_list, scaling)
        return _coverage_step(self, lambda cov: self.wvec(cov.unsqueeze(-1)), *args)


# --- SpeechBrain ----------------------------------------------------------------------------------


def speechbrain_length_mask(length: Tensor, max_len: int) -> Tensor:
    """[B, max_len] 1/0 mask in ``length``'s dtype (SpeechBrain's length_to_mask)."""
    positions = torch.arange(max_len, device=length.device, dtype=length.dtype)
    return (positions.unsqueeze(0) < length.unsqueeze(1)).to(length.dtype)


class ContentBasedAttention(nn.Module):
    def __init__(self, enc_dim, dec_dim, attn_dim, output_dim, scaling=1.0):
        super().__init__()
        self.mlp_enc = nn.Linear(enc_dim, attn_dim)
        self.mlp_dec = nn.Linear(dec_dim, attn_dim)
        self.mlp_attn = nn.Linear(attn_dim, 1, bias=False)
        self.mlp_out = nn.Linear(enc_dim, output_dim)
        self.scaling = scaling
        self.softmax = nn.Softmax(dim=-1)
        self.reset()

    def reset(self):
        self.enc_len = None
        self.precomputed_enc_h = None
        self.mask = None

    def forward(self, enc_states, enc_len, dec_states):
        if self.precomputed_enc_h is None:
            self.precomputed_enc_h = self.mlp_enc(enc_states)
            self.mask = speechbrain_length_mask(enc_len, enc_states.size(1))
        scores = self.mlp_attn(
            torch.tanh(self.precomputed_enc_h + self.mlp_dec(dec_states.unsqueeze(1)))
        ).squeeze(-1)
        scores = scores.masked_fill(self.mask == 0, float("-inf"))
        attn = self.softmax(scores * self.scaling)
        context = torch.bmm(attn.unsqueeze(1), enc_states).squeeze(1)
        return self.mlp_out(context), attn


class LocationAwareAttention(nn.Module):
    def __init__(
        self, enc_dim, dec_dim, attn_dim, output_dim, conv_channels, kernel_size, scaling=1.0
    ):
        super().__init__()
        self.mlp_enc = nn.Linear(enc_dim, attn_dim)
        self.mlp_dec = nn.Linear(dec_dim, attn_dim)
        self.mlp_attn = nn.Linear(attn_dim, 1, bias=False)
        self.conv_loc = nn.Conv1d(
            1, conv_channels, kernel_size=2 * kernel_size + 1, padding=kernel_size, bias=False
        )
        self.mlp_loc = nn.Linear(conv_channels, attn_dim)
        self.mlp_out = nn.Linear(enc_dim, output_dim)
        self.scaling = scaling
        self.softmax = nn.Softmax(dim=-1)
        self.reset()

    def reset(self):
        self.enc_len = None
        self.precomputed_enc_h = None
        self.mask = None
        self.prev_attn = None

    def forward(self, enc_states, enc_len, dec_states):
        if self.precomputed_enc_h is None:
            self.precomputed_enc_h = self.mlp_enc(enc_states)
            self.mask = speechbrain_length_mask(enc_len, enc_states.size(1))
            self.prev_attn = self.mask * (1 / enc_len.float()).unsqueeze(1)
        location = self.mlp_loc(self.conv_loc(self.prev_attn.unsqueeze(1)).transpose(1, 2))
        query = self.mlp_dec(dec_states.unsqueeze(1))
        scores = self.mlp_attn(torch.tanh(self.precomputed_enc_h + query + location)).squeeze(-1)
        scores = scores.masked_fill(self.mask == 0, float("-inf"))
        attn = self.softmax(scores * self.scaling)
        self.prev_attn = attn.detach()
        context = torch.bmm(attn.unsqueeze(1), enc_states).squeeze(1)
        return self.mlp_out(context), attn


# --- fairseq --------------------------------------------------------------------------------------


class MLPAttention(nn.Module):
    """fairseq s2t_berard: decoder_state [B, Dd], source_hids [S, B, C], encoder_padding_mask
    [S, B] (True = padding) -> (context [B, C], weights [S, B])."""

    def __init__(self, decoder_hidden_state_dim, context_dim, attention_dim):
        super().__init__()
        self.context_dim, self.attention_dim = context_dim, attention_dim
        self.encoder_proj = nn.Linear(context_dim, attention_dim, bias=True)
        self.decoder_proj = nn.Linear(decoder_hidden_state_dim, attention_dim, bias=False)
        self.to_scores = nn.Linear(attention_dim, 1, bias=False)

    def forward(self, decoder_state, source_hids, encoder_padding_mask):
        src_len, bsz, _ = source_hids.size()
        keys = self.encoder_proj(source_hids.reshape(-1, self.context_dim))
        keys = keys.view(src_len, bsz, self.attention_dim)
        hidden = torch.tanh(self.decoder_proj(decoder_state).unsqueeze(0) + keys)
        scores = self.to_scores(hidden).view(src_len, bsz)
        if encoder_padding_mask is not None:
            scores = scores.float().masked_fill(encoder_padding_mask, float("-inf")).type_as(scores)
        weights = F.softmax(scores, dim=0)
        context = (source_hids * weights.unsqueeze(2)).sum(dim=0)
        return context, weights


class LocationAttention(nn.Module):
    """fairseq: encoder_out [B, T, D], encoder_padding_mask [B, T] (True = padding), decoder_h
    [B, Dd] or None, attn_state [B, K, T] -> (context [B, D], weights [B, T])."""

    def __init__(
        self,
        attn_dim,
        encoder_dim,
        decoder_dim,
        attn_state_kernel_size,
        conv_dim,
        conv_kernel_size,
        scaling=2.0,
    ):
        super().__init__()
        self.attn_dim, self.decoder_dim, self.scaling = attn_dim, decoder_dim, scaling
        self.proj_enc = nn.Linear(encoder_dim, attn_dim)
        self.proj_dec = nn.Linear(decoder_dim, attn_dim, bias=False)
        self.proj_attn = nn.Linear(conv_dim, attn_dim, bias=False)
        self.conv = nn.Conv1d(
            attn_state_kernel_size,
            conv_dim,
            2 * conv_kernel_size + 1,
            padding=conv_kernel_size,
            bias=False,
        )
        self.proj_out = nn.Sequential(nn.Tanh(), nn.Linear(attn_dim, 1))
        self.proj_enc_out = None

    def clear_cache(self):
        self.proj_enc_out = None

    def forward(self, encoder_out, encoder_padding_mask, decoder_h, attn_state):
        bsz, seq_len, _ = encoder_out.size()
        if self.proj_enc_out is None:
            self.proj_enc_out = self.proj_enc(encoder_out)
        location = self.proj_attn(self.conv(attn_state).transpose(1, 2))
        if decoder_h is None:
            decoder_h = encoder_out.new_zeros(bsz, self.decoder_dim)
        query = self.proj_dec(decoder_h).view(bsz, 1, self.attn_dim)
        out = self.proj_out(location + self.proj_enc_out + query).squeeze(2)
        out = out.masked_fill(encoder_padding_mask, float("-inf"))
        w = F.softmax(self.scaling * out, dim=1)
        return (encoder_out * w.unsqueeze(2)).sum(dim=1), w


# --- Tacotron 2 (NVIDIA, DeepLearningExamples, torchaudio) ----------------------------------------


class LinearNorm(nn.Module):
    def __init__(self, in_dim, out_dim, bias=True):
        super().__init__()
        self.linear_layer = nn.Linear(in_dim, out_dim, bias=bias)

    def forward(self, x):
        return self.linear_layer(x)


class ConvNorm(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, padding, bias=True):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, padding=padding, bias=bias)

    def forward(self, x):
        return self.conv(x)


class _TacotronLocation(nn.Module):
    def __init__(self, n_filters, kernel_size, attention_dim, wrapped):
        super().__init__()
        padding = (kernel_size - 1) // 2
        if wrapped:
            self.location_conv = ConvNorm(2, n_filters, kernel_size, padding, bias=False)
            self.location_dense = LinearNorm(n_filters, attention_dim, bias=False)
        else:
            self.location_conv = nn.Conv1d(2, n_filters, kernel_size, padding=padding, bias=False)
            self.location_dense = nn.Linear(n_filters, attention_dim, bias=False)

    def forward(self, attention_weights_cat):
        return self.location_dense(self.location_conv(attention_weights_cat).transpose(1, 2))


class _Tacotron2Attention(nn.Module):
    """forward(attention_hidden_state [B, Dq], memory [B, T, E], processed_memory [B, T, A],
    attention_weights_cat [B, 2, T], mask [B, T] True = padding, or None) -> (context [B, E],
    weights [B, T])."""

    wrapped = True

    def __init__(self, rnn_dim, embedding_dim, attention_dim, n_filters, kernel_size):
        super().__init__()
        linear = (
            (lambda i, o: LinearNorm(i, o, bias=False))
            if self.wrapped
            else (lambda i, o: nn.Linear(i, o, bias=False))
        )
        self.query_layer = linear(rnn_dim, attention_dim)
        self.memory_layer = linear(embedding_dim, attention_dim)
        self.v = linear(attention_dim, 1)
        self.location_layer = _TacotronLocation(n_filters, kernel_size, attention_dim, self.wrapped)
        self.score_mask_value = -float("inf")

    def forward(
        self, attention_hidden_state, memory, processed_memory, attention_weights_cat, mask
    ):
        query = self.query_layer(attention_hidden_state.unsqueeze(1))
        location = self.location_layer(attention_weights_cat)
        energies = self.v(torch.tanh(query + location + processed_memory)).squeeze(-1)
        if mask is not None:
            energies = energies.masked_fill(mask, self.score_mask_value)
        weights = F.softmax(energies, dim=1)
        return torch.bmm(weights.unsqueeze(1), memory).squeeze(1), weights


class NvidiaTacotron2Attention(_Tacotron2Attention):
    wrapped = True


class TorchaudioTacotron2Attention(_Tacotron2Attention):
    wrapped = False


# --- AllenNLP and d2l -----------------------------------------------------------------------------


class AllenNLPAdditiveAttention(nn.Module):
    """forward(vector [B, Dv], matrix [B, T, Dm], matrix_mask [B, T] (True/1 = keep) or None)
    -> weights [B, T] (or raw similarities with normalize=False)."""

    def __init__(self, vector_dim, matrix_dim, normalize=True):
        super().__init__()
        self._normalize = normalize
        self._w_matrix = nn.Parameter(torch.empty(vector_dim, vector_dim))
        self._u_matrix = nn.Parameter(torch.empty(matrix_dim, vector_dim))
        self._v_vector = nn.Parameter(torch.empty(vector_dim, 1))
        for p in (self._w_matrix, self._u_matrix, self._v_vector):
            nn.init.xavier_uniform_(p)

    def forward(self, vector, matrix, matrix_mask=None):
        hidden = vector.matmul(self._w_matrix).unsqueeze(1) + matrix.matmul(self._u_matrix)
        similarities = torch.tanh(hidden).matmul(self._v_vector).squeeze(2)
        if not self._normalize:
            return similarities
        if matrix_mask is None:
            return F.softmax(similarities, dim=-1)
        mask = matrix_mask.to(similarities.dtype)
        result = F.softmax(similarities * mask, dim=-1) * mask
        return result / (result.sum(dim=-1, keepdim=True) + 1e-13)


def d2l_masked_softmax(scores: Tensor, valid_lens: Tensor | None) -> Tensor:
    """Softmax over the last axis with positions >= valid_lens filled with -1e6 (d2l's)."""
    if valid_lens is None:
        return F.softmax(scores, dim=-1)
    batch, num_queries, num_keys = scores.shape
    if valid_lens.dim() == 1:
        valid_lens = valid_lens.unsqueeze(1).expand(batch, num_queries)
    keep = torch.arange(num_keys, device=scores.device) < valid_lens.unsqueeze(-1)
    return F.softmax(scores.masked_fill(~keep, -1e6), dim=-1)


class D2LAdditiveAttention(nn.Module):
    """forward(queries [B, Tq, Dq], keys [B, Tk, Dk], values [B, Tk, Dv], valid_lens [B] or
    [B, Tq] or None) -> context [B, Tq, Dv]; keeps ``attention_weights``."""

    def __init__(self, num_hiddens, dropout, **kwargs):
        super().__init__(**kwargs)
        self.W_k = nn.LazyLinear(num_hiddens, bias=False)
        self.W_q = nn.LazyLinear(num_hiddens, bias=False)
        self.w_v = nn.LazyLinear(1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens):
        features = torch.tanh(self.W_q(queries).unsqueeze(2) + self.W_k(keys).unsqueeze(1))
        scores = self.w_v(features).squeeze(-1)
        self.attention_weights = d2l_masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class D2LAdditiveAttentionSized(D2LAdditiveAttention):
    """The older d2l signature: AdditiveAttention(key_size, query_size, num_hiddens, dropout)."""

    def __init__(self, key_size, query_size, num_hiddens, dropout, **kwargs):
        nn.Module.__init__(self, **kwargs)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)


# --- Coqui TTS ------------------------------------------------------------------------------------


class CoquiLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.linear_layer = nn.Linear(in_features, out_features, bias=bias)

    def forward(self, x):
        return self.linear_layer(x)


class CoquiLocationLayer(nn.Module):
    def __init__(self, attention_dim, attention_n_filters=32, attention_kernel_size=31):
        super().__init__()
        self.location_conv1d = nn.Conv1d(
            2,
            attention_n_filters,
            attention_kernel_size,
            padding=(attention_kernel_size - 1) // 2,
            bias=False,
        )
        self.location_dense = CoquiLinear(attention_n_filters, attention_dim, bias=False)

    def forward(self, attention_cat):
        return self.location_dense(self.location_conv1d(attention_cat).transpose(1, 2))


class CoquiOriginalAttention(nn.Module):
    """forward(query [B, Dq], inputs [B, T, E], processed_inputs [B, T, A], mask [B, T] True =
    valid, or None) -> context [B, E]; ``init_states(inputs)`` before the first step."""

    def __init__(
        self,
        query_dim,
        embedding_dim,
        attention_dim,
        location_attention,
        attention_location_n_filters,
        attention_location_kernel_size,
        windowing,
        norm,
        forward_attn,
        trans_agent,
        forward_attn_mask,
    ):
        super().__init__()
        self.query_layer = CoquiLinear(query_dim, attention_dim, bias=False)
        self.inputs_layer = CoquiLinear(embedding_dim, attention_dim, bias=False)
        self.v = CoquiLinear(attention_dim, 1, bias=True)
        if trans_agent:
            self.ta = nn.Linear(query_dim + embedding_dim, 1, bias=True)
        if location_attention:
            self.location_layer = CoquiLocationLayer(
                attention_dim, attention_location_n_filters, attention_location_kernel_size
            )
        self._mask_value = -float("inf")
        self.windowing = windowing
        self.win_idx = None
        self.norm = norm
        self.forward_attn = forward_attn
        self.trans_agent = trans_agent
        self.forward_attn_mask = forward_attn_mask
        self.location_attention = location_attention

    def init_states(self, inputs):
        batch, length = inputs.shape[:2]
        self.attention_weights = torch.zeros(batch, length, device=inputs.device)
        if self.location_attention:
            self.attention_weights_cum = torch.zeros(batch, length, device=inputs.device)
        if self.forward_attn or self.windowing:
            raise NotImplementedError("forward attention and windowing are not re-created")

    def preprocess_inputs(self, inputs):
        return self.inputs_layer(inputs)

    def forward(self, query, inputs, processed_inputs, mask):
        keys = processed_inputs
        if self.location_attention:
            cat = torch.stack((self.attention_weights, self.attention_weights_cum), dim=1)
            keys = self.location_layer(cat) + processed_inputs
        energies = self.v(torch.tanh(self.query_layer(query.unsqueeze(1)) + keys)).squeeze(-1)
        if mask is not None:
            energies = energies.masked_fill(~mask, self._mask_value)
        if self.norm == "softmax":
            alignment = torch.softmax(energies, dim=-1)
        elif self.norm == "sigmoid":
            alignment = torch.sigmoid(energies) / torch.sigmoid(energies).sum(dim=1, keepdim=True)
        else:
            raise ValueError("Unknown value for attention norm type")
        if self.location_attention:
            self.attention_weights_cum += alignment
        self.attention_weights = alignment
        return torch.bmm(alignment.unsqueeze(1), inputs).squeeze(1)


class CoquiOriginalAttentionInPlace(CoquiOriginalAttention):
    """The same math in the original's own call conventions: the energies from a method that also
    returns the processed query, the states joined by cat of unsqueezes, the padding filled in
    place through ``.data`` (autograd does not see the fill), the cumulative weights updated by a
    method."""

    def get_location_attention(self, query, processed_inputs):
        attention_cat = torch.cat(
            (self.attention_weights.unsqueeze(1), self.attention_weights_cum.unsqueeze(1)), dim=1
        )
        processed_query = self.query_layer(query.unsqueeze(1))
        processed_attention_weights = self.location_layer(attention_cat)
        energies = self.v(
            torch.tanh(processed_query + processed_attention_weights + processed_inputs)
        )
        return energies.squeeze(-1), processed_query

    def get_attention(self, query, processed_inputs):
        processed_query = self.query_layer(query.unsqueeze(1))
        energies = self.v(torch.tanh(processed_query + processed_inputs))
        return energies.squeeze(-1), processed_query

    def update_location_attention(self, alignments):
        self.attention_weights_cum += alignments

    def forward(self, query, inputs, processed_inputs, mask):
        if self.location_attention:
            attention, _ = self.get_location_attention(query, processed_inputs)
        else:
            attention, _ = self.get_attention(query, processed_inputs)
        if mask is not None:
            attention.data.masked_fill_(~mask, self._mask_value)
        if self.norm == "softmax":
            alignment = torch.softmax(attention, dim=-1)
        elif self.norm == "sigmoid":
            alignment = torch.sigmoid(attention) / torch.sigmoid(attention).sum(dim=1, keepdim=True)
        else:
            raise ValueError("Unknown value for attention norm type")
        if self.location_attention:
            self.update_location_attention(alignment)
        context = torch.bmm(alignment.unsqueeze(1), inputs)
        self.attention_weights = alignment
        return context.squeeze(1)
