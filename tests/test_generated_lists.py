"""The lists that name backends (the benchmark's variants, chapter 14's methods,
chapter 15's packaged projectors) are generated from the registry's records; these are
the book's, name for name and in order."""

from extkernels import variants as V
from extkernels.experiments import geometry, shipping

BOOK_VARIANTS = [
    "knn/torch",
    "knn/torch+compile",
    "knn/cuml",
    "knn/cuml+compile",
    "knn/cuml-op",
    "knn/cuml-op+compile",
    "knn/cuml-op+compile+rmm",
    "knn/cuml-op+compile+rmm-rapids",
    "knn/triton",
    "knn/triton+compile",
    "knn/triton+reduce-overhead",
    "knn/cpp",
    "knn/cpp+compile",
    "knn/cpp+reduce-overhead",
    "knn/cpp+graphs",
    "knn/floor",
    "knn/floor+graphs",
    "knn/ptx",
    "knn/ptx+compile",
    "knn/ptx+graphs",
    "knn/fused",
    "knn/fused+reduce-overhead",
    "knn/fused+graphs",
    "knn/fused+compile+graphs",
    "knn/fused+compile+graphs+positions",
    "knn/fused+compile+graphs+inductor-defaults",
    "knn/fused+graphs@panda",
    "knn/fused+graphs@spitfire",
    "knn/fused-grid+graphs",
    "knn/fused-grid+graphs@panda",
    "knn/fused+graphs+jit",
    "knn/cpp+aoti",
    "knn/fused+compile",
    "knn/fused+aoti",
    "radius/torch",
    "radius/torch+compile",
    "radius/warp",
    "radius/warp+compile",
    "radius/warp-manual+compile",
    "radius/warp-saved+compile",
    "radius/warp+reduce-overhead",
    "radius/warp+1thread",
    "radius/warp+compile+1thread",
    "radius/warp+graphs",
    "radius/floor+1thread",
    "radius/fused",
    "radius/fused+reduce-overhead",
    "radius/fused+graphs",
    "radius/fused+compile+graphs",
    "radius/fused+compile+graphs+positions",
    "radius/fused+compile",
    "radius/fused+aoti",
    "radius/fused+graphs@panda",
    "radius/fused+graphs@outlier",
    "radius/floor",
    "radius/floor+graphs",
]

BOOK_METHODS = {
    "fused": ("fused", {}),
    "fused-grid": ("fused", {"index": "grid"}),
    "cpp": ("cpp", {}),
    "triton": ("triton", {}),
    "cuml": ("cuml", {}),
}

BOOK_SHIPPED = {
    "torch": ("knn", (), None),
    "cuml": ("knn", (), "extkernels.ops.cuml"),
    "triton": ("knn", (), "extkernels.ops.triton"),
    "cpp": ("knn", ("cpp",), None),
    "ptx": ("knn", ("cpp",), "extkernels.ops.ptx"),
    "fused": ("knn", ("cpp", "fused"), None),
    "warp": ("radius", (), "extkernels.ops.warp"),
}


def test_the_variants_are_the_books_in_its_order():
    assert [v.name for v in V.VARIANTS] == BOOK_VARIANTS


def test_the_geometry_methods_are_the_books_in_its_order():
    assert list(geometry.METHODS.items()) == list(BOOK_METHODS.items())


def test_the_packaged_backends_are_the_books_in_its_order():
    assert list(shipping.shipped().items()) == list(BOOK_SHIPPED.items())
