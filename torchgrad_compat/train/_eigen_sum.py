"""Sums over whole tensors in the order of TensorFlow's CPU kernels (Eigen's full reduction, one
thread), for many tensors at once.

Eigen adds a range of more than 1024 packets as two halves split at a packet boundary, summed
apart, then added; a shorter range (a *leaf*) in four packet-wide accumulators over blocks of four
packets (each lane a sequential sum over the blocks), folded into the first, then the remaining
packets one by one, the tail element by element, and the tail's sum plus the accumulator's lanes
added as a tree. A packet is 8 float32 or 4 float64 lanes (the AVX build of the x86 wheels).

The lanes' sequential sums are the cost: no torch reduction adds in that order. On the CPU the
tensors are copied one after another into a workspace (one plain copy each, into views kept for
their shapes), squared, and numpy reduces each run of equal consecutive leaves over its blocks:
numpy adds along an axis that is not the contiguous one element by element, so each lane adds
its blocks one after another (its pairwise summation is only along the contiguous axis).
Elsewhere (a GPU) the leaves are copied into buffers laid out block-major (``rows × leaves ×
lanes``, one per class of leaves with a similar number of blocks) and one elementwise addition
per row adds a block of every leaf. The rest (the packets after the blocks, the tails, the tree
of halves) are a few operations over all leaves together. Work is done in pieces of about 2M
elements, whose buffers are kept per thread and reused.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# Eigen's packet of the x86 TensorFlow wheels (AVX): 8 float32 or 4 float64 lanes.
PACKET = {torch.float32: 8, torch.float64: 4}
# Eigen sums halves of a longer range apart (pairwise), down to this many packets.
_LEAF_PACKETS = 1024
# Elements of the leaves copied at once: the buffers stay small and are reused piece after piece.
_PIECE = 1 << 21
_local = threading.local()


@dataclass(frozen=True)
class _Run:
    """Consecutive leaves of one tensor with the same length, in consecutive slots of one class."""

    tensor: int
    offset: int  # of the first leaf, in elements from the tensor's start
    leaves: int
    count: int  # elements per leaf
    cls: int
    slot: int  # the first leaf's slot in its class
    row: int  # the first leaf's row in the plan's per-leaf tensors


@dataclass(frozen=True)
class _Class:
    rows: int  # blocks of its longest leaf
    slots: int
    offset: int  # of its buffer in the piece's workspace
    padded: bool  # some leaf has fewer blocks than `rows`: those rows are zeroed before each copy
    row: int  # its first leaf's row in the plan's per-leaf tensors


@dataclass(frozen=True)
class _Piece:
    runs: tuple[_Run, ...]
    classes: tuple[_Class, ...]


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: _plan_of keeps one per key
class _Plan:
    lanes: int
    pieces: tuple[_Piece, ...]
    workspace: int  # elements of the largest piece's buffers
    leaves: int
    rest_index: Tensor  # where in `remainders` each leaf's 3 packets (3, leaves, lanes) and tail are
    joins: tuple[tuple[Tensor, Tensor, Tensor], ...]  # (node, left, right), deepest level first
    roots: Tensor  # each tensor's node
    numels: tuple[int, ...]
    leaf_rows: tuple[tuple[int, int, int, int], ...]  # (tensor, first, count, row), tensor order


def eigen_sums(tensors: list[Tensor], *, square: bool) -> Tensor:
    """Eigen's sum of each tensor (of its squares with ``square``) over all its elements, as a 1-d
    tensor; the tensors share one floating dtype of :data:`PACKET` and one device."""
    first = tensors[0]
    plan = _plan_of(tuple(t.numel() for t in tensors), PACKET[first.dtype])
    if first.device.type == "cpu":
        return _cpu_sums(tensors, plan, square)
    return _block_major_sums(tensors, plan, square)


def _block_major_sums(tensors: list[Tensor], plan: _Plan, square: bool) -> Tensor:
    """:func:`eigen_sums` through block-major buffers (a GPU's way: see the module's docstring)."""
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
        torch._foreach_copy_(targets, sources)
        for buffer, out in zip(buffers, outs, strict=True):
            if buffer.shape[0]:
                if square:
                    buffer.mul_(buffer)
                total = buffer.new_empty(buffer.shape[1:])  # contiguous, as the sum needs (see below)
                _sum_rows(buffer, total)
                out.copy_(total)
    rest = state.remainders[state.rest_index]
    return _tensor_sums(_finish_leaves(state.folded, rest, plan, square), state.joins, state.roots)


def _tensor_sums(
    leaf_sums: Tensor, joins: tuple[tuple[Tensor, Tensor, Tensor], ...], roots: Tensor
) -> Tensor:
    """Each tensor's sum from its leaves' sums: the halves of a split added, deepest first."""
    if not joins:
        return leaf_sums[roots]
    nodes = torch.cat([leaf_sums, leaf_sums.new_empty(sum(len(level[0]) for level in joins))])
    for node, left, right in joins:
        nodes[node] = nodes[left] + nodes[right]
    return nodes[roots]


def _sum_rows(buffer: Tensor, out: Tensor) -> None:
    """``out`` = each column's sum over the rows of ``buffer`` (at least one; rows of at least 64
    elements), the rows added one after another."""
    if buffer.device.type == "cpu":
        # numpy adds along an outer axis row by row, into one accumulator per column (its pairwise
        # summation is only along the contiguous axis of a reduction), on one thread: one call.
        np.add.reduce(buffer.numpy(), axis=0, out=out.numpy())
    else:
        _sum_rows_one_by_one(buffer, out)


def _sum_rows_one_by_one(buffer: Tensor, out: Tensor) -> None:
    """:func:`_sum_rows` with one elementwise addition per row (on a GPU, whose sums add in a tree)."""
    out.copy_(buffer[0])
    for row in buffer[1:]:
        out.add_(row)


def _finish_leaves(folded: Tensor, rest: Tensor, plan: _Plan, square: bool) -> Tensor:
    """Each leaf's sum: its four accumulators folded into the first and the packets after its
    blocks added (rows 0-3 and 4-6 of ``folded``, one sequence of additions), the tail summed
    element by element, then the tail's sum plus the accumulator's lanes added as a tree. ``rest``
    holds the packets after the blocks (3, leaves, lanes), then the tails (lanes - 1, leaves)."""
    lanes, leaves = plan.lanes, plan.leaves
    if square:
        rest.mul_(rest)
    folded[4:] = rest[: 3 * leaves * lanes].view(3, leaves, lanes)
    packet = folded.new_empty(leaves, lanes)
    _sum_rows(folded, packet)
    tail = folded.new_empty(leaves)
    tails = rest[3 * leaves * lanes :].view(lanes - 1, leaves)
    _sum_rows(tails, tail)
    while packet.shape[1] > 1:  # the upper half onto the lower, down to one lane
        half = packet.shape[1] // 2
        packet = packet[:, :half] + packet[:, half:]
    return tail + packet[:, 0]


@dataclass(frozen=True)
class _State:
    """A plan's buffers and index tensors on one device, the copy's targets among them."""

    targets: tuple[list[Tensor], ...]  # per piece, in the order of the sources eigen_sums makes
    buffers: tuple[tuple[Tensor, ...], ...]  # per piece and class: (rows, slots, 4, lanes)
    outs: tuple[tuple[Tensor, ...], ...]  # per piece and class: its slots of `folded`'s rows 0-3
    remainders: Tensor  # 4 * lanes per leaf: what follows its blocks, zeros after; then one zero
    rest_index: Tensor  # where each leaf's three packets (rows of 3) and tail (rows of lanes - 1) are
    folded: Tensor  # (7, leaves, lanes)
    joins: tuple[tuple[Tensor, Tensor, Tensor], ...]
    roots: Tensor


_STATES_KEPT = 8


def _state_of(plan: _Plan, dtype: torch.dtype, device: torch.device) -> _State:
    """The plan's state for this thread: buffers are reused call after call, one workspace per dtype
    and device shared by the plans (pieces are done one at a time)."""
    spaces = getattr(_local, "spaces", None)
    if spaces is None:
        spaces = _local.spaces = {}
    workspace, states = spaces.get((dtype, device), (None, {}))
    if workspace is None or workspace.numel() < plan.workspace:
        workspace, states = torch.empty(max(plan.workspace, 1), dtype=dtype, device=device), {}
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
    folded = workspace.new_zeros(7, leaves, lanes)
    all_targets, all_buffers, all_outs = [], [], []
    for piece in plan.pieces:
        buffers = tuple(
            workspace[cls.offset : cls.offset + cls.rows * cls.slots * block].view(
                cls.rows, cls.slots, 4, lanes
            )
            for cls in piece.classes
        )
        outs = tuple(folded[:4, cls.row : cls.row + cls.slots].permute(1, 0, 2) for cls in piece.classes)
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
    return _State(
        tuple(all_targets),
        tuple(all_buffers),
        tuple(all_outs),
        remainders,
        plan.rest_index.to(device),
        folded,
        tuple(tuple(i.to(device) for i in level) for level in plan.joins),
        plan.roots.to(device),
    )


@functools.lru_cache(maxsize=64)
def _plan_of(numels: tuple[int, ...], lanes: int) -> _Plan:
    """The leaves and joins of Eigen's sum of tensors of ``numels`` elements, and their layout."""
    block = 4 * lanes
    leaves: list[tuple[int, int, int]] = []  # (tensor, first, count) in tensor order
    joins: list[tuple[int, int, int, int]] = []  # (depth, node, left, right); leaves are nodes
    roots = []
    for tensor, numel in enumerate(numels):
        roots.append(_split(tensor, 0, numel, lanes, 0, leaves, joins))
    # Leaves are numbered by their place in the per-leaf tensors: piece, class, slot.
    order: dict[int, int] = {}
    pieces, workspace, row = [], 0, 0
    for chunk in _pieces(leaves):
        by_class: dict[int, list[int]] = {}
        for leaf in chunk:
            by_class.setdefault(_class_of(leaves[leaf][2] // block), []).append(leaf)
        classes, runs, offset = [], [], 0
        for cls, members in enumerate(by_class.values()):
            rows = max(leaves[leaf][2] // block for leaf in members)
            padded = any(leaves[leaf][2] // block != rows for leaf in members)
            slots = len(members) + len(members) % 2  # rows of at least 64 elements (see _sum_rows)
            classes.append(_Class(rows, slots, offset, padded, row))
            offset += rows * slots * block
            for slot, leaf in enumerate(members):
                order[leaf] = row + slot
                tensor, first, count = leaves[leaf]
                last = runs[-1] if runs else None
                if (
                    last is not None
                    and (last.tensor, last.count, last.cls) == (tensor, count, cls)
                    and last.offset + last.leaves * count == first
                    and last.slot + last.leaves == slot
                ):
                    runs[-1] = _Run(tensor, last.offset, last.leaves + 1, count, cls, last.slot, last.row)
                else:
                    runs.append(_Run(tensor, first, 1, count, cls, slot, row + slot))
            row += slots
        pieces.append(_Piece(tuple(runs), tuple(classes)))
        workspace = max(workspace, offset)
    # The packets after the blocks as rows (3, leaves, lanes), then the tails (lanes - 1, leaves);
    # where a leaf has fewer, the index of the zero after all remainders.
    # Rows for a multiple of 64 leaves (the unused ones sum zeros): the tails' rows too have at
    # least 64 elements.
    rows_used = -(-row // 64) * 64
    zero = rows_used * block
    packet_index = torch.full((3, rows_used, lanes), zero, dtype=torch.long)
    tail_index = torch.full((lanes - 1, rows_used), zero, dtype=torch.long)
    for leaf, (_, _, count) in enumerate(leaves):
        rest = count % block
        packets, tail = rest // lanes, rest % lanes
        at = order[leaf] * block
        packet_index[:packets, order[leaf]] = torch.arange(packets * lanes).view(packets, lanes) + at
        tail_index[:tail, order[leaf]] = torch.arange(tail) + at + packets * lanes
    rest_index = torch.cat([packet_index.view(-1), tail_index.view(-1)])

    def node(n: int) -> int:  # leaves first, in their rows' order, then the joins
        return order[n] if n >= 0 else rows_used - 1 - n

    levels = []
    for depth in sorted({j[0] for j in joins}, reverse=True):
        level = [j for j in joins if j[0] == depth]
        levels.append(tuple(torch.tensor([node(j[k]) for j in level]) for k in (1, 2, 3)))
    return _Plan(
        lanes,
        tuple(pieces),
        workspace,
        rows_used,
        rest_index,
        tuple(levels),
        torch.tensor([node(r) for r in roots]),
        numels,
        tuple((tensor, first, count, order[leaf]) for leaf, (tensor, first, count) in enumerate(leaves)),
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


def _pieces(leaves: list[tuple[int, int, int]]) -> list[list[int]]:
    """The leaves in consecutive groups of about :data:`_PIECE` elements."""
    pieces: list[list[int]] = [[]]
    size = 0
    for leaf, (_, _, count) in enumerate(leaves):
        if size and size + count > _PIECE:
            pieces.append([])
            size = 0
        pieces[-1].append(leaf)
        size += count
    return pieces


# ---------------------------------------------------------------- the CPU: numpy over the tensors as they lie


@dataclass(frozen=True)
class _FlatPiece:
    """Consecutive whole tensors, copied one after another into the workspace."""

    first: int  # the first tensor's index
    last: int  # one past the last's
    size: int  # elements
    runs: tuple[tuple[int, int, int, int], ...]  # consecutive leaves: (offset, leaves, count, row)
    rest_to: np.ndarray  # where in the `rest` vector (see _finish_leaves) ...
    rest_from: np.ndarray  # ... each element after the blocks of the piece's leaves goes


@functools.lru_cache(maxsize=64)
def _flat_pieces(plan: _Plan) -> tuple[_FlatPiece, ...]:
    """The tensors in pieces of about :data:`_PIECE` elements (a longer tensor alone), each leaf at
    its offset in its tensor, the tensors one after another."""
    lanes, rows, block = plan.lanes, plan.leaves, 4 * plan.lanes
    by_tensor: list[list[tuple[int, int, int]]] = [[] for _ in plan.numels]
    for tensor, first, count, row in plan.leaf_rows:
        by_tensor[tensor].append((first, count, row))
    pieces, start, size = [], 0, 0
    for tensor, numel in enumerate([*plan.numels, None]):
        if numel is None or (size and size + numel > _PIECE):
            runs: list[tuple[int, int, int, int]] = []
            rest_to: list[int] = []
            rest_from: list[int] = []
            offset = 0
            for t in range(start, tensor):
                for first, count, row in by_tensor[t]:
                    at = offset + first
                    last = runs[-1] if runs else None
                    if (
                        last
                        and last[2] == count
                        and last[0] + last[1] * count == at
                        and last[3] + last[1] == row
                    ):
                        runs[-1] = (last[0], last[1] + 1, count, last[3])
                    else:
                        runs.append((at, 1, count, row))
                    blocks = count // block
                    packets, tail = (count - blocks * block) // lanes, count % lanes
                    after = at + blocks * block
                    for k in range(packets * lanes):
                        rest_to.append((k // lanes) * rows * lanes + row * lanes + k % lanes)
                        rest_from.append(after + k)
                    for j in range(tail):
                        rest_to.append(3 * rows * lanes + j * rows + row)
                        rest_from.append(after + packets * lanes + j)
                offset += plan.numels[t]
            pieces.append(
                _FlatPiece(
                    start,
                    tensor,
                    offset,
                    tuple(runs),
                    np.array(rest_to, dtype=np.int64),
                    np.array(rest_from, dtype=np.int64),
                )
            )
            start, size = tensor, 0
        if numel is not None:
            size += numel
    return tuple(p for p in pieces if p.last > p.first)


def _cpu_sums(tensors: list[Tensor], plan: _Plan, square: bool) -> Tensor:
    """:func:`eigen_sums` on the CPU: each piece of tensors copied as it lies (one copy per tensor,
    no view to make), squared, then one numpy reduction per run of equal leaves, each lane of each
    leaf adding its blocks one after another (numpy reduces an axis that is not the contiguous one
    element by element along it)."""
    lanes, rows, block = plan.lanes, plan.leaves, 4 * plan.lanes
    pieces = _flat_pieces(plan)
    dtype = tensors[0].dtype
    workspace, all_targets = _flat_targets(plan, tuple(t.shape for t in tensors), dtype)
    flat = workspace.numpy()
    accumulators = torch.zeros(rows, block, dtype=dtype)
    sums = accumulators.numpy()
    rest = torch.zeros(3 * rows * lanes + (lanes - 1) * rows, dtype=dtype)
    rest_values = rest.numpy()
    itemsize = flat.itemsize
    for piece, targets in zip(pieces, all_targets, strict=True):
        torch._foreach_copy_(targets, tensors[piece.first : piece.last])
        data = flat[: piece.size]
        if square:
            np.multiply(data, data, out=data)
        for offset, leaves, count, row in piece.runs:
            blocks = count // block
            if blocks:
                view = np.lib.stride_tricks.as_strided(
                    data[offset:], (leaves, blocks, block), (count * itemsize, block * itemsize, itemsize)
                )
                np.add.reduce(view, axis=1, out=sums[row : row + leaves])
        rest_values[piece.rest_to] = data[piece.rest_from]
    folded = torch.empty(7, rows, lanes, dtype=dtype)
    folded[:4] = accumulators.view(rows, 4, lanes).transpose(0, 1)
    leaf_sums = _finish_leaves(folded, rest, plan, square=False)
    return _tensor_sums(leaf_sums, plan.joins, plan.roots)


def _flat_targets(
    plan: _Plan, shapes: tuple[torch.Size, ...], dtype: torch.dtype
) -> tuple[Tensor, tuple[list[Tensor], ...]]:
    """This thread's CPU workspace for ``dtype``, and per piece the views of it each tensor is
    copied into (shaped as the tensor, one after another), kept for the plan and shapes."""
    pieces = _flat_pieces(plan)
    spaces = getattr(_local, "flat", None)
    if spaces is None:
        spaces = _local.flat = {}
    size = max(p.size for p in pieces)
    workspace, kept = spaces.get(dtype, (None, {}))
    if workspace is None or workspace.numel() < size:
        workspace, kept = torch.empty(max(size, 1), dtype=dtype), {}
        spaces[dtype] = (workspace, kept)
    key = (plan, shapes)
    targets = kept.pop(key, None)
    if targets is None:
        targets = []
        for piece in pieces:
            views, offset = [], 0
            for shape, numel in zip(
                shapes[piece.first : piece.last], plan.numels[piece.first : piece.last], strict=True
            ):
                views.append(workspace[offset : offset + numel].view(shape))
                offset += numel
            targets.append(views)
        targets = tuple(targets)
    kept[key] = targets  # the most recently used last
    while len(kept) > _STATES_KEPT:
        del kept[next(iter(kept))]
    return workspace, targets
