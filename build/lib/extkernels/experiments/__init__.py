"""Chapter experiments: small studies that isolate one cost, driven from a chapter.

They sit above the library layers (data, models, ops, timing, profiling, plotting),
which never import them: :mod:`~.cuml_search` (chapter 3), :mod:`~.allocations`
(chapter 4), :mod:`~.warp_interop` (chapter 7).
"""
