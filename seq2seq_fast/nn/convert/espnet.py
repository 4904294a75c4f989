"""ESPnet's ``AttAdd``, ``AttLoc``, ``AttCov`` and ``AttCovLoc``
(espnet/nets/pytorch_backend/rnn/attentions.py).

Original parameters: ``mlp_enc`` (eprojs -> att_dim, with bias), ``mlp_dec`` (dunits -> att_dim,
no bias), ``gvec`` (att_dim -> 1, with bias); AttLoc adds ``mlp_att`` (aconv_chans -> att_dim, no
bias) and ``loc_conv`` (Conv2d 1 -> aconv_chans, kernel (1, 2K+1), padding (0, K), no bias).
State, cleared by ``reset()``: ``enc_h``, ``h_length``, ``pre_compute_enc_h`` (the projected
memory, computed at the first step of an utterance, or every step with ``han_mode``) and
``mask`` (True = padding, from the first step's lengths). Original math and call (batch-first)::

    forward(enc_hs_pad [B, T, D_enc], enc_hs_len [B] (list or tensor), dec_z [B, dunits] or None,
            att_prev [B, T] or None, scaling=2.0) -> (context [B, D_enc], weights [B, T])
    keys = pre_compute_enc_h                          (AttAdd)
    keys = pre_compute_enc_h + mlp_att(loc_conv(att_prev))   (AttLoc; att_prev None = uniform
                                                      over the valid frames)
    e = gvec(tanh(keys + mlp_dec(dec_z))); e[mask] = -inf; w = softmax(scaling * e)
    context = sum_t w_t enc_h_t

The coverage attentions take ``att_prev_list`` (a list of [B, T] weights, None at the first step:
[uniform]) instead of ``att_prev``, append ``w`` to it and return (context, att_prev_list); with
coverage = sum(att_prev_list), AttCov's keys are pre_compute_enc_h + wvec(coverage) (``wvec``:
Linear(1, att_dim) per frame, with bias) and AttCovLoc's are AttLoc's with the convolution over
the coverage. Both run as the location-aware step (AttCov: one channel, no convolution, wvec's
bias in the query).

AttLoc's ``forward`` also takes ``last_attended_idx``, ``backward_window``, ``forward_window`` (the
monotonic constraint of TTS decoding, batch of one): frames outside the window are masked like
padding here too. ``gvec``'s bias shifts every score of a row equally and cancels in the softmax;
``scaling`` is folded into the score vector (scaling * gvec.weight).
The attention runs as a typed plan on the general path's runtime (``_planned.py``): a row with
no valid frame gives NaN, as the original; training steps on the CPU kernel form the location
term inside the kernels (:class:`~seq2seq_fast.ops.stepwise.LocationMemory`: keys by one addmm,
the projected memory's and the values' gradients gathered once per sequence); AttAdd
gathers the steps' gradients for its fixed keys and values once per sequence
(:class:`~seq2seq_fast.ops.stepwise.StepwiseMemory`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from seq2seq_fast.nn.convert._base import (
    FusedStandIn,
    Layout,
    child_names,
    forward_defined_in,
    is_linear,
    own_parameter_names,
    register,
)
from seq2seq_fast.nn.convert._planned import planned
from seq2seq_fast.nn.convert._speech import adopt, same_padding_conv


def _padding_mask(enc_hs_len, device: torch.device) -> Tensor:
    """bool [B, max(enc_hs_len)], True at padded frames (ESPnet's make_pad_mask)."""
    lengths = torch.as_tensor(enc_hs_len, device=device).long()
    positions = torch.arange(int(lengths.max()), device=device)
    return positions.unsqueeze(0) >= lengths.unsqueeze(1)


class FusedEspnetAttAdd(FusedStandIn):
    """Fused stand-in for ESPnet's AttAdd: same parameters (the very objects, same state_dict
    keys), same state and ``reset()``, same ``forward``."""

    layout = "espnet_att_add"

    def __init__(self, original: nn.Module, backend: str = "auto") -> None:
        super().__init__(backend)
        adopt(self, original)

    def reset(self) -> None:
        self.h_length = None
        self.enc_h = None
        self.pre_compute_enc_h = None
        self.mask = None

    def _remember(self, enc_hs_pad: Tensor, enc_hs_len) -> None:
        """Project and keep the utterance's memory and its padding mask (once per utterance, as
        ESPnet does; the projection every call with ``han_mode``)."""
        if self.pre_compute_enc_h is None or self.han_mode:
            self.enc_h = enc_hs_pad
            self.h_length = enc_hs_pad.size(1)
            self.pre_compute_enc_h = self.mlp_enc(enc_hs_pad)
        if self.mask is None:
            self.mask = _padding_mask(enc_hs_len, enc_hs_pad.device)

    def _query(self, enc_hs_pad: Tensor, dec_z: Tensor | None) -> Tensor:
        batch = len(enc_hs_pad)
        if dec_z is None:
            dec_z = enc_hs_pad.new_zeros(batch, self.dunits)
        return self.mlp_dec(dec_z.view(batch, self.dunits))  # [B, att_dim]

    def _attend(
        self,
        query: Tensor,
        scaling,
        keep: Tensor | None = None,
        biases: tuple[Tensor, ...] = (),
        location: tuple | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(context, weights) of e = gvec(tanh(query + biases + pre_compute_enc_h [+ location
        term])), e[mask] = -inf (and where ``keep`` is False), softmax(scaling * e)."""
        gvec = self.gvec
        shifts = () if gvec.bias is None else (gvec.bias,)
        masks, kinds = (self.mask,), ("fill",)
        if keep is not None:
            masks, kinds = (keep,), ("keep",)
        attention = planned(
            self,
            shifted=bool(shifts),
            masks=kinds,
            scaled=True,
            one_query=True,
            biased=bool(biases),
            located=location is not None,
        )
        weights, context = attention(
            query,
            self.pre_compute_enc_h,
            gvec.weight,
            self.enc_h,
            masks=masks,
            fills=(float("-inf"),),
            shifts=shifts,
            scales=(scaling,),
            biases=biases,
            location=location,
        )
        return context, weights

    def forward(
        self, enc_hs_pad: Tensor, enc_hs_len, dec_z: Tensor | None, att_prev, scaling=2.0
    ) -> tuple[Tensor, Tensor]:
        self._remember(enc_hs_pad, enc_hs_len)
        return self._attend(self._query(enc_hs_pad, dec_z), scaling)


class FusedEspnetAttLoc(FusedEspnetAttAdd):
    """Fused stand-in for ESPnet's AttLoc: the step's keys are the cached projected memory plus
    the location term mlp_att(loc_conv(att_prev))."""

    layout = "espnet_att_loc"

    def forward(
        self,
        enc_hs_pad: Tensor,
        enc_hs_len,
        dec_z: Tensor | None,
        att_prev: Tensor | None,
        scaling=2.0,
        last_attended_idx: int | None = None,
        backward_window: int = 1,
        forward_window: int = 3,
    ) -> tuple[Tensor, Tensor]:
        batch = len(enc_hs_pad)
        self._remember(enc_hs_pad, enc_hs_len)
        query = self._query(enc_hs_pad, dec_z)
        if att_prev is None:
            att_prev = _uniform(enc_hs_pad, enc_hs_len, query.dtype)
        keep = None
        if last_attended_idx is not None:
            keep = _window(~self.mask, last_attended_idx, backward_window, forward_window)
        # keys = pre_compute_enc_h + mlp_att(loc_conv(att_prev))
        location = (
            att_prev.view(batch, 1, self.h_length),
            self.loc_conv.weight,
            self.mlp_att.weight,
        )
        return self._attend(query, scaling, keep, location=location)


def _uniform(enc_hs_pad: Tensor, enc_hs_len, dtype: torch.dtype) -> Tensor:
    """ESPnet's first previous weights: uniform over each utterance's valid frames [B, T]."""
    frames = (~_padding_mask(enc_hs_len, enc_hs_pad.device)).to(dtype)
    return frames / frames.new_tensor(enc_hs_len).unsqueeze(-1)


def _coverage(att_prev_list, enc_hs_pad: Tensor, enc_hs_len, dtype: torch.dtype):
    """(the list of previous weights, [uniform] at the first step; their sum [B, T])."""
    if att_prev_list is None:
        att_prev_list = [_uniform(enc_hs_pad, enc_hs_len, dtype)]
    return att_prev_list, sum(att_prev_list)


class FusedEspnetAttCovLoc(FusedEspnetAttLoc):
    """Fused stand-in for ESPnet's AttCovLoc (coverage + location): AttLoc's step with the
    location convolution over the coverage, the sum of the list of all the previous steps'
    weights. As the original, the call appends this step's weights to that list and returns it:
    (context, att_prev_list)."""

    layout = "espnet_att_cov_loc"

    def forward(  # type: ignore[override]
        self, enc_hs_pad: Tensor, enc_hs_len, dec_z: Tensor | None, att_prev_list, scaling=2.0
    ) -> tuple[Tensor, list]:
        dtype = self.mlp_enc.weight.dtype
        att_prev_list, coverage = _coverage(att_prev_list, enc_hs_pad, enc_hs_len, dtype)
        context, weights = FusedEspnetAttLoc.forward(
            self, enc_hs_pad, enc_hs_len, dec_z, coverage, scaling
        )
        att_prev_list += [weights]
        return context, att_prev_list


class FusedEspnetAttCov(FusedEspnetAttAdd):
    """Fused stand-in for ESPnet's AttCov (coverage): keys_t = mlp_enc(h) + wvec(coverage_t) per
    frame, coverage the sum of the list of all the previous steps' weights: the location-aware
    step with one channel, no convolution (a 1-tap identity) and wvec's weight [A, 1] as the
    dense layer; wvec's bias, the same for every frame, joins the query. The call appends this
    step's weights to the list and returns it, as the original."""

    layout = "espnet_att_cov"

    def forward(  # type: ignore[override]
        self, enc_hs_pad: Tensor, enc_hs_len, dec_z: Tensor | None, att_prev_list, scaling=2.0
    ) -> tuple[Tensor, list]:
        batch = len(enc_hs_pad)
        self._remember(enc_hs_pad, enc_hs_len)
        query = self._query(enc_hs_pad, dec_z)
        att_prev_list, coverage = _coverage(att_prev_list, enc_hs_pad, enc_hs_len, query.dtype)
        coverage = coverage.view(batch, 1, self.h_length)
        location = (coverage, self._identity(coverage), self.wvec.weight)
        context, weights = self._attend(query, scaling, biases=(self.wvec.bias,), location=location)
        att_prev_list += [weights]
        return context, att_prev_list

    def _identity(self, like: Tensor) -> Tensor:
        """The 1-tap identity convolution weight [C=1, Cin=1, K=1] (one object while the dtype and
        device stay: the runtime keeps a decoder's step state while its arguments are the same)."""
        identity = self.__dict__.get("_identity_weight")
        if identity is None or identity.dtype != like.dtype or identity.device != like.device:
            identity = self.__dict__["_identity_weight"] = like.new_ones(1, 1, 1)
        return identity


def _window(valid: Tensor, last: int, backward: int, forward: int) -> Tensor:
    """ESPnet's monotonic constraint as a mask: frames before last - backward (when > 0) and
    from last + forward on are excluded. Batch of one, as there."""
    if valid.size(0) != 1:
        raise NotImplementedError("Batch attention constraining is not yet supported.")
    start, stop = last - backward, last + forward
    positions = torch.arange(valid.size(1), device=valid.device)
    keep = torch.ones_like(valid)
    if start > 0:
        keep &= positions >= start
    if stop < valid.size(1):
        keep &= positions < stop
    return valid & keep


# --- matchers -------------------------------------------------------------------------------------

_STATE = ("dunits", "eprojs", "att_dim", "han_mode", "pre_compute_enc_h", "mask", "enc_h")


def _common(module: nn.Module, extra: set[str]) -> bool:
    if child_names(module) != {"mlp_enc", "mlp_dec", "gvec"} | extra or own_parameter_names(module):
        return False
    if not all(hasattr(module, name) for name in _STATE) or not callable(
        getattr(module, "reset", None)
    ):
        return False
    att_dim = module.att_dim
    return (
        is_linear(module.mlp_enc, bias=True, out_features=att_dim, in_features=module.eprojs)
        and is_linear(module.mlp_dec, bias=False, out_features=att_dim, in_features=module.dunits)
        and is_linear(module.gvec, out_features=1, in_features=att_dim)
    )


def _match_add(module: nn.Module) -> bool:
    return _common(module, set())


def _match_loc(module: nn.Module) -> bool:
    if not _common(module, {"mlp_att", "loc_conv"}):
        return False
    conv = module.loc_conv
    return (
        type(conv) is nn.Conv2d
        and conv.bias is None
        and same_padding_conv(conv, in_channels=1)
        and is_linear(
            module.mlp_att, bias=False, in_features=conv.out_channels, out_features=module.att_dim
        )
    )


def _match_loc_only(module: nn.Module) -> bool:
    return _match_loc(module) and not forward_defined_in(module, "AttCovLoc")


def _match_cov_loc(module: nn.Module) -> bool:
    return _match_loc(module) and forward_defined_in(module, "AttCovLoc")


def _match_cov(module: nn.Module) -> bool:
    if not _common(module, {"wvec"}) or not forward_defined_in(module, "AttCov"):
        return False
    return is_linear(module.wvec, bias=True, in_features=1, out_features=module.att_dim)


def _example_call_cov(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    (enc, lengths, dec_z, att_prev), kwargs = _example_call(module, dtype)
    earlier = torch.softmax(torch.randn(att_prev.shape, dtype=dtype), dim=1)
    return (enc, lengths, dec_z, [earlier, att_prev]), kwargs


def _example_call(module: nn.Module, dtype: torch.dtype) -> tuple[tuple, dict]:
    batch, frames = 3, 6
    lengths = [6, 4, 2]
    enc = torch.randn(batch, frames, module.eprojs, dtype=dtype)
    dec_z = torch.randn(batch, module.dunits, dtype=dtype)
    att_prev = torch.softmax(torch.randn(batch, frames, dtype=dtype), dim=1)
    return (enc, lengths, dec_z, att_prev), {"scaling": 1.5}


def _prepare(module: nn.Module, args: tuple, kwargs: dict) -> None:
    module.reset()  # a module converted mid-utterance carries another batch's cache


def _layout(name: str, match, stand_in: type, example_call) -> Layout:
    """An ESPnet layout: its stand-in class built from (module, backend), the cache reset first."""
    return register(Layout(name, match, stand_in, example_call, prepare=_prepare))


LAYOUT_ADD = _layout("espnet_att_add", _match_add, FusedEspnetAttAdd, _example_call)
LAYOUT_LOC = _layout("espnet_att_loc", _match_loc_only, FusedEspnetAttLoc, _example_call)
LAYOUT_COV_LOC = _layout(
    "espnet_att_cov_loc", _match_cov_loc, FusedEspnetAttCovLoc, _example_call_cov
)
LAYOUT_COV = _layout("espnet_att_cov", _match_cov, FusedEspnetAttCov, _example_call_cov)
