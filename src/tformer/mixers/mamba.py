"""The Mamba-1 mixer (Gu & Dao 2023): a selective state-space layer behind the token-mixer protocol.

For ``x (B, T, d)`` (the normalised residual stream), with ``E = expand · d`` inner channels,
``N = d_state`` state entries per channel and ``R = dt_rank``:

    u, z  = in_proj(x)                    (B, T, E) each: the SSM's input and the gate
    u     = silu(causal depthwise conv(u)) kernel d_conv along time, one filter per channel
    Δ, B, C = x_proj(u)                   (B, T, R), (B, T, N), (B, T, N)   [selective]
    Δ     = softplus(dt_proj(Δ) + dt_bias)  (B, T, E) positive step sizes
    y     = SSM(u; Δ, A, B, C) + D u      the selective scan, :mod:`tformer.ops.scan`
    out   = out_proj(y · silu(z))         (B, T, d)

``A = -exp(A_log)`` starts as the S4D-real matrix ``A[:, n] = -(n + 1)``; ``dt_bias`` starts at the
inverse softplus of step sizes log-uniform in [1e-3, 1e-1]. With ``selective=False`` (the LTI
ablation, S4D) Δ = softplus(dt_bias), B and C are learned constants, independent of the input.

Generation keeps, per sequence, a fixed-size state: the last ``d_conv - 1`` conv inputs ``(E, K-1)``
and the SSM state ``(E, N)``; a token costs the same at position 10 as at position 10 000.
Padding (``step.tokens`` False) is zeroed before the conv and before the scan, so a left-padded
sequence's state is exactly that of the unpadded one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tformer.errors import ConfigError
from tformer.mixers.base import Step
from tformer.nn.markers import mark_residual, no_weight_decay
from tformer.ops.scan import FAST_SCAN, METHODS, selective_scan, selective_step

Tensor = torch.Tensor

DEFAULTS = dict(d_state=16, expand=2, d_conv=4, dt_rank="auto", conv_bias=True, selective=True, scan=FAST_SCAN)


@dataclass(frozen=True)
class MambaShape:
    """The sizes of one Mamba layer, from the config: ``d``, ``E``, ``N``, ``R``, ``K`` as in the module doc."""

    d: int
    E: int
    N: int
    R: int
    K: int
    conv_bias: bool
    selective: bool
    bias: bool
    scan: str

    @classmethod
    def of(cls, config) -> "MambaShape":
        o = {**DEFAULTS, **config.mixer_options.get("mamba", {})}
        R = math.ceil(config.d_model / 16) if o["dt_rank"] == "auto" else o["dt_rank"]
        return cls(config.d_model, o["expand"] * config.d_model, o["d_state"], R, o["d_conv"],
                   o["conv_bias"], o["selective"], config.bias, o["scan"])


@dataclass
class MambaState:
    """One layer's inference state for ``B`` sequences: ``conv (B, E, K-1)``, ``ssm (B, E, N)``."""

    conv: Tensor
    ssm: Tensor

    def reset(self) -> None:
        """Forget everything (a fresh sequence starts from zeros)."""
        self.conv.zero_()
        self.ssm.zero_()

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()


class MambaMixer(nn.Module):
    """A Mamba-1 layer as a token mixer; options in ``config.mixer_options["mamba"]`` (see :data:`DEFAULTS`).

    Args:
        config: the model's config (``d_model``, ``bias`` for in_proj/out_proj, ``mixer_options``).
        layer: index in the stack (unused: every Mamba layer is alike).
        shared: the model's shared objects (unused).
    """

    def __init__(self, config, layer: int = 0, shared=None):
        super().__init__()
        self.shape = s = MambaShape.of(config)
        self.in_proj = nn.Linear(s.d, 2 * s.E, bias=s.bias)
        self.conv1d = nn.Conv1d(s.E, s.E, s.K, groups=s.E, bias=s.conv_bias)      # weight (E, 1, K)
        if s.selective:
            self.x_proj = nn.Linear(s.E, s.R + 2 * s.N, bias=False)
            self.dt_proj = nn.Linear(s.R, s.E, bias=False)
        else:  # LTI: constant B, C per channel (S4D)
            self.B = nn.Parameter(torch.ones(s.E, s.N))
            self.C = nn.Parameter(torch.randn(s.E, s.N) / math.sqrt(s.N))
        self.dt_bias = nn.Parameter(torch.empty(s.E))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, s.N + 1, dtype=torch.float32)).repeat(s.E, 1))
        self.D = nn.Parameter(torch.ones(s.E))
        no_weight_decay(self.A_log, self.D, self.dt_bias)   # the dynamics, not weights: decay would pull A toward 0
        self.out_proj = mark_residual(nn.Linear(s.E, s.d, bias=s.bias))
        self.reset_dt_bias()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Mamba's own initialisation (the model calls it after its generic N(0, 0.02) one): PyTorch's
        default (Kaiming-uniform) projections and conv, ``dt_proj`` uniform in ``±R^-1/2`` so that Δ
        depends on the input from the start, S4D-real A, D = 1, Δ bias as in :meth:`reset_dt_bias`."""
        s = self.shape
        for m in (self.in_proj, self.conv1d, self.out_proj, *((self.x_proj,) if s.selective else ())):
            m.reset_parameters()
        if s.selective:
            nn.init.uniform_(self.dt_proj.weight, -s.R ** -0.5, s.R ** -0.5)
        self.A_log.copy_(torch.log(torch.arange(1, s.N + 1, dtype=torch.float32)).repeat(s.E, 1))
        self.D.fill_(1.0)
        self.reset_dt_bias()

    @torch.no_grad()
    def reset_dt_bias(self, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        """``softplus(dt_bias)`` log-uniform in ``[dt_min, dt_max]`` (Mamba's Δ initialisation)."""
        dt = torch.exp(torch.rand(self.shape.E) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))                         # softplus⁻¹(dt)

    def forward(self, x: Tensor, step: Step | None = None, state: MambaState | None = None):
        """``x (B, T, d)`` -> ``(B, T, d)``; reads and advances ``state`` when given."""
        s, T = self.shape, x.shape[1]
        real = None if step is None or step.tokens is None else step.tokens[..., None].to(x.dtype)  # (B, T, 1)
        u, z = self.in_proj(x).chunk(2, dim=-1)                                       # (B, T, E) each
        if real is not None:
            u = u * real                                                              # padding holds no input
        u = self._conv(u.transpose(1, 2), state).transpose(1, 2)                      # (B, T, E)
        if real is not None:
            u = u * real                                                              # nor writes the state
        delta, B, C = self._ssm_parameters(u)
        A = -torch.exp(self.A_log.float())                                            # (E, N)
        h0 = None if state is None else state.ssm.float()
        if state is not None and T == 1:
            y, h = selective_step(u[:, 0].float(), delta[:, 0], A, B[:, 0, None] if s.selective else B,
                                  C[:, 0, None] if s.selective else C, self.D.float(), h0)
            y = y[:, None]                                                            # (B, 1, E)
        else:
            y, h = selective_scan(u.float(), delta, A, B, C, self.D.float(), h0, method=s.scan)
        if state is not None:
            state.ssm.copy_(h)
        out = self.out_proj((y.to(x.dtype) * F.silu(z)))                              # (B, T, d)
        return (out, None) if step is not None and step.return_weights else out

    def _conv(self, u: Tensor, state: MambaState | None) -> Tensor:
        """Causal depthwise conv over time of ``u (B, E, T)``, continuing from ``state.conv``; then SiLU."""
        K = self.shape.K
        past = u.new_zeros(u.shape[0], u.shape[1], K - 1) if state is None else state.conv.to(u.dtype)
        full = torch.cat([past, u], dim=-1)                                           # (B, E, K-1+T)
        if state is not None and K > 1:
            state.conv.copy_(full[..., full.shape[-1] - (K - 1):])
        return F.silu(F.conv1d(full, self.conv1d.weight, self.conv1d.bias, groups=self.shape.E))  # (B, E, T)

    def _ssm_parameters(self, u: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Δ ``(B, T, E)`` and B, C: ``(B, T, N)`` from ``u`` (selective) or ``(E, N)`` constants (LTI); fp32."""
        s = self.shape
        if not s.selective:
            delta = F.softplus(self.dt_bias.float()).expand(u.shape[0], u.shape[1], s.E)
            return delta, self.B.float(), self.C.float()
        dt, B, C = self.x_proj(u).split([s.R, s.N, s.N], dim=-1)                      # (B, T, R), (B, T, N) x2
        delta = F.softplus(self.dt_proj(dt).float() + self.dt_bias.float())           # (B, T, E)
        return delta, B.float(), C.float()

    # ---------------------------------------------------------------- protocol: state and accounting
    def new_state(self, batch_size: int, max_len: int = 0, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> MambaState:
        """Zeros: ``conv (B, E, K-1)`` and ``ssm (B, E, N)``, whatever ``max_len`` is."""
        s = self.shape
        return MambaState(torch.zeros(batch_size, s.E, s.K - 1, dtype=dtype, device=device),
                          torch.zeros(batch_size, s.E, s.N, dtype=dtype, device=device))

    @classmethod
    def count_parameters(cls, config) -> int:
        """Parameters of one layer: in_proj, conv, x_proj + dt_proj (or constant B, C), Δ bias, A, D, out_proj."""
        s = MambaShape.of(config)
        n = s.d * 2 * s.E + 2 * s.E * s.bias + s.E * s.K + s.E * s.conv_bias          # in_proj, conv1d
        n += s.E * (s.R + 2 * s.N) + s.R * s.E if s.selective else 2 * s.E * s.N       # x_proj + dt_proj | B, C
        n += s.E + s.E * s.N + s.E                                                     # dt_bias, A_log, D
        return n + s.E * s.d + s.d * s.bias                                            # out_proj

    @classmethod
    def flops_per_token(cls, config) -> int:
        """Forward FLOPs per token of one layer: 2 per multiply-add of the projections and the conv
        (:meth:`matmul_flops_per_token`), plus the scan's ``7·E·N``: Δ·A, exp, ·B·(Δx), a·h, + b
        (5) and the read-out h·C (2); plus ``5·E``: Δ·x, the skip D·x and its add, the gate."""
        s = MambaShape.of(config)
        return cls.matmul_flops_per_token(config) + 7 * s.E * s.N + 5 * s.E

    @classmethod
    def extra_training_flops_per_token(cls, config, seq_len: int = 0, layer: int = 0) -> int:
        """Training FLOPs per token that ``6 · parameters`` misses: the scan's elementwise work,
        forward plus a backward of twice that (``3 · (7·E·N + 5·E)``), whatever the length."""
        s = MambaShape.of(config)
        return 3 * (7 * s.E * s.N + 5 * s.E)

    @classmethod
    def matmul_flops_per_token(cls, config) -> int:
        """The projections and the conv: what ``torch.utils.flop_counter`` counts (the fused scan is elementwise)."""
        s = MambaShape.of(config)
        proj = s.d * 2 * s.E + (s.E * (s.R + 2 * s.N) + s.R * s.E if s.selective else 0) + s.E * s.d
        return 2 * proj + 2 * s.E * s.K

    @classmethod
    def state_bytes(cls, config, n_tokens: int = 0, batch_size: int = 1, bytes_per_element: int = 4) -> int:
        """Bytes of one layer's state: ``B · E · (K - 1 + N) · bytes``, the same for any ``n_tokens``."""
        s = MambaShape.of(config)
        return batch_size * s.E * (s.K - 1 + s.N) * bytes_per_element

    @classmethod
    def check_config(cls, config) -> None:
        """Refuse unknown or out-of-range options in ``config.mixer_options["mamba"]`` (one sentence)."""
        o = config.mixer_options.get("mamba", {})
        unknown = sorted(set(o) - set(DEFAULTS))
        if unknown:
            raise ConfigError(f"mixer_options['mamba'] has unknown option(s) {', '.join(unknown)}; "
                              f"valid ones are {', '.join(DEFAULTS)}.")
        o = {**DEFAULTS, **o}
        for key in ("d_state", "expand", "d_conv"):
            if not _positive_int(o[key]):
                raise ConfigError(f"mixer_options['mamba']['{key}']={o[key]!r} must be a positive integer.")
        if o["dt_rank"] != "auto" and not _positive_int(o["dt_rank"]):
            raise ConfigError(f"mixer_options['mamba']['dt_rank']={o['dt_rank']!r} must be 'auto' "
                              f"(ceil(d_model / 16)) or a positive integer.")
        for key in ("conv_bias", "selective"):
            if not isinstance(o[key], bool):
                raise ConfigError(f"mixer_options['mamba']['{key}']={o[key]!r} must be true or false.")
        if o["scan"] not in METHODS:
            raise ConfigError(f"mixer_options['mamba']['scan']={o['scan']!r} is not known; "
                              f"choose one of {', '.join(METHODS)}.")


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1
