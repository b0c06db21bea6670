"""The C++ backend (chapter 9): the CPU kernel, built just in time, exact against
SciPy's k-d tree on random and awkward clouds; the CUDA source compiled by ``nvcc``
where it is installed, so that a syntax error in it never waits for a GPU."""

import shutil
import subprocess
import sysconfig

import pytest
import torch

cKDTree = pytest.importorskip("scipy.spatial").cKDTree

from extkernels.ops.cpp import build  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler on this machine",
)


def _clouds(kind: str, m: int = 300, n: int = 2000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r, q = torch.randn(n, 3, generator=g), torch.randn(m, 3, generator=g)
    if kind == "far":
        q = q * 50.0  # most queries far outside the cloud's box
    elif kind == "flat":
        r[:, 2] = 0.5
        q[:, 2] = 0.5 + 0.1 * q[:, 2]
    elif kind == "duplicates":
        r = r[: n // 20].repeat(20, 1)
    elif kind == "clusters":
        centres = torch.randn(3, 3, generator=g).repeat_interleave(n // 3 + 1, 0)[:n]
        r = centres + 1e-4 * torch.randn(n, 3, generator=g)
    elif kind == "offset":
        r, q = r + 1000.0, q + 1000.0
    return q.contiguous(), r.contiguous()


@pytest.mark.parametrize(
    "kind", ["random", "far", "flat", "duplicates", "clusters", "offset"]
)
@pytest.mark.parametrize("k", [1, 7])
def test_cpu_kernel_is_exact(kind, k):
    build.load()
    q, r = _clouds(kind)
    d, i = torch.ops.extkernels_cpp.knn(q, r, k)
    want, _ = cKDTree(r.double().numpy()).query(q.double().numpy(), k)
    want = torch.from_numpy(want).float().reshape(q.shape[0], k)
    torch.testing.assert_close(d, want, atol=1e-4, rtol=1e-5)
    # Every index lies at its distance (ties may pick either point).
    at = (q[:, None, :] - r[i]).norm(dim=-1)
    torch.testing.assert_close(at, d, atol=1e-4, rtol=1e-5)


def test_cpu_kernel_rejects_k_larger_than_the_cloud():
    build.load()
    q, r = _clouds("random", 5, 6)
    with pytest.raises(RuntimeError, match="k: expected 1 <= k <= 6"):
        torch.ops.extkernels_cpp.knn(q, r, 7)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_cuda_source_compiles(tmp_path):
    from torch.utils import cpp_extension

    # PyTorch's CPU wheels ship the CUDA headers but not the one that their CMake
    # build generates; an equivalent stands in for it.
    stub = tmp_path / "include" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text(
        "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"
    )
    includes = [tmp_path / "include", *cpp_extension.include_paths()]
    includes.append(sysconfig.get_paths()["include"])
    command = ["nvcc", "-std=c++17", "-c", str(build.CSRC / "knn_cuda.cu")]
    command += ["-o", str(tmp_path / "knn_cuda.o"), "-arch=sm_90"]
    command += [f"-I{p}" for p in includes]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "knn_cuda.o").stat().st_size > 0
