"""``python -m extkernels.distributed``: see :mod:`~.command`."""

from .command import main

main()
