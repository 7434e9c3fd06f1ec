"""The training step's memory, predicted from the model's shapes: the byte model that
`model.recompute=auto`, `cuda_graph=auto` and the scale check (scaffold.plan) decide by.

The step is written down as the list of operations the U-Net runs (convolutions, GroupNorm+ReLU, pool,
transposed conv, concat, the loss head), each with the bytes of the tensors it creates and of those its
backward keeps (autograd's saved tensors, under bf16 autocast or fp32, for the rungs that run it). A
walk over that list, forward then backward, as autograd frees and allocates, gives the peak:

    peak = parameters (4 B each) + Adam state (8 B) + data kept on the device
         + max over the step of (live activations + gradients in flight + parameter gradients so far)

What the backward keeps, per element of a level-l tensor with w_l channels (a = 2 bytes under bf16
autocast, 4 in fp32), on the CUDA ladder (our Triton GroupNorm keeps its input only and recomputes the
ReLU; the pool keeps a uint8 index; the concat keeps nothing):
    stem and encoder levels: conv inputs (a), GroupNorm inputs (a) - 4 tensors per DoubleConv (the pool
        output at half width, conv1 out, norm1 out, conv2 out) plus the pool's 1-byte index
    decoder levels: the concat (2 w_l channels) + conv1 out + norm1 out + conv2 out, and the block's
        output, which the next transposed conv (or the 1x1x1 head) keeps
so with U = N·D·H·W·w_0 bytes (level 0, bf16) the kept activations are about
    off:    18 U at level 0 + 19.5 U/4^l per deeper level  ≈ 24.5 U
    blocks: 6 U at level 0 (the concat and the output) + 7.5 U/4^l deeper  ≈ 8.5 U
    (each DoubleConv keeps only its input; its four inner tensors are recomputed in the backward, so
    the backward of the full-resolution decoder block holds them again, 8 U, at its peak)
plus bf16 copies of the conv weights (2 B per parameter, off only). At scale 8 (U = 1 GiB, 361 M
parameters) that is the measured 29 GiB of the graphed step; at scale 9 (U = 8 GiB) about 220 GiB.

Under FSDP (`StepShape.fsdp_world` ranks, scaffold.fsdp) the parameters, their gradients and Adam's
moments are each 1/W per rank, there are no DDP buckets, working copies or warm-up copy, and the units
being all-gathered are whole while their ops run (`fsdp_units`, `fsdp_whole`: the running unit's
parameters, in the backward its gradients too, and its two neighbours), counted op by op in the walk.

Three other things hold memory: a CUDA graph keeps its pool (the step's activation peak) reserved
between replays, so what runs outside the graph (Adam's temporaries, the evaluation forward) comes on
top; the trainer keeps every mask of the dataset on the device; and its warm-up runs on a copy of the
model. `Estimate.need` counts them; `Estimate.max_allocated` is what torch.cuda.max_memory_allocated
reports for the step alone (the step benchmark's number).

Calibration: tests/test_memory_model.py counts the bytes autograd saves in a real forward
(torch.autograd.graph.saved_tensors_hooks, deduplicated by storage) on the CPU, at scales 3-5 with
torch's ops (exact) and at scale 3 with our Triton rungs in the interpreter (exact but for the loss's
class weights, 4 bytes a class, which the model leaves out), and checks this model's count against
them; `python -m scaffold.bench.memory` compares the prediction with the measured peak on the GPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Optional

from scaffold.model.grid import level_grids

GiB = 1 << 30
# Share of the free memory a plan may use: the caching allocator rounds blocks up and fragments, and a
# few kernels (cuDNN's directions of the routed convs) take workspace this model does not list.
HEADROOM = 0.90
# The model's stated accuracy: the scale check rejects a config only when even the prediction minus
# this share exceeds the device, so an estimate that errs high never blocks a run that would fit.
TOLERANCE = 0.15


@dataclass(frozen=True)
class StepShape:
    """What the memory of one training step depends on."""

    scale: int
    bottleneck: int = 3
    base_width: int = 64
    groups: int = 8
    in_channels: int = 3
    n_classes: int = 6
    batch: int = 1
    amp: bool = True  # bf16 autocast (2-byte activations); False: fp32
    device: str = "cuda"  # "cuda" | "cpu": which ops autocast upcasts (GroupNorm on CUDA only)
    fused: bool = True  # our Triton rungs for GroupNorm, pool, concat and loss; False: torch's ops
    recompute: str = "off"  # "off" | "blocks"
    graph: bool = False  # the step captured as a CUDA graph
    data_bytes: int = 0  # masks kept on the device beside the step (the trainer keeps the dataset)
    data_parallel: bool = False  # under DDP, whose gradient buckets hold the gradients (`.grad` views them)
    ask_copies: bool = False  # one CUDA process, whose trainer asks for bf16 working copies of the
    # conv weights (scaffold.kernels.adam); whether the step runs on them: `working`
    depth_shards: int = 1  # D split over this many devices (scaffold.spatial): each holds all the
    # parameters, a D-slab of every volume and of each split level's activations (a level is split
    # while its edge has at least one plane per shard; deeper levels run whole on every shard)
    fuse_head: bool = True  # the model fuses its last GroupNorm with the head (UNet3d.fuse_head)
    head_on_vendor: bool = False  # the 1x1x1 head forced to vendor (ladder.conv=vendor): not fused
    fsdp_world: int = 1  # parameters, gradients and Adam state sharded over this many ranks (FSDP2,
    # parallel.fsdp); 1: replicated. Each U-Net block (and the root) is a unit, whole while it runs.

    @property
    def working(self) -> bool:
        """Whether the step runs on working copies, as scaffold.trainer.Trainer decides them: asked for,
        bf16 autocast, no recompute, volumes not split."""
        return self.ask_copies and self.amp and self.recompute == "off" and self.depth_shards == 1

    @property
    def rooms(self) -> bool:
        """Whether each skip is written with room for its concat's other half (UNet3d._skip_rooms): our
        rungs, no recompute, volumes not split, parameters not sharded."""
        return self.fused and self.recompute == "off" and self.depth_shards == 1 and self.fsdp_world == 1

    @property
    def head_to_block(self) -> bool:
        """Whether the U-Net hands its head to the last block (UNet3d._fuse_head): asked for, volumes
        not split. The block runs it fused (fused_head) or apart."""
        return self.fuse_head and self.depth_shards == 1

    @property
    def fused_head(self) -> bool:
        """Whether the last GroupNorm + ReLU and the 1x1x1 head run as one (UNet3d._fuse_head): asked
        for, our rungs, the head not on vendor, volumes not split (recomputed or not)."""
        return self.fuse_head and self.fused and not self.head_on_vendor and self.depth_shards == 1

    @property
    def levels(self) -> int:
        return self.scale - self.bottleneck

    def grid(self, level: int) -> Optional[tuple[int, int]]:
        """(D blocks, H blocks) of `level`'s tensors, None where they are whole on every device
        (scaffold.model.grid.level_grid: D slabs, then the most compact D x H blocks where slabs thin)."""
        if self.depth_shards <= 1:
            return None
        g = level_grids(self.scale, level, self.depth_shards)[level]
        return None if g is None else (g.pd, g.ph)

    def split(self, level: int) -> bool:
        """Whether `level`'s tensors are split over the shard group."""
        return self.grid(level) is not None

    def voxels(self, level: int, whole: bool = False) -> int:
        """Voxels per device of a tensor at `level`: its block where the level is split, the whole
        volume where it is not or when `whole`."""
        edge = 2 ** (self.scale - level)
        grid = self.grid(level)
        if whole or grid is None:
            return self.batch * edge**3
        pd, ph = grid
        return self.batch * (edge // pd) * (edge // ph) * edge


# --- parameters ------------------------------------------------------------------------------------

def _double_conv_params(cin: int, cout: int) -> int:
    return 27 * cin * cout + 27 * cout * cout + 4 * cout  # two bias-free 3x3x3 convs, two GroupNorms


def param_count(scale: int, bottleneck: int = 3, base_width: int = 64, in_channels: int = 3,
                n_classes: int = 6) -> int:
    """UNet3d's parameter count (90,302,342 at scale 7 with the defaults)."""
    widths = [base_width * 2**i for i in range(scale - bottleneck + 1)]
    n = _double_conv_params(in_channels, base_width)
    for lo, hi in zip(widths, widths[1:]):
        n += _double_conv_params(lo, hi)  # Down
        n += hi * lo * 8 + lo + _double_conv_params(hi, lo)  # Up: transposed conv (bias) + DoubleConv
    return n + base_width * n_classes + n_classes


def fsdp_units(scale: int, bottleneck: int = 3, base_width: int = 64, in_channels: int = 3,
               n_classes: int = 6) -> list[int]:
    """Parameters of each FSDP unit in the order the forward runs them: the stem, the Down blocks, the
    Up blocks (deepest first), then the root's own (the 1x1x1 head). They sum to `param_count`."""
    widths = [base_width * 2**i for i in range(scale - bottleneck + 1)]
    downs = [_double_conv_params(lo, hi) for lo, hi in zip(widths, widths[1:])]
    ups = [hi * lo * 8 + lo + _double_conv_params(hi, lo) for lo, hi in zip(widths, widths[1:])]
    return [_double_conv_params(in_channels, base_width), *downs, *reversed(ups),
            base_width * n_classes + n_classes]


def fsdp_whole(units: list[int], backward: bool = True) -> list[int]:
    """Bytes of unsharded (all-gathered, fp32) units alive while an op of each unit runs: [the root's
    ops, unit 0's, unit 1's, ...]. In the forward the running unit and the next one, whose all-gather is
    issued ahead; in the backward the running unit's parameters and its unsharded gradients, the unit
    before it prefetched, and the unit after it, whose gradients may still be in their reduce-scatter.
    The root's (the head) stay whole throughout."""
    *blocks, root = units
    out = [4 * root]
    for i, n in enumerate(blocks):
        before = blocks[i - 1] if i > 0 else 0
        after = blocks[i + 1] if i + 1 < len(blocks) else 0
        out.append(4 * (root + (2 * n + before + after if backward else n + after)))
    return out


def fsdp_gathered(units: list[int], backward: bool = True) -> int:
    """The most bytes of whole units alive at once (fsdp_whole's worst unit)."""
    return max(fsdp_whole(units, backward))


def _whole(s: "StepShape", backward: bool) -> Optional[list[int]]:
    """fsdp_whole of the step's units under FSDP; None when the parameters are replicated."""
    if s.fsdp_world <= 1:
        return None
    return fsdp_whole(fsdp_units(s.scale, s.bottleneck, s.base_width, s.in_channels, s.n_classes), backward)


# --- the step as a list of operations -------------------------------------------------------------

@dataclass(eq=False)
class _T:
    """A tensor of the step: its bytes, and whether the backward gives it a gradient (same bytes)."""

    nbytes: int
    grad: bool = True


@dataclass(eq=False)
class _Op:
    ins: tuple
    outs: tuple
    saved: tuple = ()  # what its backward keeps (parameters excluded)
    param_grad: int = 0  # bytes of parameter gradients its backward writes (kept to the step's end)
    grad_temp: int = 0  # bytes written in the backward and dropped (a bf16 weight gradient before its cast)
    work: int = 0  # transient bytes inside the forward
    segment: Optional[int] = None  # recompute segment (a checkpointed DoubleConv)
    unit: Optional[int] = None  # FSDP unit (fsdp_units' index) whose parameters it reads; None: the root's


class _Builder:
    """Appends the U-Net's operations as UNet3d.forward runs them."""

    def __init__(self, s: StepShape):
        self.s, self.ops = s, []
        self.a = 2 if s.amp else 4  # bytes per activation element
        self.g = 2 if s.working else 4  # bytes per element of a conv weight's gradient
        self.cast = s.amp and not s.working  # each weight cast in the step (and its gradient back)
        self.shards = max(1, s.fsdp_world)  # FSDP keeps 1/shards of each parameter gradient
        self.segment: Optional[int] = None
        self.unit: Optional[int] = None  # the FSDP unit of the ops appended (fsdp_units' index)
        self.n_segments = 0

    def op(self, ins, outs, **kw) -> None:
        if kw.get("param_grad"):  # under FSDP the unit's whole gradients are counted apart (gathered)
            kw["param_grad"] = -(-kw["param_grad"] // self.shards)
        self.ops.append(_Op(tuple(ins), tuple(outs), segment=self.segment, unit=self.unit, **kw))

    def act(self, channels: int, level: int, nbytes: Optional[int] = None, grad: bool = True,
            whole: bool = False) -> _T:
        size = self.a if nbytes is None else nbytes
        return _T(channels * self.s.voxels(level, whole) * size, grad)

    def conv(self, x: _T, cin: int, cout: int, level: int, taps: int = 27, bias: bool = False,
             cast_input: bool = False) -> _T:
        """A conv: under autocast its input (when not yet bf16) and weight are cast to bf16, and the
        backward keeps both; the weight's bf16 gradient is cast to the fp32 parameter's."""
        numel = taps * cin * cout  # under autocast a bf16 copy of the weight, whose gradient is `grad_temp`
        halo = taps == 27 and self.s.split(level)  # scaffold.spatial.HaloConv3d: over the halo'd block
        parts = [(x, None)]  # (input, output planes; None: the block's)
        if halo:
            pd, ph = self.s.grid(level)
            edge = 2 ** (self.s.scale - level)
            planes = edge // pd
            plane = x.nbytes // planes // (edge // ph) * (edge // ph + (2 if ph > 1 else 0))
            if ph > 1:  # the rows' halo first
                xr = _T(plane * planes, x.grad)
                self.op([x], [xr])
                x = xr
            if planes >= 3:  # the D halo overlapped: the interior from the block, each edge plane from 3
                lo, hi = _T(3 * plane, x.grad), _T(3 * plane, x.grad)
                self.op([x], [lo, hi])
                parts = [(x, planes - 2), (lo, 1), (hi, 1)]
            else:
                xe = _T(plane * (planes + 2), x.grad)
                self.op([x], [xe])
                parts = [(xe, None)]
        outs = []
        for i, (xi, out_planes) in enumerate(parts):
            if cast_input:  # the stem's fp32 input: autocast makes a bf16 copy, which the conv keeps
                x16 = _T(xi.nbytes // 4 * self.a, grad=False)
                self.op([xi], [x16])
                xi = x16
            y = self.act(cout, level)  # a halo'd block's conv is unpadded where it is split
            if out_planes is not None:
                y = _T(y.nbytes // planes * out_planes, y.grad)
            # The weight's cast under autocast: one for the parts (ATen's convs share autocast's cached
            # copy; our rungs cast per call, two weight copies more that this leaves out: weights are
            # small next to a block's planes, and working copies, the default on CUDA, need no cast).
            if i == 0:
                wcopy = [_T(2 * numel, grad=False)] if self.cast else []
                for w in wcopy:
                    self.op([], [w])
            # The first part's weight gradient is the parameter's; a later part's is added to it and dropped.
            grads = self.g * (numel + (cout if bias else 0))
            self.op([xi, *wcopy], [y], saved=(xi, *wcopy), param_grad=grads if i == 0 else 0,
                    grad_temp=(2 * numel if self.cast and i == 0 else 0) + (grads if i else 0))
            outs.append(y)
        if len(outs) == 1:
            return outs[0]
        y = self.act(cout, level)  # the parts joined
        self.op(outs, [y])
        return y

    def conv_transpose(self, x: _T, cin: int, cout: int, level: int) -> _T:
        numel = 8 * cin * cout
        wcopy = [_T(2 * numel, grad=False)] if self.cast else []
        cut = self.s.split(level) and not self.s.split(level + 1)  # whole below: made whole, then cut
        moved = self.s.split(level + 1) and self.s.grid(level + 1) != self.s.grid(level)
        y = self.act(cout, level, whole=cut)
        for w in wcopy:
            self.op([], [w])
        self.op([x, *wcopy], [y], saved=(x, *wcopy), param_grad=self.g * (numel + cout),
                grad_temp=2 * numel if self.cast else 0)
        if cut or moved:  # cut to this level's block, or moved to its split (scaffold.spatial.redistribute)
            block = self.act(cout, level)
            self.op([y], [block])
            y = block
        return y

    def norm(self, x: _T, channels: int, level: int, room: int = 0) -> _T:
        """GroupNorm + ReLU. Ours keeps its input and recomputes the ReLU from it. torch's keeps the
        normalized output too (for the ReLU's backward); on CUDA autocast runs it in fp32, so both kept
        tensors are fp32 copies and a bf16 copy of the output goes on. With `room` (ours, a skip) the
        output is a buffer with that many more channels, which the skip's concat fills and returns."""
        s = self.s
        stats = _T(2 * 4 * s.batch * s.groups, grad=False)  # mean and rstd per (sample, group)
        y = self.act(channels + room, level)
        if s.split(level):  # scaffold.spatial's slab GroupNorm: keeps its input and the statistics;
            # works in fp32 (the input's fp32 view or copy, the deviations, the output before its cast)
            work = 4 * channels * s.voxels(level) * (2 if self.a == 4 else 3)
            self.op([x], [y, stats], saved=(x, stats), param_grad=8 * channels, work=work)
        elif s.fused:
            self.op([x], [y, stats], saved=(x, stats), param_grad=8 * channels)
        elif s.amp and s.device == "cuda":
            x32, y32 = self.act(channels, level, 4), self.act(channels, level, 4)
            self.op([x], [x32])
            self.op([x32], [y32, stats], saved=(x32, y32, stats), param_grad=8 * channels)
            self.op([y32], [y])
        else:
            self.op([x], [y, stats], saved=(x, y, stats), param_grad=8 * channels)
        return y

    def norm_head(self, x: _T, channels: int) -> _T:
        """GroupNorm + ReLU and the 1x1x1 head as one op (scaffold.kernels.norm_head): keeps its input,
        the statistics and (under autocast without working copies) the head's bf16 weight; the
        normalized tensor and its gradient never exist."""
        s = self.s
        numel = channels * s.n_classes
        wcopy = [_T(2 * numel, grad=False)] if self.cast else []
        stats = _T(2 * 4 * s.batch * s.groups, grad=False)
        logits = self.act(s.n_classes, 0)
        for w in wcopy:
            self.op([], [w])
        self.op([x, *wcopy], [logits, stats], saved=(x, stats, *wcopy),
                param_grad=8 * channels + self.g * (numel + s.n_classes), grad_temp=2 * numel if self.cast else 0)
        return logits

    def pool(self, x: _T, channels: int, level: int) -> _T:
        """2x2x2 max pool to `level`: keeps a uint8 index per output. torch's formulation copies the
        windows and takes an int64 index first. Where the split ends, its input is first gathered
        whole on every shard (scaffold.spatial.gather_depth)."""
        if self.s.split(level - 1) and not self.s.split(level):
            whole = self.act(channels, level - 1, whole=True)
            self.op([x], [whole])
            x = whole
        elif self.s.split(level) and self.s.grid(level) != self.s.grid(level - 1):
            moved = self.act(channels, level - 1)  # the same voxels, split as the level below is
            self.op([x], [moved])
            x = moved
        y = self.act(channels, level)
        index = self.act(channels, level, 1, grad=False)
        work = 0 if self.s.fused else x.nbytes + 8 * channels * self.s.voxels(level)
        self.op([x], [y, index], saved=(index,), work=work)
        return y

    def concat(self, skip: _T, up: _T, channels: int, level: int) -> _T:
        """cat([skip, up]); into the skip's room where it has one (StepShape.rooms): then the skip's
        buffer is the result, and the transposed conv's output (which a Triton forward writes into the
        room directly; counted as its own tensor here, as on a vendor forward) lives until the concat."""
        if self.s.rooms:
            self.op([skip, up], [])
            return skip
        y = self.act(channels, level)
        self.op([skip, up], [y])
        return y

    def begin(self, on: bool) -> None:
        """Opens a recompute segment (when `on`): its ops' saved tensors are recomputed, not kept."""
        if on:
            self.segment, self.n_segments = self.n_segments, self.n_segments + 1

    def end(self) -> None:
        self.segment = None

    def double_conv(self, x: _T, cin: int, cout: int, level: int, mode: str = "",
                    cast_input: bool = False, room: int = 0, head: str = "") -> _T:
        """mode as DoubleConv.recompute: "" keeps, "block" recomputes both convs as one segment,
        "convs" each conv + norm as its own. `room`: as DoubleConv's, for the output; `head`: the
        block also applies the 1x1x1 head and returns the logits, "fused" with the second norm or
        "apart" (the separate ops, inside the block's segment when it recomputes)."""
        self.begin(mode != "")
        h = self.norm(self.conv(x, cin, cout, level, cast_input=cast_input), cout, level)
        if mode == "convs":
            self.end()
            self.begin(True)
        h = self.conv(h, cout, cout, level)
        if head == "fused":
            y = self.norm_head(h, cout)
        else:
            y = self.norm(h, cout, level, room)
            if head == "apart":
                y = self.conv(y, cout, self.s.n_classes, 0, taps=1, bias=True)
        if mode != "":
            self.end()
        return y

    def loss(self, logits: _T, labels: _T) -> None:
        """The CE + Dice head, outside autocast. Ours keeps the logits and a few sums; torch's keeps
        fp32 log-probabilities, the one-hot target, per-voxel weights and the foreground
        probabilities."""
        s, c, v = self.s, self.s.n_classes, self.s.voxels(0)
        if s.fused and s.depth_shards == 1:
            sums = _T(4 * s.batch * (3 * c + 2), grad=False)  # per sample: CE terms, then 3 per class
            self.op([logits, labels], [sums], saved=(logits, labels, sums))
            return
        # log-probs, one-hot, per-voxel weights, foreground probabilities; then the Dice terms per
        # sample and class, their mask, and the CE denominator. Over slabs (SegmentationLoss.split,
        # these formulas on every device) the CE's two sums are views of the shard group's summed
        # partials (2 + 3 per sample and class), which are kept whole.
        bc = s.batch * (c - 1)
        tail = 9 * bc + 4 if s.depth_shards == 1 else 9 * bc + 4 * (2 + 3 * bc)
        kept = [_T(4 * c * v), _T(c * v, grad=False), _T(4 * v, grad=False), _T(4 * (c - 1) * v),
                _T(tail, grad=False)]
        self.op([logits, labels], kept, saved=tuple(kept), work=4 * c * v)


def _step_ops(s: StepShape) -> tuple[list[_Op], set, _T, _T]:
    """The step's operations in forward order, the tensors the step itself holds to its end (its
    input, the logits, the labels), and the input and logits. Recompute segments as UNet3d.set_recompute
    lays them out."""
    b = _Builder(s)
    on = s.recompute == "blocks"
    block = "block" if on else ""
    widths = [s.base_width * 2**i for i in range(s.levels + 1)]
    labels = _T(s.voxels(0), grad=False)  # the batch's uint8 masks
    x = b.act(s.in_channels, 0, 4, grad=False)  # palette[mask], fp32, gathered through an int32 index
    b.op([], [labels])
    b.op([labels], [x], work=4 * s.voxels(0))
    def room(level: int) -> int:  # a skip's room for its concat's other half (UNet3d._skip_rooms)
        return widths[level] if s.rooms and level < s.levels else 0

    b.unit = 0  # FSDP units as scaffold.fsdp makes them: the stem, each Down's DoubleConv, each Up
    h = b.double_conv(x, s.in_channels, widths[0], 0, block, cast_input=s.amp, room=room(0))
    skips = []
    for level in range(1, s.levels + 1):
        skips.append(h)
        b.unit = None
        pooled = b.pool(h, widths[level - 1], level)
        b.unit = level
        h = b.double_conv(pooled, widths[level - 1], widths[level], level, block, room=room(level))
    for level in reversed(range(s.levels)):
        b.unit = 2 * s.levels - level
        whole = on and level > 0  # below full resolution the whole Up level is one segment
        b.begin(whole)
        up = b.conv_transpose(h, widths[level + 1], widths[level], level)
        cat = b.concat(skips.pop(), up, widths[level + 1], level)
        # The U-Net hands the head to its last block (UNet3d._fuse_head), which fuses it with its last
        # norm where the rungs allow, else runs it apart, inside the block's recompute segment if any.
        head = "" if level > 0 or not s.head_to_block else "fused" if s.fused_head else "apart"
        h = b.double_conv(cat, widths[level + 1], widths[level], level, "convs" if on and level == 0 else "",
                          head=head)
        if whole:
            b.end()
    b.unit = None
    logits = h if s.head_to_block else b.conv(h, widths[0], s.n_classes, 0, taps=1, bias=True)
    b.loss(logits, labels)
    return b.ops, {x, logits, labels}, x, logits


# --- the walk --------------------------------------------------------------------------------------

class _Live:
    def __init__(self):
        self.now = self.peak = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def free(self, n: int) -> None:
        self.now -= n

    def touch(self, extra: int) -> None:
        """`extra` bytes alive for a moment on top of what is allocated (FSDP's whole units)."""
        self.peak = max(self.peak, self.now + extra)


@dataclass(frozen=True)
class Walk:
    saved: int  # bytes the backward keeps at the end of the forward (what saved-tensor hooks count)
    forward_peak: int  # live activation bytes at the forward's peak
    backward_peak: int  # live activation + gradient bytes at the backward's peak (param grads included)
    eval_peak: int  # live bytes of a forward without autograd (evaluation)


def _segments(ops: list[_Op]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, op in enumerate(ops):
        if op.segment is not None:
            out.setdefault(op.segment, []).append(i)
    return out


def _segment_inputs(ops: list[_Op], idx: list[int]) -> set:
    made = {t for i in idx for t in ops[i].outs}
    return {t for i in idx for t in ops[i].ins if t not in made}


def _forward(ops: list[_Op], keep: set, holders: dict, live: _Live, idx=None,
             whole: Optional[list[int]] = None) -> None:
    """Runs ops (all, or those of `idx`) forward: outputs allocated, and a tensor freed after its last
    use in this run unless something holds it (`holders`: tensor -> savers not yet released) or the
    step keeps it (`keep`). `whole[u + 1]`: FSDP's whole units' bytes while an op of unit u runs
    (whole[0]: the root's ops)."""
    idx = list(range(len(ops))) if idx is None else idx
    last = {t: i for i in idx for t in ops[i].ins}
    freed: set = set()
    for i in idx:
        op = ops[i]
        for t in op.outs:
            live.alloc(t.nbytes)
        live.alloc(op.work)
        live.free(op.work)
        if whole:
            live.touch(whole[0 if op.unit is None else op.unit + 1])
        for t in dict.fromkeys((*op.ins, *op.outs)):
            dead = last.get(t, i) <= i and holders.get(t, 0) <= 0 and t not in keep
            if dead and t not in freed:
                freed.add(t)
                live.free(t.nbytes)


def walk(s: StepShape) -> Walk:
    """Forward and backward of one step, freeing as autograd does: a tensor lives while a later op
    reads it, an op's backward keeps what it saved, and a gradient lives from the backward of its
    tensor's consumer to that of its producer. A recompute segment keeps only its inputs; its backward
    first runs its forward again, keeping its saved tensors, as torch.utils.checkpoint does."""
    ops, keep, _, logits = _step_ops(s)
    segments = _segments(ops)
    seg_inputs = {k: _segment_inputs(ops, idx) for k, idx in segments.items()}

    holders: dict = {}
    for op in ops:
        if op.segment is None:
            for t in op.saved:
                holders[t] = holders.get(t, 0) + 1
    for inputs in seg_inputs.values():
        for t in inputs:
            holders[t] = holders.get(t, 0) + 1
    live = _Live()
    _forward(ops, keep, holders, live, whole=_whole(s, backward=False))
    held = {t for t, n in holders.items() if n > 0}
    saved = sum(t.nbytes for t in held)
    forward_peak = live.peak

    live.peak = live.now
    _backward(ops, keep, holders, segments, seg_inputs, logits, live, _whole(s, backward=True),
              into_buckets=s.data_parallel)
    return Walk(saved, forward_peak, live.peak, _eval_peak(s))


def _release(t: _T, holders: dict, keep: set, live: _Live) -> None:
    holders[t] = holders.get(t, 0) - 1
    if holders[t] == 0 and t not in keep:
        live.free(t.nbytes)


def _backward(ops, keep, holders, segments, seg_inputs, logits, live: _Live,
              whole: Optional[list[int]] = None, into_buckets: bool = False) -> None:
    """into_buckets: under DDP each parameter's gradient is copied into its bucket, which the
    parameter's `.grad` is a view of (gradient_as_bucket_view), and the autograd tensor is dropped:
    the kept gradients are the buckets, counted apart (Estimate.buckets)."""
    grads: set = set()
    done_segments: set = set()
    for i in reversed(range(len(ops))):
        op = ops[i]
        k = op.segment
        if k is not None and k not in done_segments:  # first backward into a segment: recompute it
            done_segments.add(k)
            _recompute(ops, segments[k], keep, holders, live, whole)
        for t in op.ins:
            if not t.grad:
                continue
            live.alloc(t.nbytes)  # a second gradient for a tensor read twice (a skip) is added in place
            if t in grads:
                live.free(t.nbytes)
            grads.add(t)
        live.alloc(op.param_grad + op.grad_temp)
        if whole:
            live.touch(whole[0 if op.unit is None else op.unit + 1])
        live.free(op.grad_temp + (op.param_grad if into_buckets else 0))
        for t in op.outs:
            if t in grads:
                grads.discard(t)
                live.free(t.nbytes)
        for t in op.saved:
            _release(t, holders, keep, live)
        if k is not None and i == segments[k][0]:  # the segment's backward is done: its inputs go
            for t in seg_inputs[k]:
                _release(t, holders, keep, live)


def _recompute(ops, idx: list[int], keep: set, holders: dict, live: _Live,
               whole: Optional[list[int]] = None) -> None:
    """A segment's forward again, keeping what its ops save; torch stops after the last op that saves
    something, so that op's output is made and dropped at once."""
    for i in idx:
        for t in ops[i].saved:
            holders[t] = holders.get(t, 0) + 1
    _forward(ops, keep, holders, live, idx, whole)  # inside the unit's backward: its gathered bytes


def _eval_peak(s: StepShape) -> int:
    """A forward under no_grad, then the validation loss and Dice (torch's ops, fp32 over the logits)."""
    ops, keep, _, _ = _step_ops(replace(s, recompute="off", fused=True))
    live = _Live()
    _forward(ops[:-1], keep, {}, live, whole=_whole(s, backward=False))
    c, v = s.n_classes, s.voxels(0)
    live.alloc(4 * c * v + c * v + 3 * 4 * v + 4 * (c - 1) * v)  # log-probs, one-hot, NLL terms, probs
    return live.peak


# --- the estimate ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    """Bytes of one training step on one device, by term."""

    shape: StepShape
    params: int  # fp32 parameters
    grads: int  # their fp32 gradients
    adam: int  # Adam's two fp32 moments
    optimizer_temp: int  # Adam's temporaries during its step (torch's foreach Adam: one moment's size;
    # ours with working copies: none)
    walk: Walk
    buckets: int = 0  # DDP's gradient buckets: the gradients themselves (gradient_as_bucket_view)
    evaluate: bool = True  # the run evaluates (a forward without autograd) between epochs
    warmup_copy: int = 0  # the trainer's warm-up runs on a copy of the model and its optimizer
    working_copies: int = 0  # bf16 working copies of the conv weights, kept between steps
    gathered: int = 0  # FSDP: the most bytes of whole units at once (fsdp_gathered; in the walk's peaks)
    gathered_eval: int = 0  # FSDP: the same in a forward without autograd (evaluation)

    @property
    def data(self) -> int:
        return self.shape.data_bytes // self.shape.depth_shards  # each shard holds its slab of the masks

    @property
    def saved(self) -> int:
        return self.walk.saved

    @property
    def activation_peak(self) -> int:
        """Live activations and gradients at the step's peak (what a captured step's pool holds)."""
        return max(self.walk.forward_peak, self.walk.backward_peak)

    @property
    def step_peak(self) -> int:
        """Live bytes at the step's peak with Adam's state present (every step after the first); under
        FSDP the whole units are in the walk's peaks, op by op."""
        return self.static + self.activation_peak

    @property
    def static(self) -> int:
        """What stays allocated across steps: parameters, Adam's state, DDP's buckets, the data."""
        return self.params + self.working_copies + self.adam + self.buckets + self.data

    @property
    def max_allocated(self) -> int:
        """What torch.cuda.max_memory_allocated reports over a few steps of the step benchmark (from
        before the model is built): the step's peak with Adam's state present (the captured step
        includes Adam, whose state exists before the capture), or Adam's own step if larger."""
        return max(self.step_peak, self.static + self.grads + self.optimizer_temp)

    @property
    def need(self) -> int:
        """Device bytes a run needs. Eagerly, evaluation and Adam's step reuse the step's freed memory.
        A CUDA graph's pool stays reserved between replays (the step's activation peak, its gradients
        included), so what runs outside the graph (Adam's temporaries, the evaluation forward) comes on
        top of it. The warm-up copy is there before any capture."""
        evaluation = self.walk.eval_peak if self.evaluate else 0
        warmup = self.step_peak + self.warmup_copy
        if self.shape.graph:
            return max(warmup, self.step_peak + max(self.optimizer_temp, evaluation))
        return max(warmup, self.static + max(self.grads + self.optimizer_temp, evaluation))

    def terms(self) -> dict[str, float]:
        """The terms in GiB, for a table or a JSON record."""
        return {k: v / GiB for k, v in (
            ("params", self.params), ("grads", self.grads), ("adam", self.adam), ("buckets", self.buckets),
            ("data", self.data), ("gathered", self.gathered),
            ("saved", self.saved), ("forward_peak", self.walk.forward_peak),
            ("backward_peak", self.walk.backward_peak), ("eval_peak", self.walk.eval_peak),
            ("step_peak", self.step_peak), ("max_allocated", self.max_allocated), ("need", self.need))}


def estimate(s: StepShape, evaluate: bool = True, warmup: bool = False) -> Estimate:
    """The step's memory for a shape; `evaluate` counts the evaluation forward, `warmup` the trainer's
    warm-up copy of the model and optimizer."""
    p = param_count(s.scale, s.bottleneck, s.base_width, s.in_channels, s.n_classes)
    if s.fsdp_world > 1:
        # FSDP: each rank keeps 1/W of the parameters, their gradients and Adam's moments (no DDP
        # buckets, no working copies); the units it runs are whole while they run (fsdp_gathered); the
        # warm-up runs on the model itself (no copy). torch's Adam over the shards: foreach's (or the
        # fused one's) temporary is a shard's moment on CUDA, one local tensor at a time on the CPU.
        w = s.fsdp_world
        units = fsdp_units(s.scale, s.bottleneck, s.base_width, s.in_channels, s.n_classes)
        shard = -(-4 * p // w)
        temp = shard if s.device == "cuda" else -(-4 * _largest_param(s) // w)
        return Estimate(s, shard, shard, 2 * shard, temp, walk(s), 0, evaluate, 0, 0,
                        fsdp_gathered(units), fsdp_gathered(units, backward=False))
    # torch's Adam: foreach on CUDA (a temporary the size of one moment); one tensor at a time on CPU.
    # Ours with working copies (scaffold.kernels.adam) updates in place: no temporary; the copies are
    # 2 bytes a parameter, and so are the gradients (the GroupNorms' few are fp32: counted as bf16).
    temp = 4 * p if s.device == "cuda" else 4 * _largest_param(s)
    working = 2 * p if s.working else 0
    if working:
        temp = 0
    # Under DDP the gradients are its buckets' (gradient_as_bucket_view): kept across steps, not apart.
    grads = 0 if s.data_parallel else 2 * p if working else 4 * p
    return Estimate(s, 4 * p, grads, 8 * p, temp, walk(s),
                    4 * p if s.data_parallel else 0, evaluate, (4 * p + working) if warmup else 0, working)


def _largest_param(s: StepShape) -> int:
    w = s.base_width * 2**s.levels
    return 27 * w * w


# --- the device's memory --------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceMemory:
    name: str  # e.g. "cuda:0 (NVIDIA H200)" or "cpu"
    free: int
    total: int


def device_memory(device: Any, query_free: bool = True) -> DeviceMemory:
    """Free and total bytes of a device. CUDA: torch.cuda.mem_get_info, or with query_free=False the
    total from the device's properties (no CUDA context is created); CPU: available and physical RAM
    from os.sysconf."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
        if query_free:
            free, total = torch.cuda.mem_get_info(index)
        else:
            free = total = torch.cuda.get_device_properties(index).total_memory
        return DeviceMemory(name, int(free), int(total))
    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    free = os.sysconf("SC_AVPHYS_PAGES") * page if query_free else total
    return DeviceMemory("cpu", int(free), int(total))
