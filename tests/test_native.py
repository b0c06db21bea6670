"""The C++ libraries as a prebuilt wheel: ``native/`` builds a wheel with
this PyTorch; installed into a fresh virtual environment beside the package, the C++
and fused backends load its libraries instead of building, their operators give the
PyTorch reference's results and pass ``opcheck``; a wheel built from other sources or
for another PyTorch is refused with a warning."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT

from extkernels.ops import prebuilt

pytestmark = pytest.mark.slow

# Run in the fresh environment, with an empty extension cache: every backend on its
# operators, against the PyTorch backend, and opcheck on each operator.
CHECK = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch.library import opcheck
    import extkernels
    from extkernels.ops import registry
    from extkernels.ops.cpp import build as cpp_build

    p_ref = extkernels.reference_cloud(300, seed=0)
    p_query = extkernels.query_grid(5)
    feats = extkernels.features(300, 4, seed=0)
    args = {
        "knn": (p_query, p_ref, 5),
        "knn_aggregate": (p_query, p_ref, feats.requires_grad_(), 5, 0.1),
        "radius_aggregate": (p_query, p_ref, feats, 0.3, 0.1),
        "radius_search": (p_query, p_ref, 0.3),
    }
    def close(got, want):  # kNN: the distances (equally near neighbours may swap)
        got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
        return torch.allclose(got, want, atol=1e-5)

    report = {}
    for name in ("cpp", "fused"):
        backend = registry.get(name)
        for op, qualname in backend.operators.items():
            got = getattr(extkernels, op)(*args[op], backend=name)
            want = getattr(extkernels, op)(*args[op], backend="torch")
            opcheck(backend.operator(op), args[op])
            report[qualname] = close(got, want)
    report["prebuilt"] = str(cpp_build.prebuilt_path)
    report["package"] = os.path.dirname(extkernels.__file__)
    report["built"] = sorted(os.listdir(os.environ["TORCH_EXTENSIONS_DIR"]))
    print(json.dumps(report))
    """
)


def _run(*cmd, **kwargs):
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode:
        pytest.fail(f"{' '.join(cmd[:4])} ... failed:\n{done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    _run(
        sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation",
        "--no-deps", str(ROOT / "native"), "-w", str(out),
    )  # fmt: skip
    (path,) = out.glob("extkernels_native-*.whl")
    return path


def test_the_wheel_serves_both_libraries_in_a_fresh_environment(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv))
    python = str(venv / "bin" / "python")
    # This PyTorch and the package's dependencies come from the running environment:
    # a .pth puts its site-packages after the new one's (its own .pth files, an
    # editable install of the package among them, are not read), so the package and the
    # libraries are the ones installed here.
    purelib = _run(
        python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    ).stdout.strip()
    borrowed = os.path.dirname(os.path.dirname(torch.__file__))
    with open(os.path.join(purelib, "borrowed.pth"), "w") as pth:
        pth.write(borrowed + "\n")
    _run(python, "-m", "pip", "install", "-q", "--no-deps", str(ROOT), str(wheel))
    cache = tmp_path / "extensions"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCH_EXTENSIONS_DIR"] = str(cache)
    out = _run(python, "-c", CHECK, cwd=tmp_path, env=env).stdout
    report = json.loads(out.splitlines()[-1])
    assert report.pop("package").startswith(purelib), "not the installed package"
    assert report.pop("built") == [], "a library was built just in time"
    assert "extkernels_native" in report.pop("prebuilt")
    assert report and all(report.values()), report


def test_a_wheel_from_other_sources_is_refused_with_a_warning(monkeypatch, tmp_path):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "a.h").write_text("int a;")
    fake = type(sys)("extkernels_native")
    fake.BUILD = {
        "torch": torch.__version__,
        "cuda": False,
        "libraries": {"cpp": {"file": "_cpp.so", "fingerprint": "0" * 64}},
    }
    fake.library = lambda name: tmp_path / "_cpp.so"
    monkeypatch.setitem(sys.modules, "extkernels_native", fake)
    with pytest.warns(UserWarning, match="other sources or constants"):
        assert prebuilt.find("cpp", [src], [], cuda=False) is None
    fake.BUILD["libraries"]["cpp"]["fingerprint"] = prebuilt.fingerprint([src], [])
    assert prebuilt.find("cpp", [src], [], cuda=False) == tmp_path / "_cpp.so"
    fake.BUILD["torch"] = "1.0.0"
    with pytest.warns(UserWarning, match="built for torch 1.0.0"):
        assert prebuilt.find("cpp", [src], [], cuda=False) is None


def test_the_fingerprint_follows_sources_and_constants(tmp_path):
    (tmp_path / "k.cpp").write_text("int k;")
    first = prebuilt.fingerprint([tmp_path], ["-DX=1"])
    assert prebuilt.fingerprint([tmp_path], ["-DX=2"]) != first
    (tmp_path / "k.cpp").write_text("int k = 1;")
    assert prebuilt.fingerprint([tmp_path], ["-DX=1"]) != first
