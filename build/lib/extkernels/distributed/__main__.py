"""``python -m extkernels.distributed`` (chapter 13): see :mod:`~.command`."""

from .command import main

main()
