"""Spatial (domain) parallelism: each volume split over a group of ranks, in D slabs, then D x H blocks.

With `parallel.spatial_shards = S` the world is a 2-D mesh, data-parallel × spatial (torch's
DeviceMesh; consecutive ranks share a volume). Rank i of a shard group holds planes
[i·D/S, (i+1)·D/S) of every volume of its data-parallel rank: its slab of the masks, of the input and of
every activation at full resolution; the parameters are whole on every rank. Each level of the U-Net
is split by its own `Grid` (`level_grid`): full resolution in D slabs; a deeper level in D slabs while
each keeps two planes, then (one-plane slabs, or fewer planes than ranks) in the D × H blocks whose
halo adds least (16 × 16 at scale 11 over 256 ranks), kept level after level where they tie; past that
(fewer voxels on a face than ranks) the level runs whole on every rank. What crosses block boundaries:

- a 3×3×3 convolution (padding 1) needs one plane (and, where H is split, one row) of each
  neighbour: `halo` sends this rank's first and last planes to its neighbours along D and receives
  theirs, then does the same with rows along H on the planes so extended, which brings the corners
  (batched isend/irecv of device tensors over the shard group: NCCL on GPUs, gloo on the CPU); zeros
  at the volume's faces, which is the convolution's own zero padding. The convolution then runs
  unchanged, on whatever ladder rung it picks (Triton or vendor), over the extended block, and what it
  computes beyond the block is dropped. The backward sends the halo's gradients back to their owners,
  which add them to their boundary planes (rows);
- GroupNorm's statistics, the loss's sums and the validation counts: each rank sums its block, and
  `all_sum` adds the ranks' partial sums **in rank order** (an all-gather, then a fixed-order sum), so
  a run at a fixed S is bitwise reproducible; its backward is the same fixed-order sum of the
  gradients, the exact adjoint of a sum over ranks;
- where a level is split differently from the one above it, the Down block's input and the Up block's
  transposed-convolution output move to the other split (`redistribute`: each rank sends every other
  the part of its block that lies in theirs; every voxel goes to one rank, so the backward is the same
  exchange reversed, exact);
- where a level runs whole, the Down block gathers its input whole on every rank of the group (its
  backward a fixed-order ring reduce-scatter, one block in flight), the levels below run whole and
  identically on each, and the Up block cuts its transposed convolution's output back to the block;
- nothing else: the 2×2×2 pool, the transposed convolution (kernel = stride = 2), the skip concat and
  the 1×1×1 head are local within a split.

Gradients: every rank of a shard group computes the same loss (from the reduced sums) and back-
propagates it, so the sum of the group's parameter gradients is S times the loss's gradient; DDP's
average over the whole world (data-parallel × spatial) therefore gives the data-parallel mean of the
per-volume gradients, as without sharding. Parameters, their checkpoints and the optimizer are the
unsharded ones: a run can resume at another shard count (not bitwise: the sums are split differently).

Why a thin layer of our own over torch.distributed rather than DTensor/ShardTensor: the ladder's
convolutions are custom autograd functions over raw tensors, and the only collectives this network
needs are a one-plane exchange and a fixed-order sum of a few statistics; wrapping every activation
in a distributed tensor type would route each ladder kernel through a sharding-propagation layer
that knows nothing of it, for no communication a plain isend/irecv does not already do.

The package: `mesh` (the shard groups and the 2-D mesh), `collectives` (halo exchange, fixed-order sums,
gather, redistribution: autograd functions over raw tensors), `modules` (the sharded convolutions and
GroupNorms, and `shard_model`, which turns a U-Net's modules into them). The loss over a split volume is
scaffold.loss.SegmentationLoss.split with `all_sum` as its reduction.
"""
from __future__ import annotations

from scaffold.model.grid import Grid, level_grid, level_grids
from scaffold.spatial.collectives import _ring_sum_slab, all_sum, gather_depth, halo, redistribute
from scaffold.spatial.mesh import Mesh, ShardGroup, make_mesh
from scaffold.spatial.modules import HaloConv3d, ShardedGroupNorm, shard_model

__all__ = ["Grid", "HaloConv3d", "Mesh", "ShardGroup", "ShardedGroupNorm", "_ring_sum_slab", "all_sum",
           "gather_depth", "halo", "level_grid", "level_grids", "make_mesh", "redistribute", "shard_model"]
