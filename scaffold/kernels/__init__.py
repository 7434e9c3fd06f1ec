"""Triton kernels, one operator per file; the convolutions in `conv/`, the helpers they all share in `lib/`.
They know nothing of the model or of training.

Each file opens with its algorithm in about ten lines, then the kernels, with the rest of the explanation
beside the code it explains, the launcher and an autograd-aware entry point; how tiles and forms were
chosen, with the timings, is in docs/kernels.md. `reference.py` holds the float64 references that the
tests compare against. On a machine without a GPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported), at tiny shapes.
"""
