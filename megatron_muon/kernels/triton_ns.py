"""Triton kernels for batched Newton-Schulz (docs/design.md#kernels).

One NS step on a batch of wide matrices X [b, s, N] (s <= N) is

    A = X X^T            s x s, symmetric          -> ``sym_gram``  (alpha=1, no Y)
    B = b A + c A A      s x s, symmetric (A = A^T) -> ``sym_gram``  (X := A, Y := A)
    X = a X + B X        s x N                      -> ``poly_update`` (matmul + epilogue)

Why two kernels and not three: ``A A`` equals ``A A^T`` because A is symmetric, so the
polynomial ``b A + c A A`` is the same "Gram plus scaled addend" product as X X^T and
reuses the symmetric kernel with an epilogue ``alpha * acc + beta * Y``.

Symmetry: ``sym_gram`` launches one program per *upper-triangle* tile (i <= j) only,
from a host-built list of tile coordinates, and stores each off-diagonal tile twice
(at (i, j) and, transposed, at (j, i)).  For T = ceil(s / BLOCK) tile rows this does
T (T + 1) / 2 tile products instead of T^2, i.e. a bit more than half the flops of
the two symmetric products (diagonal tiles are computed in full).

All accumulation is fp32 (``tl.dot``); outputs are rounded to the storage dtype
exactly where the torch reference rounds (A, B and X are each stored in the compute
dtype), so bf16 results track ``newton_schulz(..., dtype=torch.bfloat16)``.  One
exception: for c = 0 (``cubic``) B = b A is not materialised, b is applied in fp32
inside the update (one rounding fewer than the reference).  Tall inputs are transposed
once into a contiguous wide copy (fused with the Frobenius normalisation).

Triton is imported guardedly: ``import megatron_muon.kernels`` never imports this
module (the backend imports it on first use).  ``triton.jit`` reads
``TRITON_INTERPRET`` when the decorator runs, i.e. when this module is first
imported; ``INTERPRETED`` records which mode the kernels were built in.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_muon.kernels.triton_config import TritonConfig

try:  # guarded: the package must import on machines without triton
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = [
    "HAVE_TRITON",
    "INTERPRETED",
    "TritonConfig",
    "default_config",
    "sym_gram",
    "poly_update",
    "triton_newton_schulz",
]


def default_config(dtype: torch.dtype, interpreted: bool) -> TritonConfig:
    """Tiles that are reasonable without tuning: tiny under the interpreter (each program is
    simulated in numpy, so fewer, smaller tiles are faster), big tensor-core tiles on GPU
    (fp32 gets a shorter K tile so three pipeline stages fit in shared memory)."""
    if interpreted:
        return TritonConfig(block=16, block_k=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return TritonConfig(block=128, block_k=32, num_warps=8, num_stages=3)
    return TritonConfig(block=128, block_k=64, num_warps=8, num_stages=3)


def _fp32_precision() -> str:
    """Match torch's fp32 matmul setting: 'highest' is exact fp32 ('ieee'), anything else
    lets torch use TF32 and so may we.  (The interpreter ignores it: numpy is exact.)"""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


if HAVE_TRITON:

    @triton.jit
    def _sym_gram_kernel(
        x_ptr, y_ptr, c_ptr, tile_i_ptr, tile_j_ptr,
        S, K,
        sxb, sxm, sxk,
        syb, sym, syn,
        scb, scm, scn,
        alpha, beta,
        HAS_Y: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """C[b] = alpha * X[b] X[b]^T (+ beta * Y[b]) for one upper-triangle tile (i <= j),
        written at (i, j) and mirrored to (j, i)."""
        t = tl.program_id(0)
        bid = tl.program_id(1).to(tl.int64)
        ti = tl.load(tile_i_ptr + t)
        tj = tl.load(tile_j_ptr + t)
        rows = ti * BLOCK + tl.arange(0, BLOCK)
        cols = tj * BLOCK + tl.arange(0, BLOCK)
        ks = tl.arange(0, BLOCK_K)
        x_base = x_ptr + bid * sxb
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            lhs = tl.load(x_base + rows[:, None] * sxm + kk[None, :] * sxk,
                          mask=(rows[:, None] < S) & (kk[None, :] < K), other=0.0)
            rhs = tl.load(x_base + cols[None, :] * sxm + kk[:, None] * sxk,
                          mask=(cols[None, :] < S) & (kk[:, None] < K), other=0.0)
            if UPCAST:  # interpreter: its numpy dot mishandles bf16 (stored as uint16)
                lhs = lhs.to(tl.float32)
                rhs = rhs.to(tl.float32)
            acc = tl.dot(lhs, rhs, acc, input_precision=PRECISION)
        acc = acc * alpha
        inside = (rows[:, None] < S) & (cols[None, :] < S)
        if HAS_Y:
            y = tl.load(y_ptr + bid * syb + rows[:, None] * sym + cols[None, :] * syn,
                        mask=inside, other=0.0)
            acc += beta * y.to(tl.float32)
        out = acc.to(c_ptr.dtype.element_ty)
        c_base = c_ptr + bid * scb
        tl.store(c_base + rows[:, None] * scm + cols[None, :] * scn, out, mask=inside)
        if ti != tj:  # mirror: element (r, c) of this tile is C[c, r]; not on the diagonal
            tl.store(c_base + rows[:, None] * scn + cols[None, :] * scm, out, mask=inside)

    @triton.jit
    def _poly_update_kernel(
        b_ptr, x_ptr, o_ptr,
        S, N,
        sbb, sbm, sbk,
        sxb, sxm, sxn,
        sob, som, son,
        a, alpha,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    ):
        """O[b] = a * X[b] + alpha * B[b] X[b] for one BLOCK_M x BLOCK_N output tile: the
        matmul's epilogue reads the X tile once more instead of a separate axpby pass."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        bid = tl.program_id(2).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        b_base = b_ptr + bid * sbb
        x_base = x_ptr + bid * sxb
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, S, BLOCK_K):
            kk = k0 + ks
            lhs = tl.load(b_base + rows[:, None] * sbm + kk[None, :] * sbk,
                          mask=(rows[:, None] < S) & (kk[None, :] < S), other=0.0)
            rhs = tl.load(x_base + kk[:, None] * sxm + cols[None, :] * sxn,
                          mask=(kk[:, None] < S) & (cols[None, :] < N), other=0.0)
            if UPCAST:  # interpreter: its numpy dot mishandles bf16 (stored as uint16)
                lhs = lhs.to(tl.float32)
                rhs = rhs.to(tl.float32)
            acc = tl.dot(lhs, rhs, acc, input_precision=PRECISION)
        inside = (rows[:, None] < S) & (cols[None, :] < N)
        x = tl.load(x_base + rows[:, None] * sxm + cols[None, :] * sxn, mask=inside, other=0.0)
        out = a * x.to(tl.float32) + alpha * acc
        tl.store(o_ptr + bid * sob + rows[:, None] * som + cols[None, :] * son,
                 out.to(o_ptr.dtype.element_ty), mask=inside)


#: True when the kernels above were decorated with TRITON_INTERPRET=1 (they run on CPU
#: tensors, simulated in numpy); read off the decorated object rather than the environment.
INTERPRETED: bool = HAVE_TRITON and type(_sym_gram_kernel).__name__ == "InterpretedFunction"


def _require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the triton NS backend needs the 'triton' package, which is not importable")


_TILE_CACHE: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _upper_tiles(n_tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j) coordinates of the upper-triangle tiles, cached per size and device so the
    host does not rebuild them every NS step."""
    key = (n_tiles, str(device))
    hit = _TILE_CACHE.get(key)
    if hit is None:
        i, j = torch.triu_indices(n_tiles, n_tiles)
        hit = (i.to(torch.int32).to(device), j.to(torch.int32).to(device))
        _TILE_CACHE[key] = hit
    return hit


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision only matters for fp32 operands; for bf16/fp16 pass triton's
    default ("tf32", ignored there) so 16-bit dots take the usual tensor-core path."""
    return _fp32_precision() if dtype == torch.float32 else "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    """Under the interpreter, feed tl.dot fp32 tiles: triton's numpy dot multiplies the raw
    uint16 storage of bf16/fp16.  Exact anyway: a bf16 x bf16 product fits in fp32, which is
    also what tensor cores compute before their fp32 accumulation."""
    return INTERPRETED and dtype != torch.float32


def sym_gram(x: torch.Tensor, out: torch.Tensor, cfg: TritonConfig, alpha: float = 1.0,
             y: Optional[torch.Tensor] = None, beta: float = 0.0) -> torch.Tensor:
    """out[b] = alpha * x[b] x[b]^T + beta * y[b]  (x: [b, s, K], out/y: [b, s, s])."""
    _require_triton()
    bsz, s, k = x.shape
    n_tiles = triton.cdiv(s, cfg.block)
    ti, tj = _upper_tiles(n_tiles, x.device)
    yy = out if y is None else y  # dummy pointer when HAS_Y is False
    grid = (ti.numel(), bsz)
    _sym_gram_kernel[grid](
        x, yy, out, ti, tj, s, k,
        x.stride(0), x.stride(1), x.stride(2),
        yy.stride(0), yy.stride(1), yy.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        float(alpha), float(beta),
        HAS_Y=y is not None, BLOCK=cfg.block, BLOCK_K=cfg.block_k,
        PRECISION=_precision(x.dtype), UPCAST=_upcast(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def poly_update(b: torch.Tensor, x: torch.Tensor, out: torch.Tensor, cfg: TritonConfig,
                a: float, alpha: float = 1.0) -> torch.Tensor:
    """out[b] = a * x[b] + alpha * b[b] @ x[b]  (b: [b, s, s], x/out: [b, s, N])."""
    _require_triton()
    bsz, s, n = x.shape
    grid = (triton.cdiv(s, cfg.block), triton.cdiv(n, cfg.block), bsz)
    _poly_update_kernel[grid](
        b, x, out, s, n,
        b.stride(0), b.stride(1), b.stride(2),
        x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        float(a), float(alpha),
        BLOCK_M=cfg.block, BLOCK_N=cfg.block, BLOCK_K=cfg.block_k,
        PRECISION=_precision(x.dtype), UPCAST=_upcast(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def triton_newton_schulz(x: torch.Tensor, coeffs: list[tuple[float, float, float]], eps: float,
                         dtype: Optional[torch.dtype], cfg: Optional[TritonConfig] = None
                         ) -> torch.Tensor:
    """NS on x [b, m, n] with the Triton kernels; same maths and rounding points as
    ``megatron_muon.core.newton_schulz.newton_schulz``.  Returns [b, m, n] in x's dtype."""
    _require_triton()
    if not x.is_cuda and not INTERPRETED:
        raise RuntimeError(
            "triton NS kernels need a CUDA tensor, or TRITON_INTERPRET=1 set before "
            "megatron_muon.kernels.triton_ns was first imported (triton.jit reads it then)"
        )
    cdtype = dtype or x.dtype
    cfg = cfg or default_config(cdtype, INTERPRETED)
    X = x.to(cdtype)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-2, -1)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    X = (X / (norm + eps)).contiguous()
    bsz, s, _ = X.shape
    A = torch.empty((bsz, s, s), dtype=cdtype, device=X.device)
    B = torch.empty_like(A)
    X_next = torch.empty_like(X)
    for a, b, c in coeffs:
        sym_gram(X, A, cfg)
        if c != 0.0:
            sym_gram(A, B, cfg, alpha=c, y=A, beta=b)  # B = c A A^T + b A, A symmetric
            poly_update(B, X, X_next, cfg, a=a, alpha=1.0)
        else:  # cubic: B = b A, fold b into the update instead of materialising B
            poly_update(A, X, X_next, cfg, a=a, alpha=b)
        X, X_next = X_next, X
    if tall:
        X = X.transpose(-2, -1)
    return X.to(x.dtype)
