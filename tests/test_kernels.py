"""Batched NS backends: agreement with an independent fp64 Newton-Schulz loop written here
(``ns_fp64``), coefficient behaviour, errors, Triton, and Gram Newton-Schulz against
standard NS (exactness, fp32 / bf16 accuracy, flops).

Every backend (the reference ``newton_schulz``, torch_batched, torch_loop, torch_gram,
'auto', and Triton under TRITON_INTERPRET=1) is held to ``ns_tolerance``, derived from its
compute precision (see there), against ``ns_fp64``, which imports only the coefficient
table: a mistake shared by every backend (they all call ``newton_schulz`` or its
coefficient resolution) fails there, where comparing the backends with ``newton_schulz``
would not.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_muon.kernels import available_backends, batched_newton_schulz, get_backend
from megatron_muon.kernels.backends import torch_batched, torch_gram, torch_loop
from megatron_muon.core.newton_schulz import (COEFFICIENT_SETS, FIXED_STEP_SETS, default_gram_restart,
                                         newton_schulz, ns_flops, resolve_coefficients)

REPO = Path(__file__).resolve().parents[1]
HAVE_TRITON = importlib.util.find_spec("triton") is not None

# (batch or None for a plain matrix, m, n): wide, tall, square, batch 1 and 3, odd sizes
SHAPES = [(None, 24, 56), (None, 56, 24), (1, 32, 64), (3, 64, 32), (3, 48, 48), (1, 40, 72), (3, 20, 36)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _input(batch, m, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (m, n) if batch is None else (batch, m, n)
    return torch.randn(*shape, generator=g)


#: Emerging-Optimizers' rule past a table's end (its ``newton_schulz``): these sets repeat
#: their last triple, every other one starts again from its first.
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")


def ns_fp64(x: torch.Tensor, name: str, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz written out in fp64, from the coefficient table alone: per matrix
    X = U / (||U||_F + eps), transposed if tall; per step (a, b, c) (the table's i-th
    triple; past its end its last one for ``REPEAT_LAST``, else the table again from the
    start) A = X X^T, B = b A + c A^2, X = a X + B X."""
    table = COEFFICIENT_SETS[name]
    X = x.double() if x.ndim == 3 else x.double().unsqueeze(0)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.transpose(-2, -1)
    X = X / ((X * X).sum(dim=(-2, -1), keepdim=True).sqrt() + eps)
    for i in range(steps):
        a, b, c = table[min(i, len(table) - 1)] if name in REPEAT_LAST else table[i % len(table)]
        A = X @ X.transpose(-2, -1)
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if tall:
        X = X.transpose(-2, -1)
    return X if x.ndim == 3 else X.squeeze(0)


U32, U_BF16 = 2.0 ** -24, 2.0 ** -8  # unit roundoffs (half an ULP at 1.0)


def ns_tolerance(dtype: torch.dtype, steps: int, long_side: int) -> float:
    """Relative Frobenius distance a backend computing NS in ``dtype`` may have from the
    exact (fp64) result on the well-conditioned inputs here (Gaussian: the exact map's
    slope on their singular values, about 1 on the band NS converges to, neither grows nor
    damps an error much, so each step adds its own rounding).  A step makes three products
    (A, B, the new X) and rounds each: in fp32 each sums up to ``long_side`` terms, a
    relative error of ~sqrt(long_side) U32 (random-sign roundings); in bf16 (CPU GEMMs and
    Triton's tl.dot accumulate in fp32) one rounding of the output, U_BF16, plus that fp32
    sum.  Two of those three errors reach X at full size (the third, A's, enters through
    B X damped by |c| A^2's share), so per step 2 (u + sqrt(long_side) U32), times the
    steps: 70..190 U32 in fp32, 10..20 U_BF16 in bf16 for the shapes and step counts here.
    Measured, worst over those shapes and coefficient sets: 0.44 of the bound in bf16 (the
    standard method; 0.30 Gram), 0.40 in fp32 (Gram; 0.22 standard), both with 'simple'."""
    u = U_BF16 if dtype == torch.bfloat16 else U32
    return 2 * steps * (u + math.sqrt(long_side) * U32)


BACKENDS = ("torch_batched", "torch_loop", "torch_gram", "auto")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,steps", [("quintic", 5), ("simple", 5), ("polar_express", 8),
                                        ("cubic", 10), ("aol", 4),
                                        ("deepseekv4", 10), ("cubic5", 5)])
def test_backends_equal_an_independent_fp64_loop(name, steps, dtype):
    """Every torch backend and the reference, on wide, tall, square and batched inputs,
    within ``ns_tolerance`` of ``ns_fp64``; torch_loop is per matrix."""
    for shape in SHAPES:
        x = _input(*shape)
        exact = ns_fp64(x, name, steps)
        tol = ns_tolerance(dtype, steps, max(x.shape[-2:]))
        outs = {"reference": newton_schulz(x, steps=steps, coefficients=name, dtype=dtype)}
        for backend in BACKENDS:
            outs[backend] = batched_newton_schulz(x, steps=steps, coefficients=name,
                                                  dtype=dtype, backend=backend)
        for backend, out in outs.items():
            assert out.shape == x.shape and out.dtype == x.dtype, backend
            assert _rel(out, exact) < tol, (backend, shape, _rel(out, exact), tol)
        # the looped path really is per matrix: each slice is that matrix's NS alone
        if x.ndim == 3:
            for i in range(x.shape[0]):
                assert _rel(outs["torch_loop"][i], exact[i]) < tol, (shape, i)


@pytest.mark.timeout(30)
def test_backend_signature_and_tall_transpose():
    """Backends share fn(x[b,m,n], coeffs, eps, dtype); a tall input equals NS of its
    transpose, transposed back (the reference's tall handling)."""
    x = _input(2, 40, 16)
    coeffs = resolve_coefficients("simple", 3)
    for fn in (torch_batched, torch_loop):
        out = fn(x, coeffs, 1e-7, torch.float32)
        via_t = fn(x.transpose(1, 2).contiguous(), coeffs, 1e-7, torch.float32).transpose(1, 2)
        assert out.shape == (2, 40, 16)
        assert _rel(out, via_t) < 1e-6


def test_ns_in_workspace_is_bitwise_newton_schulz():
    """``newton_schulz_in_workspace`` (the owners' NS: every iterate and product in one
    caller's workspace, ``out=`` ops) runs the same ops on the same values in the same
    memory layouts as ``newton_schulz``, so the result is bitwise equal: fp32 and bf16,
    every coefficient set (cubic, cubic5: c = 0), wide, tall and square batches, and (for
    one set: the shape, not the scalars, decides it) the tall 2048 x 512 shape where bf16
    products on a transposed layout round differently on the CPU (which the workspace
    keeps for the first step, as ``newton_schulz`` does).  It writes nothing outside
    ``ns_workspace_numel`` elements and never writes ``x``."""
    from megatron_muon.core.newton_schulz import newton_schulz_in_workspace, ns_workspace_numel

    g = torch.Generator().manual_seed(0)
    shapes = [(3, 16, 48), (2, 48, 16), (4, 32, 32), (1, 256, 64), (5, 8, 8)]
    for dtype in (torch.float32, torch.bfloat16):
        for name in COEFFICIENT_SETS:
            for shape in shapes + [(1, 2048, 512)] * (name == "quintic"):
                x = torch.randn(*shape, generator=g)
                x0 = x.clone()
                need = ns_workspace_numel(*shape)
                ws = torch.full((need + 5,), 7.0, dtype=dtype)
                got = newton_schulz_in_workspace(x, ws, steps=5, coefficients=name, dtype=dtype)
                ref = newton_schulz(x, steps=5, coefficients=name, dtype=dtype)
                assert got.shape == shape and got.dtype == dtype
                assert torch.equal(got, ref), (dtype, name, shape)
                assert torch.equal(x, x0) and bool((ws[need:] == 7.0).all())
    with pytest.raises(ValueError, match="workspace must be"):
        newton_schulz_in_workspace(torch.randn(1, 8, 4), torch.empty(10), steps=1)
    with pytest.raises(ValueError, match="workspace must be"):
        newton_schulz_in_workspace(torch.randn(1, 8, 4), torch.empty(200), steps=1,
                                   dtype=torch.bfloat16)


@pytest.mark.timeout(60)
def test_ns_keeps_each_batch_shape_to_four_matmul_betas(monkeypatch):
    """oneDNN (the CPU's 16-bit matmuls) keeps one compiled kernel per distinct beta of a
    ``baddbmm`` for the process's life (~0.7 MiB each; docs/memory.md): per batch shape,
    a per-step coefficient set may use at most 2 betas for each of its two products (the
    rescaled iterate's 1 and the last step's), and a set that repeats one triple keeps
    the plain step's (b and a).  Fails if the plain step (5 betas per product for quintic)
    comes back.  And the rescaling is only a reassociation of scalars: in fp64 it is the
    plain iteration (``ns_fp64``) within 1e-13 relative (the scalars are formed with a few
    roundings of 2^-53 each and NS's per-step error slope is O(a) <= 9, so 8 steps grow
    them to ~1e-14 at most)."""
    from megatron_muon.core.newton_schulz import newton_schulz_in_workspace, ns_workspace_numel

    calls = []
    real = torch.baddbmm

    def recording(inp, b1, b2, *, beta=1, alpha=1, out=None):
        calls.append((tuple(b1.shape), tuple(b2.shape), float(beta)))
        return real(inp, b1, b2, beta=beta, alpha=alpha, out=out)

    monkeypatch.setattr(torch, "baddbmm", recording)
    x = _input(2, 32, 96)
    for name, steps, most in (("quintic", 5, 4), ("polar_express", 8, 4), ("simple", 5, 2)):
        for run in ("reference", "workspace"):
            calls.clear()
            if run == "reference":
                newton_schulz(x, steps=steps, coefficients=name, dtype=torch.bfloat16)
            else:
                ws = torch.empty(ns_workspace_numel(2, 32, 96), dtype=torch.bfloat16)
                newton_schulz_in_workspace(x, ws, steps=steps, coefficients=name,
                                           dtype=torch.bfloat16)
            assert len(calls) == 2 * steps and len(set(calls)) <= most, (name, run, set(calls))
    monkeypatch.setattr(torch, "baddbmm", real)
    for name, steps in (("quintic", 5), ("polar_express", 8)):
        for shape in ((3, 24, 56), (3, 56, 24)):
            x = _input(*shape).double()
            got = newton_schulz(x, steps=steps, coefficients=name, dtype=torch.float64)
            assert _rel(got, ns_fp64(x, name, steps)) < 1e-13, (name, shape)


def test_ns_function_offers_the_workspace_path_only_for_the_torch_standard_ns():
    """``compat.ns_function(cfg).in_workspace``: the owners' bounded-workspace NS where the
    call is the plain torch standard NS (bitwise equal to it), None where a tuner, Triton or
    Gram NS would run instead."""
    from types import SimpleNamespace

    from megatron_muon.megatron.compat import ns_function

    def cfg(**kw):
        base = dict(dmuon_ns_backend="auto", muon_ns_method="auto", dmuon_plan_cost="flops",
                    muon_fp32_matmul_prec="highest", dmuon_tuner_cache=None,
                    muon_num_ns_steps=5, muon_coefficient_type="quintic")
        return SimpleNamespace(**dict(base, **kw))

    for c in (cfg(), cfg(dmuon_ns_backend="torch"), cfg(muon_ns_method="standard")):
        fn = ns_function(c)
        assert fn.in_workspace is not None
        x = torch.randn(2, 24, 40)
        ws = torch.empty(4 * 2 * 24 * 40)
        assert torch.equal(fn.in_workspace(x, ws, 5, "quintic", 1e-7, torch.float32),
                           fn(x, 5, "quintic", 1e-7, torch.float32))
    for c in (cfg(muon_ns_method="gram"), cfg(dmuon_ns_backend="triton"),
              cfg(dmuon_plan_cost="tuner")):
        assert ns_function(c).in_workspace is None


@pytest.mark.timeout(30)
def test_explicit_coefficient_list_and_bf16_input():
    x = _input(2, 16, 24).bfloat16()
    out = batched_newton_schulz(x, steps=2, coefficients=[(3.0, -3.2, 1.2)], dtype=torch.float32)
    ref = newton_schulz(x, steps=2, coefficients=[(3.0, -3.2, 1.2)], dtype=torch.float32)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref)


# ---------------------------------------------------------------- coefficient behaviour
def _well_conditioned_inputs() -> dict[str, torch.Tensor]:
    """Inputs whose singular values (after NS's Frobenius normalisation) lie in roughly
    [0.06, 0.19]: Gaussian 64x256 and its tall twin (condition ~3), and an explicit
    U diag(logspace(1, 0.1)) V^T 64x128 (condition 10)."""
    g = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(2, 64, 64, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(2, 128, 64, generator=g, dtype=torch.float64))
    S = torch.logspace(0, -1, 64, dtype=torch.float64)
    return {
        "gauss_wide": torch.randn(2, 64, 256, generator=g),
        "gauss_tall": torch.randn(2, 256, 64, generator=g),
        "cond10": ((U * S) @ V.transpose(1, 2)).float(),
    }


# Bands measured on the inputs above (fp32 / bf16, min..max over all singular values):
#   simple k=5         0.682..1.134 / 0.679..1.136   -> (0.65, 1.20)
#   quintic k=5        0.978..1.032 / 0.975..1.034   -> (0.95, 1.06)
#   polar_express k=5  0.870..1.124 / 0.868..1.125   -> (0.84, 1.15)
#   polar_express k=8  |s-1| 1e-6   / 4.6e-3         -> 1e-3 / 1e-2
#   cubic k=30         |s-1| 1e-7   / 1.6e-3         -> 1e-4 / 5e-3
#   cans               not here, nor in the fp32 / bf16 backend and Gram tests: on these
#                      Gaussian inputs its second step takes singular values down to 0.036,
#                      next to a zero of p2(p1(s)), where one rounding can flip a singular
#                      direction's sign (bf16 vs fp64: 1.38 relative; a bf16 singular value
#                      of 1.94).  Held to its definition in fp64 (the polynomial test below)
#                      and to Emerging-Optimizers' table and schedule
#                      (test_coefficient_sets_are_emerging_optimizers').
#   aol k=4            0.987..1.024 / 0.985..1.024   -> (0.97, 1.04); at k=5 the cycle
#                      comes back to its first triple, p(1) = -0.585: 0.52..0.70, as in
#                      Emerging-Optimizers (AOL is a 4-step schedule)
#   deepseekv4 k=10    |s-1| 5.4e-4 / 5.5e-3         -> 1e-3 / 1e-2 (k=5: simple's band)
#   cubic5 k=5         0.774..1.300 / 0.768..1.300   -> (0.75, 1.32)
# A wrong table shows: e.g. 'simple' used for 'quintic' gives 0.68..1.13 (fails 0.95),
# 'quintic' repeated for polar_express's last steps leaves |s-1| ~3e-2 (fails 1e-3).
BANDS = [
    ("simple", 5, (0.65, 1.20), (0.65, 1.20)),
    ("quintic", 5, (0.95, 1.06), (0.95, 1.06)),
    ("polar_express", 5, (0.84, 1.15), (0.84, 1.15)),
    ("polar_express", 8, (1 - 1e-3, 1 + 1e-3), (1 - 1e-2, 1 + 1e-2)),
    ("cubic", 30, (1 - 1e-4, 1 + 1e-4), (1 - 5e-3, 1 + 5e-3)),
    ("aol", 4, (0.97, 1.04), (0.97, 1.04)),
    ("aol", 5, (0.50, 0.71), (0.50, 0.71)),
    ("deepseekv4", 10, (1 - 1e-3, 1 + 1e-3), (1 - 1e-2, 1 + 1e-2)),
    ("cubic5", 5, (0.75, 1.32), (0.75, 1.32)),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,steps,band32,band16", BANDS)
def test_coefficient_sets_singular_value_bands(name, steps, band32, band16, dtype):
    assert name in COEFFICIENT_SETS
    lo, hi = band32 if dtype == torch.float32 else band16
    for label, x in _well_conditioned_inputs().items():
        out = batched_newton_schulz(x, steps=steps, coefficients=name, dtype=dtype)
        sv = torch.linalg.svdvals(out.double())
        assert lo < sv.min().item() and sv.max().item() < hi, (label, sv.min().item(), sv.max().item())


@pytest.mark.timeout(30)
def test_cubic_converges_to_svd_polar_factor():
    """Classic NS (1.5, -0.5, 0) converges to U V^T: within 1e-4 after 30 fp32 steps
    (measured 2e-7), even for an ill-conditioned square input (condition 1e3)."""
    g = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))
    ill = ((U * torch.logspace(0, -3, 48, dtype=torch.float64)) @ V.T).float()
    for x in list(_well_conditioned_inputs().values()) + [ill]:
        out = batched_newton_schulz(x, steps=30, coefficients="cubic", dtype=torch.float32)
        u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
        assert (out.double() - u @ vh).abs().max().item() < 1e-4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(COEFFICIENT_SETS))
def test_singular_values_follow_the_scalar_polynomial(name):
    """NS acts on each singular value alone: s_out = p_k(...p_1(s / ||X||_F)) with
    p_i(s) = a s + b s^3 + c s^5.  In float64 this pins every (a, b, c) of the table to
    its step (wrong order, a wrong repeat of the last triple, a typo all show)."""
    # one past deepseekv4's 10 triples: every set's repeat / cycle rule runs (cubic5 runs
    # only at its 5 steps)
    steps = len(COEFFICIENT_SETS[name]) if name in FIXED_STEP_SETS else 11
    x = _input(2, 24, 40, seed=3).double()
    out = batched_newton_schulz(x, steps=steps, coefficients=name, dtype=torch.float64, eps=0.0)
    s = torch.linalg.svdvals(x) / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)[..., 0]
    for a, b, c in resolve_coefficients(name, steps):
        s = a * s + b * s**3 + c * s**5
    expected = s.abs().sort(dim=-1, descending=True).values
    assert torch.allclose(torch.linalg.svdvals(out), expected, rtol=1e-9, atol=1e-9)


@pytest.mark.timeout(60)
def test_coefficient_sets_are_emerging_optimizers(monkeypatch):
    """Every set Emerging-Optimizers (the Newton-Schulz of Megatron-Core's own Muon) knows
    is here with the same triples, and the schedule past a table's end (cycle, or repeat
    the last) is its schedule: its ``newton_schulz`` is run with a step function that
    records the (a, b, c) it is given, for 1..11 steps, and that list must equal
    ``resolve_coefficients`` exactly (what every path here runs; the polynomial test above
    holds ``newton_schulz`` to the list).  Skips where it is not installed (the
    megatron-core 0.16 lane)."""
    eo = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers.muon_utils")
    theirs = {k: v for k, v in eo._COEFFICIENT_SETS.items() if k != "custom"}
    assert set(theirs) <= set(COEFFICIENT_SETS), set(theirs) - set(COEFFICIENT_SETS)
    seen = []

    def recording_step(X, a, b, c, **_):
        seen.append((a, b, c))
        return X

    monkeypatch.setattr(eo, "newton_schulz_step", recording_step)
    for name, table in theirs.items():
        assert [tuple(t) for t in table] == list(COEFFICIENT_SETS[name]), name
        for steps in [len(table)] if name in FIXED_STEP_SETS else range(1, 12):
            seen.clear()
            eo.newton_schulz(torch.randn(8, 12), steps, coefficient_type=name)
            assert seen == resolve_coefficients(name, steps), (name, steps)
    with pytest.raises(ValueError, match="fixed 5-step"):
        resolve_coefficients("cubic5", 4)


# ---------------------------------------------------------------- errors
@pytest.mark.timeout(30)
def test_bad_inputs_give_clear_errors():
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match="ns_steps must be an integer >= 1"):
        batched_newton_schulz(x, steps=0)
    with pytest.raises(ValueError, match="unknown Newton-Schulz coefficient set 'nope'"):
        batched_newton_schulz(x, coefficients="nope")
    with pytest.raises(ValueError, match=r"\[m, n\] or a batch \[b, m, n\].*1-D"):
        batched_newton_schulz(torch.randn(16))
    with pytest.raises(ValueError, match="4-D"):
        batched_newton_schulz(torch.randn(2, 2, 4, 4))
    with pytest.raises(ValueError, match="empty matrix"):
        batched_newton_schulz(torch.randn(2, 0, 4))
    with pytest.raises(ValueError, match="floating-point"):
        batched_newton_schulz(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="unknown NS backend 'cuBLAS'"):
        batched_newton_schulz(x, backend="cuBLAS")
    with pytest.raises(ValueError, match="bad triton config"):
        get_backend("triton:100x16:w4:s2")
    assert batched_newton_schulz(torch.randn(0, 4, 8)).shape == (0, 4, 8)


@pytest.mark.timeout(30)
def test_triton_not_offered_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "triton" not in available_backends("cpu")
    assert available_backends("cpu")[:2] == ["torch_batched", "torch_loop"]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        batched_newton_schulz(torch.randn(16, 32), backend="triton")


@pytest.mark.timeout(30)
def test_import_does_not_import_triton():
    code = "import sys, megatron_muon.kernels as k; print('triton' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=25, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- Triton (interpreted)
def _run_interpreted(code: str, tmp_path: Path, timeout: int = 55, args: tuple = ()) -> dict:
    """Run ``code`` in a fresh interpreter with TRITON_INTERPRET=1 set before triton is
    imported (triton.jit reads it when a kernel is decorated) and return its JSON line.
    The code goes to a file because triton.jit needs the kernel's source file."""
    script = tmp_path / "interpreted_check.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_triton_jit_reads_interpret_flag_at_decoration_time(tmp_path):
    code = """
        import json, os
        os.environ.pop("TRITON_INTERPRET", None)
        import triton
        def f(x): pass
        compiled = type(triton.jit(f)).__name__
        os.environ["TRITON_INTERPRET"] = "1"
        interpreted = type(triton.jit(f)).__name__
        print(json.dumps({"before": compiled, "after": interpreted}))
    """
    res = _run_interpreted(code, tmp_path)
    assert res == {"before": "JITFunction", "after": "InterpretedFunction"}


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed")
def test_triton_interpreted_matches_torch(tmp_path):
    """Both kernels and the whole NS under the interpreter (16x16 tiles): wide, tall,
    batch 3, sizes that are not tile multiples (masks, 3x3 tile grid with mirrored
    off-diagonal tiles), the c=0 (cubic) path, fp32 and bf16; the NS results against
    ``ns_fp64`` within ``ns_tolerance`` (tl.dot accumulates in fp32 and rounds its output
    to the compute dtype, as the torch GEMMs do)."""
    code = """
        import json, sys, torch
        from megatron_muon.kernels import batched_newton_schulz, available_backends
        from megatron_muon.kernels import triton_ns
        res = {"interpreted": triton_ns.INTERPRETED, "available": available_backends("cpu")}
        g = torch.Generator().manual_seed(0)
        rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
        cfg = triton_ns.default_config(torch.float32, True)
        x = torch.randn(2, 40, 24, generator=g)
        y = torch.randn(2, 40, 40, generator=g); y = y + y.transpose(1, 2)
        a = torch.full((2, 40, 40), float("nan"))  # every tile must be written, lower ones by mirroring
        triton_ns.sym_gram(x, a, cfg)
        res["gram"] = rel(a, x @ x.transpose(1, 2))
        res["programs_per_matrix"] = triton_ns._upper_tiles(3, x.device)[0].numel()
        triton_ns.sym_gram(x, a, cfg, alpha=0.5, y=y, beta=-2.0)
        res["gram_epilogue"] = rel(a, 0.5 * x @ x.transpose(1, 2) - 2.0 * y)
        b = torch.randn(2, 40, 40, generator=g); o = torch.empty_like(x)
        triton_ns.poly_update(b, x, o, cfg, a=1.5, alpha=-0.25)
        res["update"] = rel(o, 1.5 * x - 0.25 * b @ x)
        runs = []
        for shape, coef, dt in [((16, 32), "simple", "float32"), ((32, 16), "simple", "float32"),
                                ((3, 16, 32), "quintic", "float32"), ((33, 20), "cubic", "float32"),
                                ((16, 32), "simple", "bfloat16"), ((2, 32, 16), "quintic", "bfloat16")]:
            x = torch.randn(*shape, generator=g)
            dtype = getattr(torch, dt)
            out = batched_newton_schulz(x, steps=2, coefficients=coef, dtype=dtype, backend="triton")
            runs.append((coef, dt, x, out))
        torch.save(runs, sys.argv[1])  # compared with ns_fp64 by the test
        print(json.dumps(res))
    """
    res = _run_interpreted(code, tmp_path, args=[str(tmp_path / "triton_ns.pt")])
    assert res.pop("interpreted") is True
    assert "triton" in res.pop("available")
    assert res.pop("programs_per_matrix") == 6  # 40 rows / 16-tiles: 3x3 grid, upper triangle only
    for key, err in res.items():  # single kernels against torch's fp32 products
        assert err < 1e-5, (key, err)
    runs = torch.load(tmp_path / "triton_ns.pt")
    assert len(runs) == 6
    for coef, dt, x, out in runs:
        dtype = getattr(torch, dt)
        assert out.shape == x.shape and out.dtype == x.dtype
        err, tol = _rel(out, ns_fp64(x, coef, 2)), ns_tolerance(dtype, 2, max(x.shape[-2:]))
        assert err < tol, (coef, dt, tuple(x.shape), err, tol)


# ---------------------------------------------------------------- Gram Newton-Schulz
# Same polynomial on the Gram matrix (docs/design.md#gram-newton-schulz).
NS_RUNS = [("quintic", 5), ("simple", 5), ("polar_express", 5), ("polar_express", 8), ("cubic", 10),
           ("deepseekv4", 10)]
GRAM_SHAPES = SHAPES + [(2, 64, 256), (2, 256, 64)]


def _spectrum_input(batch, m, n, spectrum, seed=0):
    """U diag(spectrum(s)) V^T with random orthonormal U, V (s = min(m, n)), in fp32."""
    g = torch.Generator().manual_seed(seed)
    s = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(batch or 1, m, s, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(batch or 1, n, s, generator=g, dtype=torch.float64))
    x = ((U * spectrum(s)) @ V.transpose(1, 2)).float()
    return x if batch else x[0]


def _power_law(s):  # sigma_i = 1 / i: a momentum-like spectrum, condition number s
    return 1.0 / torch.arange(1, s + 1, dtype=torch.float64)


def _cond_1e3(s):
    return torch.logspace(0, -3, s, dtype=torch.float64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("restart", [0, 1, 2, 3])
@pytest.mark.parametrize("name,steps", NS_RUNS)
def test_gram_equals_standard_in_exact_arithmetic(name, steps, restart):
    """In fp64 (unit roundoff 1.1e-16) the two methods agree to rounding: 1e-12 is 1e4 u,
    far above fp64 rounding amplified as in fp32 (~100 u, see below) and far below any
    algebra mistake (a wrong P, Q order or restart gives O(1))."""
    for shape in [(None, 24, 56), (None, 56, 24), (3, 48, 48), (3, 20, 36)]:
        x = _input(*shape).double()
        ref = newton_schulz(x, steps, name)
        out = newton_schulz(x, steps, name, method="gram", gram_restart=restart)
        assert out.shape == x.shape and out.dtype == x.dtype
        assert _rel(out, ref) < 1e-12, (shape, _rel(out, ref))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,steps", NS_RUNS)
def test_gram_fp32_within_1e5_of_standard(name, steps):
    """fp32 Gram (default restarts: every 3 steps for quintic and cubic, else 2) vs fp32
    standard NS: relative Frobenius distance < 1e-5, on Gaussian and power-law
    (sigma_i = 1/i) inputs, wide, tall, batched.

    Bound: each method is within ~5e-6 of the fp64 result here (measured: standard up to
    3.8e-6, Gram up to 5.1e-6; ~60-85 u32 = 2^-24 each: every step rounds X or Q to u32
    and the later steps' polynomial slope, up to a ~ 4-8, carries it on), so the two
    are within 1e-5 of each other; measured max 5.0e-6 (quintic, power law).  A mistake
    is O(1) off."""
    for shape in GRAM_SHAPES:
        for x in (_input(*shape), _spectrum_input(*shape, _power_law)):
            ref = newton_schulz(x, steps, name)
            out = newton_schulz(x, steps, name, method="gram")
            assert out.shape == x.shape and out.dtype == torch.float32
            assert _rel(out, ref) < 1e-5, (shape, _rel(out, ref))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,steps", NS_RUNS)
def test_gram_bf16_as_accurate_as_standard(name, steps):
    """bf16 Gram is no further from the fp64 result than bf16 standard NS, up to one bf16
    unit roundoff (2^-8).  Strict <= is not guaranteed: the two round at different points,
    so their distances (both ~1.5e-2 = 4 u here) differ by a fraction of u either way
    (measured: -1.3 u .. +0.8 u, polar_express the worst).  With G kept in bf16 instead
    of fp32 this failed by up to 7.7 u (docs/design.md#gram-newton-schulz)."""
    for shape in GRAM_SHAPES:
        for x in (_input(*shape), _spectrum_input(*shape, _power_law)):
            exact = newton_schulz(x.double(), steps, name)
            std = newton_schulz(x, steps, name, dtype=torch.bfloat16)
            gram = newton_schulz(x, steps, name, dtype=torch.bfloat16, method="gram")
            assert gram.dtype == torch.float32 and gram.shape == x.shape
            assert _rel(gram, exact) <= _rel(std, exact) + 2.0**-8, (shape, _rel(gram, exact), _rel(std, exact))


@pytest.mark.timeout(60)
def test_gram_restarts_keep_ill_conditioned_inputs_accurate():
    """Condition number 1e3: Gram's error between restarts grows with kappa^2 (the Gram
    matrix squares it), so without restarts fp32 Gram is 1e-4..3e-3 from the exact result
    (measured) while standard fp32 is within 1e-5; the default restarts keep it within
    standard's distance + 1e-5 (the tuner's fp32 allowance; measured at most +4.0e-6,
    quintic restarting every 3 steps)."""
    x = _spectrum_input(2, 64, 256, _cond_1e3)
    for name, steps in NS_RUNS[:4]:
        exact = newton_schulz(x.double(), steps, name)
        std = _rel(newton_schulz(x, steps, name), exact)
        assert std < 1e-5
        assert _rel(newton_schulz(x, steps, name, method="gram"), exact) <= std + 1e-5
        assert _rel(newton_schulz(x, steps, name, method="gram", gram_restart=0), exact) > std + 1e-5


@pytest.mark.timeout(60)
def test_leading_batch_dims_and_batched_entry_point():
    """[..., m, n]: every matrix is orthogonalised alone, by both methods; the batched
    entry point runs Gram on the batch (auto / torch_batched / torch_gram) or per matrix
    (torch_loop) and refuses Triton, which has no Gram kernel."""
    x = _input(6, 20, 36).reshape(2, 3, 20, 36)
    for method in ("standard", "gram"):
        out = newton_schulz(x, 5, "quintic", method=method)
        assert out.shape == x.shape
        for i in range(2):
            for j in range(3):
                assert _rel(out[i, j], newton_schulz(x[i, j], 5, "quintic", method=method)) < 1e-6
    y = _input(3, 40, 24)
    ref = newton_schulz(y, 5, "quintic", method="gram")
    for backend in ("auto", "torch_batched", "torch_gram", "torch_loop"):
        out = batched_newton_schulz(y, 5, "quintic", backend=backend, method="gram")
        assert _rel(out, ref) < 1e-6, backend
    assert torch.equal(batched_newton_schulz(y, 5, "quintic", backend="torch_gram"), ref)
    r0 = batched_newton_schulz(y, 5, "quintic", backend="torch_gram:r0")
    assert torch.equal(r0, newton_schulz(y, 5, "quintic", method="gram", gram_restart=0))
    with pytest.raises(ValueError, match="no Triton Gram kernel"):
        batched_newton_schulz(y, method="gram", backend="triton")
    with pytest.raises(ValueError, match="unknown Newton-Schulz method 'fast'"):
        newton_schulz(y, method="fast")
    with pytest.raises(ValueError, match="gram_restart must be an integer >= 0"):
        newton_schulz(y, method="gram", gram_restart=-1)
    with pytest.raises(ValueError, match="bad torch_gram config"):
        get_backend("torch_gram:2")


class _FlopCounter(torch.overrides.TorchFunctionMode):
    """Counts the flops of every (b)mm / baddbmm actually run (2 per multiply-add)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.bmm, torch.baddbmm):
            a, b = (args[0], args[1]) if func is torch.bmm else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        return func(*args, **kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("restart", [0, 1, 2, 3])
@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (40, 40)])
def test_ns_flops_counts_what_runs(shape, restart):
    """ns_flops(method=...) equals the matmul flops the implementation performs (quintic:
    c != 0), so the owner plan's cost model can price the chosen method."""
    steps = 5
    x = torch.randn(2, *shape)
    for method in ("standard", "gram"):
        with _FlopCounter() as counter:
            newton_schulz(x, steps, "quintic", method=method, gram_restart=restart)
        assert counter.flops == 2 * ns_flops(*shape, steps, method, gram_restart=restart), method
    # aspect ratio 4, 5 steps: gram needs 5/9 of the flops without restarts, 7/9 with the default
    assert ns_flops(512, 2048, 5, "gram", gram_restart=0) / ns_flops(512, 2048, 5) == pytest.approx(5 / 9)
    assert ns_flops(2048, 512, 5, "gram") / ns_flops(2048, 512, 5) == pytest.approx(7 / 9)
    assert ns_flops(2048, 512, 5, "gram", coefficients="quintic") / ns_flops(2048, 512, 5) == pytest.approx(6 / 9)
    assert ns_flops(64, 64, 5) == ns_flops(64, 64, 5, "standard") == 5 * 6 * 64**3  # unchanged


@pytest.mark.timeout(30)
def test_default_gram_restart_per_coefficient_set():
    """quintic and cubic restart every 3 steps, everything else every 2; explicit triples
    equal to a named set's get its period (the backends only see triples), and every
    path (newton_schulz, the torch_gram backend, ns_flops) uses the same default."""
    assert default_gram_restart("quintic") == default_gram_restart("cubic") == 3
    assert default_gram_restart("simple") == default_gram_restart("polar_express") == 2
    assert default_gram_restart(resolve_coefficients("quintic", 7)) == 3
    assert default_gram_restart([(3.0, -3.2, 1.2)]) == 2
    x = _input(2, 24, 56)
    for name in ("quintic", "polar_express"):
        r = default_gram_restart(name)
        ref = newton_schulz(x, 5, name, method="gram", gram_restart=r)
        assert torch.equal(newton_schulz(x, 5, name, method="gram"), ref)
        assert torch.equal(torch_gram(x, resolve_coefficients(name, 5), 1e-7, None), ref)
        assert ns_flops(24, 56, 5, "gram", coefficients=name) == ns_flops(24, 56, 5, "gram", gram_restart=r)
