"""Helpers every kernel family uses: the device (`device`), index arithmetic (`indexing`), the [N, S, C]
view of a 5-D tensor (`layout`), exact dtype conversions (`rounding`), split reductions (`splits`), and
compiling a step's kernels ahead on a thread pool (`ahead`)."""
