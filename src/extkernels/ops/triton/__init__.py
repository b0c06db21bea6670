"""The ``triton`` backend (chapter 8, in progress): an exact kNN search written in
Triton, registered with ``torch.library.triton_op`` so that ``torch.compile`` traces
into its kernel launch. Not yet registered with the book's backends."""
