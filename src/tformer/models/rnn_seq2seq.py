"""RNN encoder-decoders: Bahdanau et al. (2014) with additive attention, and the same network
without attention (Cho et al., 2014: one fixed summary of the source).

    encoder: h_j = [GRU→(x_1..x_j); GRU←(x_j..x_S)]            annotations (B, S, 2H)
    start:   s_0 = tanh(W_init · h←_1)                           (B, H)
    step i:  e_ij = vᵀ tanh(W s_{i-1} + U h_j)                    additive score (B, S)
             α_i = softmax_j(e_i) over real source tokens        attention weights
             c_i = Σ_j α_ij h_j                                  context (B, 2H)
             s_i = GRU([E y_{i-1}; c_i], s_{i-1})
             logits_i = E · tanh(W_o [s_i; c_i; E y_{i-1}]) + b   (tied token matrix E)

Without attention, ``c_i`` is the same for every step: ``[h→_S; h←_1]``, the two directions'
final states; nothing else changes, so the pair isolates what attention adds. The width ``H`` is
``config.d_model``; each side is one GRU layer, as in the papers. ``U h_j`` is computed once per
source and kept in the decoding state, like the transformer's cross-attention keys.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from tformer.config import TransformerConfig
from tformer.errors import ConfigError
from tformer.nn.embedding import check_ids
from tformer.models.loss import token_loss

Tensor = torch.Tensor


class AdditiveAttention(nn.Module):
    """Bahdanau's score ``e_j = vᵀ tanh(W s + U h_j)``, softmax over the unmasked ``j``."""

    def __init__(self, hidden: int, memory: int):
        super().__init__()
        self.W = nn.Linear(hidden, hidden, bias=False)
        self.U = nn.Linear(memory, hidden)
        self.v = nn.Linear(hidden, 1, bias=False)

    def forward(self, s: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``s (B, H)``, ``keys = U h (B, S, H)``, ``values = h (B, S, 2H)``, ``mask (B, S)`` bool
        -> context ``(B, 2H)``, weights ``(B, S)``."""
        scores = self.v(torch.tanh(self.W(s)[:, None] + keys)).squeeze(-1)              # (B, S)
        weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)              # (B, S)
        return (weights[:, :, None] * values).sum(1), weights                           # (B, 2H), (B, S)


@dataclasses.dataclass
class RNNState:
    """One request's decoding state: annotations, their projection ``U h``, the mask, the
    decoder's hidden state ``s``; ``weights`` collects each step's attention when ``keep_weights``."""

    values: Tensor
    keys: Tensor | None
    mask: Tensor
    s: Tensor
    length: int = 0
    keep_weights: bool = False
    weights: list = dataclasses.field(default_factory=list)

    def repeat(self, k: int) -> "RNNState":
        rep = lambda t: None if t is None else t.repeat_interleave(k, dim=0)          # noqa: E731
        return RNNState(rep(self.values), rep(self.keys), rep(self.mask), rep(self.s), self.length)

    def reorder(self, index: Tensor, rows: Tensor | None = None) -> None:
        """Copy row ``index[i]`` of the decoder's state into row ``rows[i]`` (default: row ``i``), in place."""
        if rows is None:
            self.s.copy_(self.s.index_select(0, index))
        else:
            self.s.index_copy_(0, rows, self.s.index_select(0, index))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.values, self.keys, self.mask, self.s) if t is not None)


class BahdanauSeq2Seq(nn.Module):
    """Bidirectional-GRU encoder, GRU decoder with additive attention (see the module docstring).

    Args:
        config: ``vocab_size``, ``d_model`` (= H), ``dropout``, ``init_std``; ``n_layers`` must be 1.
    """

    attention = True

    def __init__(self, config: TransformerConfig):
        super().__init__()
        if config.n_layers != 1 or (config.encoder_layers or 1) != 1:
            raise ConfigError(f"model={config.model!r} has one GRU layer per side; set n_layers=1 "
                              f"(got {config.n_layers}) and leave encoder_layers unset.")
        self.config = c = config
        H = c.d_model
        self.tok_emb = nn.Embedding(c.vocab_size, H)                       # source, target and output
        self.encoder = nn.GRU(H, H, batch_first=True, bidirectional=True)
        self.init = nn.Linear(H, H)
        self.attn = AdditiveAttention(H, 2 * H) if self.attention else None
        self.cell = nn.GRUCell(H + 2 * H, H)
        self.out = nn.Linear(H + 2 * H + H, H)
        self.register_buffer("logits_bias", torch.zeros(c.vocab_size))
        self.drop = nn.Dropout(c.dropout)
        nn.init.normal_(self.tok_emb.weight, std=c.init_std)

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``src (B, S)`` -> annotations ``(B, S, 2H)`` (real tokens moved to the front, in order),
        their mask ``(B, S)`` bool, and the start state ``s_0 (B, H)``."""
        check_ids(src, self.config.vocab_size)
        mask = torch.ones_like(src, dtype=torch.bool) if src_mask is None else src_mask.bool()
        order = torch.sort((~mask).long(), dim=1, stable=True).indices              # real tokens first
        src, lengths = src.gather(1, order), mask.sum(1)
        packed = pack_padded_sequence(self.drop(self.tok_emb(src)), lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        out, last = self.encoder(packed)                                             # last (2, B, H)
        h, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])  # (B, S, 2H)
        mask = torch.arange(src.shape[1], device=src.device)[None] < lengths[:, None]
        return h, mask, torch.tanh(self.init(last[1]))                              # s_0 from h←_1

    def _state(self, src: Tensor, src_mask: Tensor | None) -> RNNState:
        h, mask, s0 = self.encode(src, src_mask)
        if self.attention:
            return RNNState(h, self.attn.U(h), mask, s0)
        H = self.config.d_model
        idx = (mask.sum(1) - 1)[:, None, None].expand(-1, 1, H)
        summary = torch.cat([h[:, :, :H].gather(1, idx)[:, 0], h[:, 0, H:]], dim=-1)  # [h→_S; h←_1] (B, 2H)
        return RNNState(summary, None, mask, s0)

    def new_state(self, src: Tensor, src_mask: Tensor | None = None, max_len: int = 0) -> RNNState:
        """Encode ``src`` once; the state for :meth:`decode_step` (``max_len`` is not needed)."""
        with torch.no_grad():
            return self._state(src, src_mask)

    def decode_step(self, tokens: Tensor, state: RNNState) -> Tensor:
        """Logits ``(B, T, V)`` for ``tokens (B, T)`` fed one after another, advancing ``state``."""
        check_ids(tokens, self.config.vocab_size)
        outputs = []
        for t in range(tokens.shape[1]):
            y = self.drop(self.tok_emb(tokens[:, t]))                                    # (B, H)
            if self.attention:
                c, w = self.attn(state.s, state.keys, state.values, state.mask)          # (B, 2H), (B, S)
                if state.keep_weights:
                    state.weights.append(w)
            else:
                c = state.values
            state.s = self.cell(torch.cat([y, c], -1), state.s)                         # (B, H)
            o = torch.tanh(self.out(self.drop(torch.cat([state.s, c, y], -1))))          # (B, H)
            outputs.append(F.linear(o, self.tok_emb.weight, self.logits_bias))           # (B, V)
        state.length += tokens.shape[1]
        return torch.stack(outputs, 1)

    def forward(self, src: Tensor, tgt: Tensor, targets: Tensor | None = None, *, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor | None]:
        """Teacher-forced logits ``(B, T, V)`` and the label-smoothed cross-entropy (as the transformer's).
        Targets are right-padded (``tgt_mask`` is accepted for the common interface; a recurrent
        decoder never reads later positions)."""
        logits = self.decode_step(tgt, self._state(src, src_mask))
        loss = None
        if targets is not None:
            loss = token_loss(logits, targets, label_smoothing)
        return logits, loss

    @torch.no_grad()
    def attention_weights(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """``(B, T, S)`` attention of each target step over the source (real tokens first)."""
        if not self.attention:
            raise ConfigError("this RNN encoder-decoder has no attention; use model='bahdanau'.")
        state = self.new_state(src, src_mask)
        state.keep_weights = True
        self.decode_step(tgt, state)
        return torch.stack(state.weights, 1)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)


class RNNEncoderDecoder(BahdanauSeq2Seq):
    """The same network without attention: one fixed source summary for every step (Cho et al.)."""

    attention = False
