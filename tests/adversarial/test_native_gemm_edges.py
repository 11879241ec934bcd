"""Adversarial inputs to ``gemm.linear`` that the public API accepts (shape and dtype are
valid) and that the kernel once mishandled. The cases that crashed run in a subprocess so that
pytest survives a SIGSEGV / SIGFPE if they regress."""

import subprocess
import sys

import pytest
import torch

from kvserve.ops import gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason="no C compiler / KVSERVE_NATIVE=0")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_noncontiguous_bias_is_read_correctly():
    """A strided bias: ``linear`` once passed ``bias.contiguous().data_ptr()``, a temporary copy
    freed before the C call, so the kernel read freed memory (the first columns came out wrong)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 8, generator=g)
    b = torch.randn(192, generator=g)[::2]  # a strided view: valid shape and dtype, not contiguous
    x = torch.randn(3, 8, generator=g)
    got = gemm.linear(x, gemm.PanelWeight(w), b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_large_noncontiguous_bias_does_not_crash():
    """The same use-after-free with a large bias: the freed copy was unmapped (SIGSEGV)."""
    r = _run(
        "import torch\n"
        "from kvserve.ops import gemm as ng\n"
        "n = 4_000_000\n"
        "w = torch.randn(n, 1); b = torch.randn(2 * n)[::2]\n"
        "y = ng.linear(torch.ones(1, 1), ng.PanelWeight(w), b)\n"
        "assert torch.allclose(y[0], w[:, 0] + b)\n"
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])


def test_zero_in_features_does_not_crash():
    """``in_features == 0``: torch returns the bias (or zeros); the kernel's row chunk
    ``(1 << 18) / K`` once divided by zero (SIGFPE), even for M=0."""
    r = _run(
        "import torch\n"
        "from kvserve.ops import gemm as ng\n"
        "pw = ng.PanelWeight(torch.empty(5, 0))\n"
        "y = ng.linear(torch.empty(3, 0), pw, torch.ones(5))\n"
        "assert torch.equal(y, torch.ones(3, 5))\n"
        "assert ng.linear(torch.empty(0, 0), pw).shape == (0, 5)\n"
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-500:])
