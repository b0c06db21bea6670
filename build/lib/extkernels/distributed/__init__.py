"""The projector on several devices with ``torch.distributed`` (chapter 13).

- :mod:`~.shards`: which rows a rank holds, and the functional collectives that move
  them (an all-gather of neighbour candidates, a differentiable reduce-scatter);
- :mod:`~.ops`: the exact sharded kNN (a search per shard, then a global top-k merge),
  the partial sums of both aggregations, and :class:`~.ops.ShardedProjector`;
- :mod:`~.setups`: one rank's share of the running example in each layout (``single``,
  ``queries`` with the cloud replicated, ``reference`` with the cloud sharded);
- :mod:`~.exactness`: each layout against the projector in one piece;
- :mod:`~.bench`: strong and weak scaling, and the communication share;
- :mod:`~.launch`: fresh ranks (``torch.multiprocessing``, or ``torchrun``), NCCL on
  GPUs and gloo on the CPU.

The command::

    python -m extkernels.distributed check --world 2
    python -m extkernels.distributed bench --world 2 --sizes 100000,10000000 --repeats 3
    torchrun --nproc-per-node 2 -m extkernels.distributed check
"""

from .launch import NO_MULTICAST, spawn
from .ops import ShardedProjector, knn_partial, radius_partial, sharded_knn
from .setups import LAYOUTS, make_setup

__all__ = [
    "NO_MULTICAST",
    "spawn",
    "ShardedProjector",
    "sharded_knn",
    "knn_partial",
    "radius_partial",
    "LAYOUTS",
    "make_setup",
]
