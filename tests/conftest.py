"""Shared fixtures: one small seeded problem, fast on two CPU cores, and the built
website."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

if not torch.cuda.is_available():
    # Triton's kernels run in its interpreter on CPU tensors. Read when a kernel is
    # decorated, so before the package (which imports its Triton backend) is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import extkernels  # noqa: E402


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's options): a worker per core without a GPU; on a GPU
    machine one process, so that no two tests share the GPU (memory, graphs)."""
    if torch.cuda.is_available():
        return 0
    return os.cpu_count() or 1


ROOT = Path(__file__).resolve().parents[1]

N_REF = 500
GRID_SIDE = 6
N_FEATS = 4


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def p_ref():
    return extkernels.reference_cloud(N_REF, seed=0)


@pytest.fixture
def p_query():
    return extkernels.query_grid(GRID_SIDE)


@pytest.fixture
def feats():
    return extkernels.features(N_REF, N_FEATS, seed=0)


@pytest.fixture
def small_problem():
    """The CPU problem shrunk further, for timing and variant tests."""
    return extkernels.problem().with_sizes(
        n_ref=300, n_ref_radius=300, grid_side=4, n_warmup=1, n_iters=2
    )


def devices(gpu_ok: bool | None = None, reason: str = "needs CUDA") -> list:
    """The CPU, and the GPU (marked `gpu`, skipped with ``reason`` unless ``gpu_ok``,
    by default where CUDA is available)."""
    ok = torch.cuda.is_available() if gpu_ok is None else gpu_ok
    marks = [pytest.mark.gpu, pytest.mark.skipif(not ok, reason=reason)]
    return ["cpu", pytest.param("cuda", marks=marks)]


#: The CPU, and the GPU where there is one (marked `gpu`).
DEVICES = devices()


def nvcc_compiles(
    source: Path, folders: list[Path], flags: list[str], tmp: Path
) -> None:
    """Compile the CUDA ``source`` for sm_90 with ``nvcc``, without optimising (a check
    that it compiles: optimising would only add time), against PyTorch's headers and
    ``folders``; fail with nvcc's errors."""
    from torch.utils import cpp_extension

    # PyTorch's CPU wheels ship the CUDA headers but not the one that their CMake
    # build generates; an equivalent stands in for it.
    stub = tmp / "include" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text(
        "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"
    )
    includes = [tmp / "include", *cpp_extension.include_paths()]
    includes += [sysconfig.get_paths()["include"], *folders]
    out = tmp / "kernels.o"
    command = ["nvcc", "-std=c++17", "-c", str(source), "-o", str(out), "-arch=sm_90"]
    command += [*flags, "-O0", "-Xcompiler", "-O0", "-Xcicc", "-O0", "-Xptxas", "-O0"]
    command += [f"-I{p}" for p in includes]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert out.stat().st_size > 0


def toc_files() -> list[str]:
    """The book's pages as `_toc.yml` names them: the root, then every chapter's
    `file:`."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [ch["file"] for ch in part["chapters"]]
    return files


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The website built once per session, strictly (-W -n); returns its html folder."""
    out = tmp_path_factory.mktemp("site")
    jb = shutil.which("jupyter-book") or str(
        Path(sys.executable).with_name("jupyter-book")
    )
    result = subprocess.run(
        [jb, "build", str(ROOT), "--path-output", str(out), "-W", "-n", "--keep-going"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, (
        f"website build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )
    return out / "_build" / "html"
