"""The C++ operator libraries of ``extkernels``, built ahead of time.

``BUILD`` says what they were built for (the PyTorch version, CUDA or not, and a
fingerprint of each library's sources and constants); :func:`library` gives a
library's file, which ``extkernels`` loads with ``torch.ops.load_library`` when
``BUILD`` matches (``extkernels.ops.prebuilt``). Importing this package loads nothing.
"""

from pathlib import Path

from ._build import BUILD

__all__ = ["BUILD", "library"]


def library(name: str) -> Path:
    """The file of library ``name`` (``"cpp"`` or ``"fused"``)."""
    return Path(__file__).parent / BUILD["libraries"][name]["file"]
