"""Data-free 2..8-bit (default 4) quantisation of compressed MLA KV-cache rows: TurboQuant and PolarQuant.

Both methods first multiply each row by a seeded Haar-random orthogonal matrix R (QR of a Gaussian matrix,
sign-fixed). After that, the direction of any fixed vector is uniform on the sphere. So the statistics the
codebooks are fitted to are known in advance, and no calibration data is needed.

* TurboQuant stores ||x|| and quantises each coordinate of the unit vector R x / ||x|| with one Lloyd-Max
  codebook for the exact marginal of a uniform point on S^(dim-1). That density is proportional to
  (1 - t^2)^((dim-3)/2), which is close to N(0, 1/dim). The expected relative MSE is dim times the
  per-coordinate distortion: about 0.0095 at 4 bits, the Lloyd-Max value for a Gaussian.
* PolarQuant applies the recursive polar transform to R x. Level 1 maps each pair (y_2i, y_2i+1) to a radius
  and an angle in [0, 2pi), which is uniform. Level l >= 2 maps each pair of radii (norms of two independent
  2^(l-1)-dim Gaussian blocks) to a radius and an angle in [0, pi/2] with density proportional to
  sin(2 psi)^(2^(l-1) - 1), peaked at pi/4. After log2(dim) levels, one radius (= ||x||) is left. The dim-1
  angles are quantised with one Lloyd-Max codebook per level. The norm is preserved by construction.

Codes are packed into a dense LSB-first bitstream of ceil(n_codes * bits / 8) uint8 bytes per row, for every
bit width. For bits=4, code 2i sits in the low nibble of byte i and code 2i+1 in the high nibble. Norms are
stored as float16, and rows whose norm exceeds the fp16 maximum are rejected. So
bytes_per_row = ceil(n_codes * bits / 8) + 2, with n_codes = dim (TurboQuant) or dim - 1 (PolarQuant).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from megacpp_lab.checks import is_int

__all__ = [
    "MAX_BITS",
    "METHODS",
    "MIN_BITS",
    "NORM_DTYPE",
    "PolarQuant",
    "QuantizedRows",
    "TurboQuant",
    "haar_rotation",
    "make_quantizer",
    "pack_codes",
    "unpack_codes",
]

METHODS = ("turboquant", "polarquant")
MIN_BITS, MAX_BITS = 2, 8
NORM_DTYPE = torch.float16
_NORM_BYTES = 2
_FP16_MAX = float(torch.finfo(torch.float16).max)
_GRID = 1 << 16  # Lloyd grid points; >= 400 points per standard deviation for every density used here
_LLOYD_ITERS = 1000  # converges in < 200 from the Panter-Dite start


@dataclass(frozen=True)
class QuantizedRows:
    codes: torch.Tensor  # uint8, packed, shape [..., n_bytes]
    norms: torch.Tensor  # [...] float16
    dim: int
    bits: int
    method: str  # "turboquant" | "polarquant"


def haar_rotation(dim: int, seed: int) -> torch.Tensor:
    """[dim, dim] fp32 orthogonal matrix, a Haar sample that is a function of (dim, seed) alone."""
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64, device="cpu"))
    # Plain QR is not Haar-distributed. Forcing diag(r) > 0 makes the factorisation unique and Q uniform.
    sign = torch.sign(torch.diagonal(r))
    sign[sign == 0] = 1.0
    return (q * sign).to(torch.float32)


@functools.lru_cache(maxsize=32)
def _cached_rotation(dim: int, seed: int) -> torch.Tensor:
    return haar_rotation(dim, seed)  # the QR dominates construction; K and rope quantisers are rebuilt often


def _lloyd_max(lo: float, hi: float, log_density, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lloyd-Max codebook for a 1-D density on [lo, hi], computed on a fine midpoint grid (float64, CPU).

    Returns (centroids, interior boundaries, grid weights, grid quantisation error)."""
    t = lo + (hi - lo) / _GRID * (torch.arange(_GRID, dtype=torch.float64) + 0.5)  # midpoints: no +-1 or 0 poles
    logp = log_density(t)
    w = torch.exp(logp - logp.max())
    w = w / w.sum()
    # Start from the high-rate optimum (point density ~ p^(1/3), Panter-Dite): Lloyd then needs few steps.
    dens = w ** (1 / 3)
    qs = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    c = t[torch.searchsorted(torch.cumsum(dens, 0) / dens.sum(), qs).clamp_max(_GRID - 1)]
    # Prefix sums make one iteration O(levels log grid): cell mass and first moment are differences.
    zero = torch.zeros(1, dtype=torch.float64)
    cum_w, cum_wt = torch.cat([zero, torch.cumsum(w, 0)]), torch.cat([zero, torch.cumsum(w * t, 0)])
    ends = torch.tensor([_GRID])
    for _ in range(_LLOYD_ITERS):
        edges = torch.cat([ends.new_zeros(1), torch.searchsorted(t, 0.5 * (c[1:] + c[:-1]), right=True), ends])
        mass = cum_w[edges[1:]] - cum_w[edges[:-1]]
        moment = cum_wt[edges[1:]] - cum_wt[edges[:-1]]
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), c)
        done = bool((new - c).abs().max() < 1e-12 * (hi - lo))
        c = new
        if done:
            break
    b = 0.5 * (c[1:] + c[:-1])
    return c, b, w, t - c[torch.bucketize(t, b)]


@functools.lru_cache(maxsize=None)
def _turbo_codebook(dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    hi = min(1.0, 12.0 / math.sqrt(dim))  # the mass beyond 12 sigma is negligible
    c, b, w, err = _lloyd_max(-hi, hi, lambda t: 0.5 * (dim - 3) * torch.log1p(-t * t), 1 << bits)
    return c.float(), b.float(), dim * float((w * err**2).sum())  # expected relative MSE


@functools.lru_cache(maxsize=None)
def _polar_codebook(level: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    if level == 1:
        c, b, w, err = _lloyd_max(0.0, 2 * math.pi, torch.zeros_like, 1 << bits)
    else:
        m = 1 << (level - 1)  # each radius is the norm of an m-dim Gaussian block
        c, b, w, err = _lloyd_max(0.0, math.pi / 2, lambda t: (m - 1) * torch.log(torch.sin(2 * t)), 1 << bits)
    # A wrong angle delta moves its block by 2 (1 - cos delta) of its squared radius. Summed over a level,
    # that is the squared norm times E[2 (1 - cos delta)].
    return c.float(), b.float(), float((w * 2 * (1 - torch.cos(err))).sum())


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        rng = f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}"
        raise ValueError(f"{name} must be {rng}, got {value!r}")
    return value


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] codes < 2**bits -> [..., ceil(n*bits/8)] uint8, dense LSB-first bitstream."""
    _check_int("bits", bits, 1, 8)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for bits={bits}")
    lead, n = codes.shape[:-1], codes.shape[-1]
    n_bytes = (n * bits + 7) // 8
    c = codes.to(torch.uint8)
    if bits == 8:
        return c.contiguous()
    if bits == 4:  # fast path, same layout as the generic stream: even code in the low nibble
        if n % 2:
            c = torch.cat([c, c.new_zeros(*lead, 1)], dim=-1)
        return c[..., 0::2] | (c[..., 1::2] << 4)
    shifts = torch.arange(bits, dtype=torch.uint8, device=c.device)
    stream = ((c.unsqueeze(-1) >> shifts) & 1).reshape(*lead, n * bits)
    stream = torch.cat([stream, stream.new_zeros(*lead, n_bytes * 8 - n * bits)], dim=-1)
    byte_shifts = torch.arange(8, dtype=torch.uint8, device=c.device)
    return (stream.reshape(*lead, n_bytes, 8) << byte_shifts).sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of pack_codes: [..., n_bytes] uint8 -> [..., n] uint8 codes."""
    lead = packed.shape[:-1]
    if bits == 8:
        return packed[..., :n]
    if bits == 4:
        return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(*lead, 2 * packed.shape[-1])[..., :n]
    byte_shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(-1) >> byte_shifts) & 1).reshape(*lead, 8 * packed.shape[-1])[..., : n * bits]
    shifts = torch.arange(bits, dtype=torch.uint8, device=packed.device)
    return (stream.reshape(*lead, n, bits) << shifts).sum(-1, dtype=torch.int32).to(torch.uint8)


class _RowQuantizer:
    method = ""
    n_codes: int  # codes per row, set by the subclass

    def __init__(self, dim: int, bits: int = 4, seed: int = 0, device=None) -> None:
        self.dim = _check_int("dim", dim, 2)
        self.bits = _check_int("bits", bits, MIN_BITS, MAX_BITS)
        self.seed = _check_int("seed", seed, 0)
        self.rotation = _cached_rotation(dim, seed).clone()  # clone: the cached copy must never be mutated

    def bytes_per_row(self) -> float:
        return float((self.n_codes * self.bits + 7) // 8 + _NORM_BYTES)

    def compression_vs_bf16(self) -> float:
        return 2 * self.dim / self.bytes_per_row()

    @property
    def device(self) -> torch.device:
        return self.rotation.device

    def _rotate_in(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"x.dtype must be a floating dtype, got {x.dtype}")
        if x.ndim == 0 or x.shape[-1] != self.dim:
            got = x.shape[-1] if x.ndim else "a 0-d tensor"
            raise ValueError(f"x.shape[-1]: expected dim={self.dim}, got {got}")
        if x.device != self.device:
            raise ValueError(f"x.device: expected {self.device}, got {x.device}")
        n_bad = int((~torch.isfinite(x)).sum())
        if n_bad:
            raise ValueError(f"x has {n_bad} non-finite values (NaN/inf)")
        return x.reshape(-1, self.dim).float() @ self.rotation.T  # math in fp32, whatever the input dtype

    def quantize(self, x: torch.Tensor) -> QuantizedRows:
        y = self._rotate_in(x)
        codes, norms = self._encode(y)
        n_big = int((norms > _FP16_MAX).sum())
        if n_big:
            raise ValueError(f"x has {n_big} rows whose norm exceeds the float16 max {_FP16_MAX} (norms are stored fp16)")
        lead = x.shape[:-1]
        return QuantizedRows(
            pack_codes(codes, self.bits).reshape(*lead, (self.n_codes * self.bits + 7) // 8),
            norms.to(NORM_DTYPE).reshape(lead),
            self.dim,
            self.bits,
            self.method,
        )

    def dequantize(self, q: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not isinstance(q, QuantizedRows):
            raise ValueError(f"q must be a QuantizedRows, got {type(q).__name__}")
        for field, want in (("method", self.method), ("dim", self.dim), ("bits", self.bits)):
            if getattr(q, field) != want:
                raise ValueError(f"q.{field}: expected {want!r}, got {getattr(q, field)!r}")
        n_bytes = (self.n_codes * self.bits + 7) // 8
        if q.codes.dtype != torch.uint8 or q.codes.ndim == 0 or q.codes.shape[-1] != n_bytes:
            raise ValueError(f"q.codes must be uint8 [..., {n_bytes}], got {q.codes.dtype} {tuple(q.codes.shape)}")
        if q.norms.shape != q.codes.shape[:-1]:
            raise ValueError(f"q.norms.shape: expected {tuple(q.codes.shape[:-1])}, got {tuple(q.norms.shape)}")
        if q.codes.device != self.device or q.norms.device != self.device:
            raise ValueError(f"q.codes/q.norms device: expected {self.device}, got {q.codes.device}/{q.norms.device}")
        lead = q.codes.shape[:-1]
        codes = unpack_codes(q.codes.reshape(-1, n_bytes), self.bits, self.n_codes).long()
        y = self._decode(codes, q.norms.reshape(-1).float())
        return (y @ self.rotation).reshape(*lead, self.dim).to(dtype)

    def to(self, device) -> _RowQuantizer:
        """Moves the rotation and codebooks; returns self."""
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
            elif isinstance(value, list):
                setattr(self, name, [v.to(device) for v in value])
        return self


class TurboQuant(_RowQuantizer):
    method = "turboquant"

    def __init__(self, dim: int, bits: int = 4, seed: int = 0, device=None) -> None:
        super().__init__(dim, bits, seed)
        self.n_codes = dim
        self.centroids, self.boundaries, self._expected = _turbo_codebook(dim, bits)
        self.to(device if device is not None else "cpu")

    def expected_rel_mse(self) -> float:
        """E||x - deq(q(x))||^2 / ||x||^2 from the codebook's distortion (exact, fp16 norm rounding aside)."""
        return self._expected

    def _encode(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        norms = torch.linalg.vector_norm(y, dim=-1)
        unit = y / norms.clamp_min(1e-30)[:, None]  # a zero row stays zero
        return torch.bucketize(unit, self.boundaries, out_int32=True), norms

    def _decode(self, codes: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        return self.centroids[codes] * norms[:, None]


class PolarQuant(_RowQuantizer):
    method = "polarquant"

    def __init__(self, dim: int, bits: int = 4, seed: int = 0, device=None) -> None:
        if isinstance(dim, int) and not isinstance(dim, bool) and (dim < 2 or dim & (dim - 1)):
            raise ValueError(f"dim must be a power of two >= 2 for PolarQuant, got {dim}")
        super().__init__(dim, bits, seed)
        self.levels = dim.bit_length() - 1
        self.n_codes = dim - 1  # dim/2 + dim/4 + ... + 1 angles
        books = [_polar_codebook(level, bits) for level in range(1, self.levels + 1)]
        self.centroids = [c for c, _, _ in books]
        self.boundaries = [b for _, b, _ in books]
        self._expected = sum(e for _, _, e in books)
        self.to(device if device is not None else "cpu")

    def expected_rel_mse(self) -> float:
        """Sum over levels of E[2 (1 - cos delta)]: first-order estimate of the relative MSE."""
        return self._expected

    def _encode(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, r = [], y
        for level in range(1, self.levels + 1):
            angle = torch.atan2(r[:, 1::2], r[:, 0::2])
            if level == 1:
                angle = torch.remainder(angle, 2 * math.pi)  # [0, 2pi); deeper levels are already in [0, pi/2]
            codes.append(torch.bucketize(angle, self.boundaries[level - 1], out_int32=True))
            r = torch.hypot(r[:, 0::2], r[:, 1::2])
        return torch.cat(codes, dim=-1), r[:, 0]

    def _decode(self, codes: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        offsets = [0]
        for level in range(1, self.levels + 1):
            offsets.append(offsets[-1] + (self.dim >> level))
        r = norms[:, None]
        for level in range(self.levels, 0, -1):  # invert from the top: one radius -> dim coordinates
            angle = self.centroids[level - 1][codes[:, offsets[level - 1] : offsets[level]]]
            r = torch.stack([r * torch.cos(angle), r * torch.sin(angle)], dim=-1).reshape(n, 2 * r.shape[-1])
        return r


def make_quantizer(method: str, dim: int, bits: int = 4, seed: int = 0, device=None) -> TurboQuant | PolarQuant:
    if method == "turboquant":
        return TurboQuant(dim, bits, seed, device)
    if method == "polarquant":
        return PolarQuant(dim, bits, seed, device)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
