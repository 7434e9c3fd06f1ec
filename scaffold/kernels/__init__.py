"""Triton kernels, one operator per file. They know nothing of the model or of training.

Each file opens with its algorithm, then the kernel, the launcher and an autograd-aware entry point.
`reference.py` holds the float64 references that the tests compare against. On a machine without a GPU the
kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), at tiny shapes.
"""
