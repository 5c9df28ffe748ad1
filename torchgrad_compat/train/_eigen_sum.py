"""Sums over whole tensors in the order of TensorFlow's CPU kernels (Eigen's full reduction, one
thread), for many tensors at once.

Eigen adds a range of more than 1024 packets as two halves split at a packet boundary, summed
apart, then added; a shorter range (a *leaf*) in four packet-wide accumulators over blocks of four
packets (each lane a sequential sum over the blocks), folded into the first, then the remaining
packets one by one, the tail element by element, and the tail's sum plus the accumulator's lanes
added as a tree. A packet is 8 float32 or 4 float64 lanes (the AVX build of the x86 wheels).

The lanes' sequential sums are the cost: no torch reduction adds in that order, and numpy adds an
outer axis row by row but in calls of one block (32 elements) when the blocks lie in their
tensor's order. So the leaves' blocks are laid out block-major (``rows × leaves × block``, one
buffer per class of leaves with a similar number of blocks), where one addition per row adds a
block of every leaf: numpy's reduction over the rows on the CPU (one call per buffer, each row one
long vectorised addition), one elementwise addition per row elsewhere (a GPU). The rest (the
packets after the blocks, the tails, the tree of halves) are a few operations over all leaves.

The work is done in pieces of consecutive whole tensors (a longer tensor alone, in parts cut at
leaves). On the CPU a piece is small enough to stay in the cache: its tensors are copied one
after another into a workspace (one ``torch._foreach_copy_``, the only pass over the tensors in
memory), squared from there into the block-major buffers (one torch multiplication per run of
equal leaves, which writes the transposed layout fast), and those buffers summed. Elsewhere the
pieces are larger and the leaves are copied into the buffers straight from the tensors. Buffers
and their views are kept per thread and reused call after call.

Measured on one thread for 1M float32 elements in 100 tensors (scripts/bench_clip.py's machine):
the copy about 0.26 ms, the squares into block-major buffers 0.2 ms, numpy's additions of their
rows 0.13 ms, the rest 0.1 ms; torch's ``_foreach_norm`` about 0.3 ms. The alternatives were
slower: numpy's reduction over the blocks as they lie in the tensors (0.95 ms), the transposing
copy straight from the tensors into buffers of 2M elements (1.7 ms; reads from many places of
memory at once), or a copy or view per tensor (Python's cost per call). ``np.einsum`` would fuse
square and sum, but its kernels multiply-add (fused on builds that dispatch to FMA) and add lanes
in an order of their own: not Eigen's bits.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np
import torch
from torch import Tensor

# Eigen's packet of the x86 TensorFlow wheels (AVX): 8 float32 or 4 float64 lanes.
PACKET = {torch.float32: 8, torch.float64: 4}
# Eigen sums halves of a longer range apart (pairwise), down to this many packets.
_LEAF_PACKETS = 1024
# Elements of a piece: on the CPU its workspace and buffers stay in the cache (measured with
# scripts/bench_clip.py: smaller pieces cost more calls, larger ones miss the cache); elsewhere
# fewer, larger pieces mean fewer kernel launches.
_CPU_PIECE = 1 << 18
_DEVICE_PIECE = 1 << 21
# Plans' buffers and views kept per thread and workspace, the most recently used.
_STATES_KEPT = 8
_local = threading.local()


@dataclasses.dataclass(frozen=True)
class _Run:
    """Consecutive leaves of one tensor with the same length, in consecutive slots of one class."""

    tensor: int
    offset: int  # of the first leaf, in elements from the tensor's start
    leaves: int
    count: int  # elements per leaf
    cls: int
    slot: int  # the first leaf's slot in its class
    row: int  # the first leaf's row in the plan's per-leaf arrays
    at: int  # of the first leaf in the CPU's workspace, where its piece is copied


@dataclasses.dataclass(frozen=True)
class _Class:
    rows: int  # blocks of its longest leaf
    slots: int
    offset: int  # of its buffer in the piece's buffers
    padded: bool  # some leaf has fewer blocks than `rows`: those rows are zeroed before each copy
    row: int  # its first leaf's row in the plan's per-leaf arrays


@dataclasses.dataclass(frozen=True)
class _Piece:
    first: int  # the first tensor's index
    last: int  # one past the last's
    part: tuple[int, int] | None  # the elements of tensor `first` when the piece is a part of it
    size: int  # elements of the piece's tensors (or part)
    runs: tuple[_Run, ...]
    classes: tuple[_Class, ...]
    rest_to: np.ndarray  # where in the `rest` vector (see _finish_leaves) ...
    rest_from: np.ndarray  # ... each element after the blocks goes, from the piece's workspace


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed by identity: _plan_of keeps one per key
class _Plan:
    shapes: tuple[torch.Size, ...]
    lanes: int
    pieces: tuple[_Piece, ...]
    workspace: int  # elements of the largest piece's tensors
    buffers: int  # elements of the largest piece's buffers
    leaves: int  # rows of the per-leaf arrays
    rest_index: np.ndarray  # where in `remainders` each leaf's 3 packets and tail are (GPU path)
    nodes: np.ndarray  # the leaves' rows, then as many (any) as there are joins
    joins: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]  # (node, left, right), deepest first
    roots: np.ndarray  # each tensor's node


def eigen_sums(tensors: list[Tensor], *, square: bool) -> Tensor:
    """Eigen's sum of each tensor (of its squares with ``square``) over all its elements, as a 1-d
    tensor; the tensors share one floating dtype of :data:`PACKET` and one device."""
    first = tensors[0]
    cpu = first.device.type == "cpu"
    plan = _plan_of(
        tuple([t.shape for t in tensors]), PACKET[first.dtype], _CPU_PIECE if cpu else _DEVICE_PIECE
    )
    if cpu:
        return _cpu_sums(tensors, plan, square)
    return _block_major_sums(tensors, plan, square)


def eigen_sum_short(x: np.ndarray) -> np.floating | None:
    """Eigen's sum of the contiguous 1-d float32 or float64 ``x`` if it is one leaf (at most 1024
    packets), in a few numpy operations (for a short vector such as a global norm's halves); None
    for a longer ``x``."""
    lanes = 8 if x.dtype == np.float32 else 4
    block = 4 * lanes
    if len(x) > lanes * _LEAF_PACKETS:
        return None
    blocks = len(x) // block
    if blocks:  # each lane adds the blocks in turn (numpy reduces an outer axis row by row)
        a = np.add.reduce(x[: blocks * block].reshape(blocks, block), axis=0)
        packet = ((a[:lanes] + a[lanes : 2 * lanes]) + a[2 * lanes : 3 * lanes]) + a[3 * lanes :]
    else:
        packet = np.zeros(lanes, x.dtype)
    vectorized = len(x) // lanes * lanes
    for j in range(blocks * block, vectorized, lanes):
        packet = packet + x[j : j + lanes]
    tail = x.dtype.type(0)
    for value in x[vectorized:]:
        tail = tail + value
    while len(packet) > 1:
        packet = packet[: len(packet) // 2] + packet[len(packet) // 2 :]
    return tail + packet[0]


# ---------------------------------------------------------------- the CPU


@dataclasses.dataclass(frozen=True)
class _CpuState:
    """A plan's views of this thread's CPU workspace and buffers, and its per-leaf arrays."""

    targets: tuple[list[Tensor], ...]  # per piece: the views its tensors (or part) are copied into
    squares: tuple[tuple[tuple[Tensor, Tensor], ...], ...]  # per piece and run with blocks: from, to
    sums: tuple[tuple[tuple[np.ndarray, np.ndarray, bool], ...], ...]  # per class: rows, out, padded
    flat: np.ndarray  # the workspace
    rest: np.ndarray  # the elements after each leaf's blocks, zeros elsewhere (see _finish_leaves)
    folded: np.ndarray  # (7, lanes, leaves)
    accumulators: np.ndarray  # (leaves, 4, lanes); zeros for leaves without a block


def _cpu_sums(tensors: list[Tensor], plan: _Plan, square: bool) -> Tensor:
    """:func:`eigen_sums` on the CPU: piece by piece, the tensors copied into the workspace, squared
    into block-major buffers, whose rows numpy adds one after another (see the module's docstring)."""
    state = _cpu_state_of(plan, tensors[0].dtype)
    with np.errstate(all="ignore"):  # inf and NaN are summed as IEEE says, as in torch
        _cpu_pieces(tensors, plan, state, square)
        state.folded[:4] = state.accumulators.transpose(1, 2, 0)
        leaf_sums = _finish_leaves(state.folded, state.rest, plan.lanes, square)
        return torch.from_numpy(_tensor_sums(leaf_sums, plan))


def _cpu_pieces(tensors: list[Tensor], plan: _Plan, state: _CpuState, square: bool) -> None:
    """The accumulators of every leaf and the elements after their blocks, piece by piece."""
    whole = None  # a tensor longer than a piece, flattened once for its parts
    for piece, targets, squares, sums in zip(
        plan.pieces, state.targets, state.squares, state.sums, strict=True
    ):
        if piece.part is None:
            torch._foreach_copy_(targets, tensors[piece.first : piece.last])
        else:
            if piece.part[0] == 0:
                whole = tensors[piece.first].detach().reshape(-1)
            targets[0].copy_(whole[piece.part[0] : piece.part[1]])
        for rows, _, padded in sums:
            if padded:
                rows.fill(0)
        for source, target in squares:
            if square:
                torch.mul(source, source, out=target)
            else:
                target.copy_(source)
        for rows, out, _ in sums:
            # numpy adds an outer axis row after row into one accumulator per column when the
            # columns are contiguous (its pairwise summation runs only along an inner axis).
            np.add.reduce(rows, axis=0, out=out)
        state.rest[piece.rest_to] = state.flat[piece.rest_from]


def _cpu_state_of(plan: _Plan, dtype: torch.dtype) -> _CpuState:
    """The plan's state for this thread: one workspace and one set of buffers per dtype, shared by
    the plans (their pieces are done one at a time), and views of them kept per plan (per shapes)."""
    spaces = getattr(_local, "cpu", None)
    if spaces is None:
        spaces = _local.cpu = {}
    workspace, buffers, states = spaces.get(dtype, (None, None, {}))
    if workspace is None or workspace.numel() < plan.workspace or buffers.numel() < plan.buffers:
        size = max(plan.workspace, 0 if workspace is None else workspace.numel(), 1)
        extent = max(plan.buffers, 0 if buffers is None else buffers.numel(), 1)
        workspace, buffers, states = torch.empty(size, dtype=dtype), torch.empty(extent, dtype=dtype), {}
        spaces[dtype] = (workspace, buffers, states)
    state = states.pop(plan, None)
    if state is None:
        state = _new_cpu_state(plan, workspace, buffers)
    states[plan] = state  # the most recently used last
    while len(states) > _STATES_KEPT:
        del states[next(iter(states))]
    return state


def _new_cpu_state(plan: _Plan, workspace: Tensor, buffers: Tensor) -> _CpuState:
    lanes, leaves, block = plan.lanes, plan.leaves, 4 * plan.lanes
    dtype = workspace.numpy().dtype
    accumulators = np.zeros((leaves, 4, lanes), dtype)
    folded = np.empty((7, lanes, leaves), dtype)
    flat_sums = accumulators.reshape(-1)
    all_targets, all_squares, all_sums = [], [], []
    for piece in plan.pieces:
        if piece.part is None:
            targets, offset = [], 0
            for shape in plan.shapes[piece.first : piece.last]:
                numel = shape.numel()
                targets.append(workspace[offset : offset + numel].view(shape))
                offset += numel
        else:
            targets = [workspace[: piece.size]]
        views = [
            buffers[cls.offset : cls.offset + cls.rows * cls.slots * block].view(cls.rows, cls.slots, block)
            for cls in piece.classes
        ]
        squares = []
        for run in _joined(piece.runs):
            blocks = run.count // block
            if blocks:
                source = workspace.as_strided((run.leaves, blocks, block), (run.count, block, 1), run.at)
                squares.append(
                    (source, views[run.cls][:blocks, run.slot : run.slot + run.leaves].transpose(0, 1))
                )
        sums = tuple(
            (
                view.numpy().reshape(cls.rows, -1),
                flat_sums[cls.row * block : (cls.row + cls.slots) * block],
                cls.padded,
            )
            for cls, view in zip(piece.classes, views, strict=True)
            if cls.rows
        )
        all_targets.append(targets)
        all_squares.append(tuple(squares))
        all_sums.append(sums)
    return _CpuState(
        tuple(all_targets),
        tuple(all_squares),
        tuple(all_sums),
        workspace.numpy(),
        np.zeros(3 * leaves * lanes + (lanes - 1) * leaves, dtype),
        folded,
        accumulators,
    )


def _joined(runs: tuple[_Run, ...]) -> list[_Run]:
    """The runs with those of consecutive tensors joined where their leaves follow each other in the
    workspace as in their class (tensors of one shape, typically): one multiplication each."""
    joined: list[_Run] = []
    for run in runs:
        last = joined[-1] if joined else None
        if (
            last is not None
            and (last.count, last.cls) == (run.count, run.cls)
            and last.at + last.leaves * run.count == run.at
            and last.slot + last.leaves == run.slot
        ):
            joined[-1] = dataclasses.replace(last, leaves=last.leaves + run.leaves)
        else:
            joined.append(run)
    return joined


# ---------------------------------------------------------------- elsewhere (a GPU)


@dataclasses.dataclass(frozen=True)
class _State:
    """A plan's buffers and index tensors on one device, the copy's targets among them."""

    targets: tuple[list[Tensor], ...]  # per piece, in the order of the sources _block_major_sums makes
    buffers: tuple[tuple[Tensor, ...], ...]  # per piece and class: (rows, slots, 4, lanes)
    outs: tuple[tuple[Tensor, ...], ...]  # per piece and class: its slots of `folded`'s rows 0-3
    remainders: Tensor  # 4 * lanes per leaf: what follows its blocks, zeros after; then one zero
    rest_index: Tensor  # where each leaf's three packets (rows of 3) and tail (rows of lanes - 1) are
    folded: Tensor  # (7, lanes, leaves)
    nodes: Tensor
    joins: tuple[tuple[Tensor, Tensor, Tensor], ...]
    roots: Tensor


def _block_major_sums(tensors: list[Tensor], plan: _Plan, square: bool) -> Tensor:
    """:func:`eigen_sums` through block-major buffers copied into straight from the tensors."""
    first = tensors[0]
    state = _state_of(plan, first.dtype, first.device)
    contiguous = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    lanes = plan.lanes
    block = 4 * lanes
    state.folded[:4].zero_()  # the accumulators of leaves without a block stay 0
    for piece, targets, buffers, outs in zip(
        plan.pieces, state.targets, state.buffers, state.outs, strict=True
    ):
        for cls, buffer in zip(piece.classes, buffers, strict=True):
            if cls.padded:
                buffer.zero_()
        sources = []
        for run in piece.runs:
            t = contiguous[run.tensor]
            start = t.storage_offset() + run.offset
            blocks = run.count // block
            if blocks:
                size, stride = (run.leaves, blocks, 4, lanes), (run.count, block, lanes, 1)
                sources.append(t.as_strided(size, stride, start))
            if run.count > blocks * block:
                rest = run.count - blocks * block
                sources.append(t.as_strided((run.leaves, rest), (run.count, 1), start + blocks * block))
        if sources:  # none where the piece holds only empty tensors
            torch._foreach_copy_(targets, sources)
        for buffer, out in zip(buffers, outs, strict=True):
            if buffer.shape[0]:
                if square:
                    buffer.mul_(buffer)
                out.copy_(_sum_rows(buffer))
    rest = state.remainders[state.rest_index]
    leaf_sums = _finish_leaves(state.folded, rest, lanes, square)
    return _tensor_sums(leaf_sums, plan, state)


def _state_of(plan: _Plan, dtype: torch.dtype, device: torch.device) -> _State:
    """The plan's state for this thread: buffers are reused call after call, one workspace per dtype
    and device shared by the plans (pieces are done one at a time)."""
    spaces = getattr(_local, "spaces", None)
    if spaces is None:
        spaces = _local.spaces = {}
    workspace, states = spaces.get((dtype, device), (None, {}))
    if workspace is None or workspace.numel() < plan.buffers:
        workspace, states = torch.empty(max(plan.buffers, 1), dtype=dtype, device=device), {}
        spaces[(dtype, device)] = (workspace, states)
    state = states.pop(plan, None)
    if state is None:
        state = _new_state(plan, workspace)
    states[plan] = state  # the most recently used last
    while len(states) > _STATES_KEPT:
        del states[next(iter(states))]
    return state


def _new_state(plan: _Plan, workspace: Tensor) -> _State:
    lanes, leaves, block = plan.lanes, plan.leaves, 4 * plan.lanes
    remainders = workspace.new_zeros(leaves * block + 1)
    folded = workspace.new_zeros(7, lanes, leaves)
    all_targets, all_buffers, all_outs = [], [], []
    for piece in plan.pieces:
        buffers = tuple(
            workspace[cls.offset : cls.offset + cls.rows * cls.slots * block].view(
                cls.rows, cls.slots, 4, lanes
            )
            for cls in piece.classes
        )
        outs = tuple(folded[:4, :, cls.row : cls.row + cls.slots].permute(2, 0, 1) for cls in piece.classes)
        targets = []
        for run in piece.runs:
            blocks = run.count // block
            if blocks:
                targets.append(buffers[run.cls][:blocks, run.slot : run.slot + run.leaves].transpose(0, 1))
            if run.count > blocks * block:
                at = run.row * block
                rows = remainders[at : at + run.leaves * block].view(run.leaves, block)
                targets.append(rows[:, : run.count - blocks * block])
        all_targets.append(targets)
        all_buffers.append(buffers)
        all_outs.append(outs)
    device = workspace.device

    def on_device(index: np.ndarray) -> Tensor:
        return torch.from_numpy(index).to(device)

    return _State(
        tuple(all_targets),
        tuple(all_buffers),
        tuple(all_outs),
        remainders,
        on_device(plan.rest_index),
        folded,
        on_device(plan.nodes),
        tuple(tuple(on_device(i) for i in level) for level in plan.joins),
        on_device(plan.roots),
    )


def _sum_rows_one_by_one(rows: Tensor) -> Tensor:
    """:func:`_sum_rows` with one elementwise addition per row (on a GPU, whose sums add in a tree)."""
    out = rows[0].clone()
    for row in rows[1:]:
        out.add_(row)
    return out


# ---------------------------------------------------------------- both: the rest of each leaf, the halves


def _sum_rows(rows: Tensor | np.ndarray) -> Tensor | np.ndarray:
    """Each column's sum over the rows (at least one, of at least 32 elements), the rows added one
    after another, as a new array or tensor."""
    if isinstance(rows, np.ndarray):
        # numpy adds an outer axis row by row, into one accumulator per column (its pairwise
        # summation is only along the contiguous axis of a reduction), on one thread: one call.
        return np.add.reduce(rows, axis=0)
    if rows.device.type == "cpu":
        return torch.from_numpy(_sum_rows(rows.numpy()))
    return _sum_rows_one_by_one(rows)


def _finish_leaves(
    folded: Tensor | np.ndarray, rest: Tensor | np.ndarray, lanes: int, square: bool
) -> Tensor | np.ndarray:
    """Each leaf's sum: its four accumulators folded into the first and the packets after its
    blocks added (rows 0-3 and 4-6 of ``folded``, one sequence of additions), the tail summed
    element by element, then the tail's sum plus the accumulator's lanes added as a tree. ``rest``
    holds the packets after the blocks (3, lanes, leaves), then the tails (lanes - 1, leaves): the
    leaves along the last axis, so that every operation runs along rows of all of them."""
    leaves = folded.shape[2]
    if square:
        rest = rest * rest
    folded[4:] = rest[: 3 * lanes * leaves].reshape(3, lanes, leaves)
    packet = _sum_rows(folded)
    tail = _sum_rows(rest[3 * lanes * leaves :].reshape(lanes - 1, leaves))
    while packet.shape[0] > 1:  # the upper half onto the lower, down to one lane
        half = packet.shape[0] // 2
        packet = packet[:half] + packet[half:]
    return tail + packet[0]


def _tensor_sums(
    leaf_sums: Tensor | np.ndarray, plan: _Plan, state: _State | None = None
) -> Tensor | np.ndarray:
    """Each tensor's sum from its leaves' sums: the halves of a split added, deepest first (the
    plan's index arrays, or the state's copies of them on the leaves' device)."""
    index = plan if state is None else state
    if not index.joins:
        return leaf_sums[index.roots]
    nodes = leaf_sums[index.nodes]
    for node, left, right in index.joins:
        nodes[node] = nodes[left] + nodes[right]
    return nodes[index.roots]


# ---------------------------------------------------------------- the plan


@functools.lru_cache(maxsize=64)
def _plan_of(shapes: tuple[torch.Size, ...], lanes: int, piece_size: int) -> _Plan:
    """The leaves and joins of Eigen's sum of tensors of ``shapes``, and their layout in pieces of
    about ``piece_size`` elements."""
    block = 4 * lanes
    numels = [shape.numel() for shape in shapes]
    leaves: list[tuple[int, int, int]] = []  # (tensor, first, count) in tensor order
    joins: list[tuple[int, int, int, int]] = []  # (depth, node, left, right); leaves are nodes
    roots = []
    for tensor, numel in enumerate(numels):
        roots.append(_split(tensor, 0, numel, lanes, 0, leaves, joins))
    # Leaves are numbered by their place in the per-leaf arrays: piece, class, slot.
    order: dict[int, int] = {}
    pieces, workspace, extent, row = [], 0, 0, 0
    for first, last, part, chunk in _pieces(leaves, numels, piece_size):
        # Where each of the piece's tensors (or its part) starts in the CPU's workspace.
        starts = {first: -part[0]} if part else {}
        if not part:
            offset = 0
            for tensor in range(first, last):
                starts[tensor] = offset
                offset += numels[tensor]
        by_class: dict[int, list[int]] = {}
        for leaf in chunk:
            by_class.setdefault(_class_of(leaves[leaf][2] // block), []).append(leaf)
        classes, runs, offset = [], [], 0
        for cls, members in enumerate(by_class.values()):
            rows = max(leaves[leaf][2] // block for leaf in members)
            padded = any(leaves[leaf][2] // block != rows for leaf in members)
            slots = len(members) + len(members) % 2  # rows of at least 32 elements (see _sum_rows)
            classes.append(_Class(rows, slots, offset, padded, row))
            offset += rows * slots * block
            for slot, leaf in enumerate(members):
                order[leaf] = row + slot
                tensor, start, count = leaves[leaf]
                last_run = runs[-1] if runs else None
                if (
                    last_run is not None
                    and (last_run.tensor, last_run.count, last_run.cls) == (tensor, count, cls)
                    and last_run.offset + last_run.leaves * count == start
                    and last_run.slot + last_run.leaves == slot
                ):
                    runs[-1] = dataclasses.replace(last_run, leaves=last_run.leaves + 1)
                else:
                    runs.append(_Run(tensor, start, 1, count, cls, slot, row + slot, starts[tensor] + start))
            row += slots
        size = part[1] - part[0] if part else sum(numels[first:last])
        pieces.append((first, last, part, size, runs, classes, chunk, starts))
        workspace, extent = max(workspace, size), max(extent, offset)
    # Rows for a multiple of 64 leaves (the unused ones sum zeros): the tails' rows too have at
    # least 64 elements.
    rows_used = -(-row // 64) * 64
    # The packets after the blocks as rows (3, lanes, leaves), then the tails (lanes - 1, leaves):
    # for the GPU's path, the index of each in the remainders (where a leaf has fewer, the index of
    # the zero after all remainders); for the CPU's, each piece's places of them in that vector and
    # in its workspace.
    zero = rows_used * block
    packet_index = np.full((3, lanes, rows_used), zero, dtype=np.int64)
    tail_index = np.full((lanes - 1, rows_used), zero, dtype=np.int64)
    done = []
    for first, last, part, size, runs, classes, chunk, starts in pieces:
        rest_to: list[np.ndarray] = []
        rest_from: list[np.ndarray] = []
        for leaf in chunk:
            tensor, start, count = leaves[leaf]
            r = order[leaf]
            rest = count % block
            packets, tail = rest // lanes, rest % lanes
            after = count - rest
            k = np.arange(packets * lanes)
            packet_index[:packets, :, r] = k.reshape(packets, lanes) + r * block
            tail_index[:tail, r] = np.arange(tail) + r * block + packets * lanes
            j = np.arange(tail)
            rest_to += [
                (k // lanes) * lanes * rows_used + k % lanes * rows_used + r,
                3 * rows_used * lanes + j * rows_used + r,
            ]
            at = starts[tensor] + start + after
            rest_from += [at + k, at + packets * lanes + j]
        done.append(
            _Piece(
                first,
                last,
                part,
                size,
                tuple(runs),
                tuple(classes),
                np.concatenate(rest_to).astype(np.int64),
                np.concatenate(rest_from).astype(np.int64),
            )
        )
    rest_index = np.concatenate([packet_index.reshape(-1), tail_index.reshape(-1)])

    def node(n: int) -> int:  # leaves first, in their rows' order, then the joins
        return order[n] if n >= 0 else rows_used - 1 - n

    levels = []
    for depth in sorted({j[0] for j in joins}, reverse=True):
        level = [j for j in joins if j[0] == depth]
        levels.append(tuple(np.array([node(j[k]) for j in level], dtype=np.int64) for k in (1, 2, 3)))
    nodes = np.concatenate([np.arange(rows_used), np.zeros(len(joins), dtype=np.int64)])
    return _Plan(
        shapes,
        lanes,
        tuple(done),
        workspace,
        extent,
        rows_used,
        rest_index,
        nodes,
        tuple(levels),
        np.array([node(r) for r in roots], dtype=np.int64),
    )


def _split(
    tensor: int,
    first: int,
    count: int,
    lanes: int,
    depth: int,
    leaves: list[tuple[int, int, int]],
    joins: list[tuple[int, int, int, int]],
) -> int:
    """Eigen's split of ``[first, first + count)``: halves at a packet boundary, down to 1024
    packets. Returns the node: a leaf's number, or a join's (negative: ``-1 - its number``)."""
    if count <= lanes * _LEAF_PACKETS:
        leaves.append((tensor, first, count))
        return len(leaves) - 1
    split = lanes * -(-(first + -(-count // 2)) // lanes)
    left = min(split - first, count)
    left_node = _split(tensor, first, left, lanes, depth + 1, leaves, joins)
    if left == count:
        return left_node
    right_node = _split(tensor, split, count - left, lanes, depth + 1, leaves, joins)
    node = -1 - len(joins)
    joins.append((depth, node, left_node, right_node))
    return node


def _class_of(blocks: int) -> int:
    """Leaves whose block counts share a class share a buffer: zero, one, then powers of two."""
    return blocks.bit_length()


def _pieces(
    leaves: list[tuple[int, int, int]], numels: list[int], size: int
) -> list[tuple[int, int, tuple[int, int] | None, list[int]]]:
    """The leaves in pieces of at most ``size`` elements (or one leaf): consecutive whole tensors,
    or a part of a longer tensor cut between leaves. Each piece: its first tensor, one past its
    last, the part of the tensor (None for whole tensors), its leaves."""
    by_tensor: list[list[int]] = [[] for _ in numels]
    for leaf, (tensor, _, _) in enumerate(leaves):
        by_tensor[tensor].append(leaf)
    pieces: list[tuple[int, int, tuple[int, int] | None, list[int]]] = []
    first, elements, chunk = 0, 0, []
    for tensor, numel in enumerate(numels):
        if chunk and elements + numel > size:
            pieces.append((first, tensor, None, chunk))
            first, elements, chunk = tensor, 0, []
        if numel <= size:
            elements += numel
            chunk += by_tensor[tensor]
            continue
        start, part = 0, []
        for leaf in by_tensor[tensor]:
            _, begin, count = leaves[leaf]
            if part and begin + count - start > size:
                pieces.append((tensor, tensor + 1, (start, begin), part))
                start, part = begin, []
            part.append(leaf)
        pieces.append((tensor, tensor + 1, (start, numel), part))
        first = tensor + 1
    if chunk:
        pieces.append((first, len(numels), None, chunk))
    return pieces
