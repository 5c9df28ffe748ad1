"""How a bucket's lists are split into kernel chunks and reach the kernel, kept between steps."""

from __future__ import annotations

import itertools
import math
import operator
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from ..._torch_internals import bump_versions
from .._census import SameMeta
from .._checks import _SHAPE_OF, DTYPE_OF, describe
from .._memory import _flat, _layouts, bytes_spanned
from . import config
from .config import _GRAPHS_PER_PLAN, _TRITON_ROW_LIMIT
from .graphs import _caching_allocator, _StepGraph

if TYPE_CHECKING:
    from .._census import _SlotRecord
    from .kernel import _FusedKernel
    from .run import FusedStep


# The tensors that fill up a last chunk.
_FUSED_FILLERS: dict[tuple[torch.device, torch.dtype, int, int], list[list[Tensor]]] = {}


class _KeptByIdentity:
    """Values kept under objects, found by the object's identity; an entry goes with its object.

    torch's ``WeakIdKeyDictionary`` makes a reference object and runs three Python methods at
    each lookup (10 µs of a fused step's host time); here a lookup is one ``dict.get`` by ``id``
    and one dereference, compared with the key the caller holds.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def get(self, key: Any, default: Any = None) -> Any:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else default

    def __getitem__(self, key: Any) -> Any:
        entry = self._entries.get(id(key))
        if entry is None or entry[0]() is not key:
            raise KeyError(key)
        return entry[1]

    def __setitem__(self, key: Any, value: Any) -> None:
        entries, at = self._entries, id(key)

        def forget(ref: weakref.ref[Any]) -> None:
            entry = entries.get(at)
            if entry is not None and entry[0] is ref:
                del entries[at]

        entries[at] = (weakref.ref(key, forget), value)

    def values(self) -> list[Any]:
        return [value for _, value in self._entries.values()]


class _FusedPlan:
    """How ``run_fused`` splits one bucket's lists into kernel chunks, kept between steps.

    A plan partitions the rows between the kernels and the loop, groups the
    kernel rows into chunks of ``FUSED_CHUNK`` (the last one filled up with kept
    tensors), and keeps, per kernel, where each argument of each chunk's call is
    taken from (see :meth:`call`). How the rows reach the kernel depends on it:

    - On CPU the call goes to the one C++ function of the generated code (see
      :func:`_kernel_alone`), which reads where each row starts and takes the
      sizes from the chunk: every tensor goes in as it is, this step's. Such a
      plan holds none of the user's tensors and depends on their metadata alone
      (sizes, layouts, dtypes): memory moved under a tensor (``p.data = ...``, a
      loaded checkpoint's slots) is where the next call reads and writes.
    - Otherwise (CUDA, or a graph whose C++ function cannot be called alone)
      the kernel takes flat rows. Flattening a tensor (``view(-1).detach()``:
      an alias that is not a view, because the graph would guard on a view's
      base) costs about as much host time as a call spends per tensor, so the
      plan holds flat aliases of the parameters and slots, and is used again
      while every parameter and slot has the same ``data_ptr`` and every alias
      is where it was (memory freed under it, by
      ``untyped_storage().resize_(0)``, is not). Holding the aliases keeps that
      memory allocated, so a tensor at the same ``data_ptr`` and size is the
      same bytes, whatever object carries it. So does a plan with rows in the
      loop, whose partition depends on which rows share memory. Gradients are
      flattened every step: holding last step's would keep their memory
      allocated while the next backward makes new ones.

    Either way a plan is used again only while every tensor has the size and
    layout (see :func:`_layouts`) it had when the plan was made. It lives as
    long as the tensor it is kept under: the bucket's first slot (the
    optimizer's own: a plan goes with its optimizer or a loaded state), or, for
    rules without slots, its first parameter. Memory a plan holds that its
    tensors no longer use (after ``p.data = ...``) is let go at the next fused
    step over that bucket.
    """

    _kept: ClassVar[_KeptByIdentity] = _KeptByIdentity()

    def __init__(
        self,
        single: Callable[..., None],
        lists: tuple[list[Tensor], ...],
        signature: Any,
        kernel: _FusedKernel,
        scalars: dict[str, Any],
    ):
        self.single, self.signature, self.chunk_size = single, signature, config.FUSED_CHUNK
        params = lists[0]
        layouts = zip(*signature[2], strict=True)  # per row, of each non-empty list (see _layouts)
        # Triton indexes in 32 bits for the sizes the kernels are compiled for; Inductor guards
        # that, but the direct calls skip its guards, so larger rows take the loop.
        largest = _TRITON_ROW_LIMIT if params[0].device.type != "cpu" else math.inf
        fits = [
            2 <= p.numel() <= largest and bool(row[0]) and row.count(row[0]) == len(row)
            for p, row in zip(params, layouts, strict=True)
        ]
        if not all(fits):
            # The loop's rows are updated before the kernels': one sharing memory with a kernel
            # row (weights tied through a transpose) would see the updates in another order.
            for i in _rows_sharing_memory(params, [not f for f in fits]):
                fits[i] = False
        self.loop_rows = [i for i, f in enumerate(fits) if not f]
        kernel_rows = [i for i, f in enumerate(fits) if f]
        # Row indices of each chunk (of at most config.FUSED_CHUNK; the last one filled up).
        self.chunks = [
            kernel_rows[start : start + config.FUSED_CHUNK]
            for start in range(0, len(kernel_rows), config.FUSED_CHUNK)
        ]
        if self.chunks:
            kernel.ready(lists, scalars)
        # Whether the kernel's C++ function is called alone (as it was when the plan was made).
        self.alone = kernel.alone is not None
        # Whether the rows go in as they are (no alias held, see above).
        self.as_they_are = self.alone and not self.loop_rows
        # Each call's arguments are picked from one list made at each step: every list's rows,
        # then these constants (the fillers of each list, the rows' sizes, a filler's size),
        # then the scalars.
        self.filled = fill = _fillers_by_list(lists, -len(kernel_rows) % config.FUSED_CHUNK)
        # Where each list's rows start in that list (an empty list takes no place).
        self.starts = list(itertools.accumulate(map(len, lists), initial=0))
        self.constants: list[Any] = [t for f in fill.values() for t in f]
        self.constants += [p.numel() for p in params] + [2]
        # The aliases of the user's tensors where they do not go in as they are (None for the loop's
        # rows), and where they were: memory freed under them moves them to null.
        self.sources: list[list[Tensor | None]] = []
        if not self.as_they_are:
            self.sources = [
                [_flat(t) if f else None for t, f in zip(lst, fits, strict=True)] if lst and j != 1 else []
                for j, lst in enumerate(lists)
            ]
        self.aliases = [t for lst in self.sources for t in lst if t is not None]
        self.alias_addresses = list(map(Tensor.data_ptr, self.aliases))
        # Kernel rows of more than one dimension, whose gradients are flattened for a kernel that
        # takes flat rows: contiguous ones, and those dense in a channels-last format.
        self.raveled = [i for i in kernel_rows if signature[2][0][i] is True and params[i].dim() != 1]
        self.channels_last = [i for i in kernel_rows if signature[2][0][i] is not True]
        self.on_cuda = params[0].device.type == "cuda"
        self._calls: dict[int, tuple[list[Callable[[list[Any]], tuple[Any, ...]]], list[str]]] = {}
        self.graphs: list[_StepGraph] = []  # the latest first
        # The gradients' addresses at the last steps that replayed no graph, the latest first.
        self._recent: list[list[int]] = []
        self._capture_failed = False
        # The metadata of every tensor of the lists the plan was last found to hold for, and
        # whether that was within step() (see _holds_as_last_found).
        self.found_for: tuple[SameMeta | None, bool] = (None, True)
        # Where step() had checked the parameters, gradients and slots then: the kept metadata
        # its census found them to have, and that its check of the slots found (see FusedStep.held).
        self.found_with: tuple[SameMeta, _SlotRecord | None] | None = None

    def call(self, kernel: _FusedKernel, lists: tuple[list[Tensor], ...], scalars: dict[str, Any]) -> None:
        """Run ``kernel`` over every chunk: one step of the update for the kernel's rows.

        The plan may have been made for another kernel of the rule (other scalars): one that
        is called alone if this one is.
        """
        kernel.ready(lists, scalars)
        if kernel.call_layout is None:
            # No placed inputs: through torch.compile, a chunk of flat rows at a time.
            pool = self._pool(kernel, lists)
            for lst in self._chunk_lists(pool):
                kernel._through_dynamo_patched(lst, scalars)
            return
        getters, names = self._calls.get(id(kernel)) or self._getters(kernel)
        pool = self._pool(kernel, lists)
        pool += map(scalars.__getitem__, names)
        # (What the kernels make of the fillers is never read: each element is updated on its own.)
        if kernel.alone is not None:
            for get in getters:
                kernel.alone(*get(pool))
        elif kernel.inner is not None:
            for get in getters:
                kernel.inner(list(get(pool)))
        else:
            for get in getters:
                kernel.direct(*get(pool))
            return
        # The generated code leaves autograd's version counters of what it writes to its caller.
        if self.as_they_are:
            bump_versions(list(itertools.chain(lists[0], *lists[2:])) if len(lists) > 2 else lists[0])
        else:
            bump_versions(self.aliases)
        if "inv_scale" in scalars:  # (the gradients, unscaled in place: see _unscaling)
            bump_versions(lists[1])

    def _pool(self, kernel: _FusedKernel, lists: tuple[list[Tensor], ...]) -> list[Any]:
        """This step's rows of every list, then :attr:`constants` (the scalars go last)."""
        if self.as_they_are:
            pool = list(itertools.chain.from_iterable(lists))
        else:
            grads = list(lists[1])
            if kernel.alone is None:
                # Flat, as the kernel takes them (in memory order, as the row's parameter and
                # slots; ravel would copy a channels-last gradient in logical order).
                for i in self.raveled:
                    grads[i] = grads[i].ravel()
                for i in self.channels_last:
                    grads[i] = grads[i].as_strided((grads[i].numel(),), (1,))
            pool = list(
                itertools.chain.from_iterable(grads if j == 1 else lst for j, lst in enumerate(self.sources))
            )
        pool += self.constants
        return pool

    def _getters(
        self, kernel: _FusedKernel
    ) -> tuple[list[Callable[[list[Any]], tuple[Any, ...]]], list[str]]:
        """Per chunk, what picks the arguments of ``kernel``'s call from the step's pool (see
        :meth:`_pool`), and the names of the scalars at its end."""
        assert kernel.call_layout is not None
        names = sorted({where for kind, where in kernel.call_layout if kind == "scalar"})
        starts = self.starts
        base = starts[-1]
        filler_at, k = {}, base
        for j, f in self.filled.items():
            filler_at[j], k = k, k + len(f)
        sizes_at, filler_size_at = k, base + len(self.constants) - 1
        scalars_at = base + len(self.constants)
        getters = []
        for rows in self.chunks:
            real = len(rows)
            at = []
            for kind, where in kernel.call_layout:
                if kind == "row":
                    j, i = where
                    at.append(starts[j] + rows[i] if i < real else filler_at[j] + i - real)
                elif kind == "scalar":
                    at.append(scalars_at + names.index(where))
                else:
                    at.append(sizes_at + rows[where] if where < real else filler_size_at)
            getters.append(operator.itemgetter(*at))
        self._calls[id(kernel)] = getters, names
        return getters, names

    def _chunk_lists(self, pool: list[Any]) -> Iterator[list[list[Tensor]]]:
        """Each chunk's flat rows of every list, filled up (for calls through torch.compile)."""
        starts = self.starts
        for rows in self.chunks:
            yield [
                [pool[start + i] for i in rows] + self.filled[j][: config.FUSED_CHUNK - len(rows)]
                if j in self.filled
                else []
                for j, start in enumerate(starts[:-1])
            ]

    def step_graph(
        self, kernel: _FusedKernel, lists: tuple[list[Tensor], ...], scalars: dict[str, Any]
    ) -> _StepGraph | None:
        """The CUDA graph of :meth:`call` for gradients at these addresses, or None (call the kernels).

        A graph is captured at a step whose gradients are where they were at one
        of the last few steps that replayed none: the caching allocator hands a
        training loop's gradients the same memory from step to step, or a few
        sets of it in turn (state that an optimizer replaces at every step
        moves the small allocations around). A plan keeps the last
        ``_GRAPHS_PER_PLAN`` graphs. One that cannot be captured here is not
        tried again for this plan.
        """
        if self._capture_failed or torch.cuda.is_current_stream_capturing() or not _caching_allocator():
            return None
        grads = lists[1]
        if any(isinstance(v, Tensor) and v.device != grads[0].device for v in scalars.values()):
            # A CPU scalar (a functional caller's) is read on the host as the kernel is launched:
            # a graph would keep the value it was captured with.
            return None
        addresses = list(map(Tensor.data_ptr, grads))
        for graph in self.graphs:
            if graph.kernel is kernel and graph.addresses == addresses:
                return graph
        if addresses not in self._recent:
            self._recent = [addresses, *self._recent[: _GRAPHS_PER_PLAN - 1]]
            return None
        self._recent.remove(addresses)
        try:
            graph = _StepGraph(self, kernel, lists, scalars, addresses)
        except Exception as error:  # a capture refused on this device or driver: the kernels still work
            self._capture_failed = True
            self.graphs = []
            warnings.warn(
                f"fused=True on CUDA: the step could not be captured as a CUDA graph ({error}); "
                "the kernels are launched one call at a time, with the same numbers and more host time",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        self.graphs = [graph, *self.graphs[: _GRAPHS_PER_PLAN - 1]]
        return graph

    @classmethod
    def of(
        cls,
        single: Callable[..., None],
        lists: tuple[list[Tensor], ...],
        kernel: _FusedKernel,
        scalars: dict[str, Any],
        step: FusedStep | None = None,
    ) -> _FusedPlan:
        """The kept plan for ``lists`` if it still holds, else a new one (kept in its place).
        ``step``: what ``Optimizer._apply`` knows of the call (see :class:`FusedStep`)."""
        kept = [lists[0], *lists[2:]]
        key = next((lst[0] for lst in lists[2:] if lst), lists[0][0])
        plan = cls._kept.get(key)
        in_step = step is not None and step.in_step
        held = step.held if step is not None else None
        if held is not None and not (lists[0] is held[1] and lists[1] is held[2]):
            held = None
        alone = kernel.alone is not None
        if (
            plan is not None
            and plan.single is single
            and plan.alone == alone
            and plan._holds_as_last_found(lists, kept, in_step, held)
        ):
            if held is not None:
                # (Found now with these records, whether or not it was last time.)
                plan.found_with = (held[0], held[3])
            return plan
        # Addresses and sizes of parameters and slots, layout of every tensor (gradients too).
        signature = (
            [list(map(Tensor.data_ptr, lst)) for lst in kept],
            [list(map(Tensor.numel, lst)) for lst in kept],
            [_layouts(lst) for lst in lists if lst],
            torch.is_inference_mode_enabled(),
        )
        # The kernels read and write each row as its parameter's size and its list's dtype: a
        # row that differs would be read past its end. Gradients are new at every step, and
        # checked here again although step() checked them: a TF-style callable hyperparameter,
        # evaluated since, or a subclass's own update can have replaced one. Their devices are
        # left to the optimizers, which check every gradient against its parameter.
        _check_rows_fit("gradient", lists[1], signature[1][0], every_step=True)
        # So are parameters and slots (a plan kept may not depend on which tensors they are).
        _check_rows_fit("parameter", lists[0], signature[1][0])
        for lst in lists[2:]:
            _check_rows_fit("slot", lst, signature[1][0])
        if not signature[3]:
            _refuse_inference_rows(lists)
        if not in_step:
            # Called as a functional form: rows are flattened, so one of its parameter's size
            # in another shape would be applied where the loop refuses it.
            _check_row_shapes(lists)
        if (
            plan is None
            or plan.single is not single
            or plan.alone != alone
            or plan.chunk_size != config.FUSED_CHUNK
            or not plan._made_for(signature)
        ):
            plan = cls._kept[key] = cls(single, lists, signature, kernel, scalars)
        plan.found_for = (SameMeta.of([t for lst in lists for t in lst]), in_step)
        plan.found_with = (held[0], held[3]) if held is not None else None
        return plan

    def _holds_as_last_found(
        self,
        lists: tuple[list[Tensor], ...],
        kept: list[list[Tensor]],
        in_step: bool,
        held: tuple[SameMeta, list[Tensor], list[Tensor], _SlotRecord | None] | None,
    ) -> bool:
        """Whether every tensor of ``lists`` is as when :meth:`of` last found this plan to hold,
        without reading each one's properties in Python (:class:`SameMeta`).

        The gradients included, so that they passed that step's checks of them; and, for a plan
        that holds aliases, parameters and slots at the same addresses and the aliases where they
        were. A plan found within ``step()`` is not taken for a functional call, which checks
        rows step() had already checked. ``held``: step() found the parameters, gradients and
        slots to have the metadata it kept (see ``FusedStep.held``); if it kept that when the
        plan was last found, none is read again.
        """
        same, found_in_step = self.found_for
        if same is None or not (in_step or not found_in_step) or self.chunk_size != config.FUSED_CHUNK:
            return False
        if self.signature[3] != torch.is_inference_mode_enabled():
            return False
        if not (
            held is not None
            and self.found_with is not None
            and self.found_with[0] is held[0]
            and self.found_with[1] is held[3]
        ) and not same.holds([t for lst in lists for t in lst]):
            return False
        if self.as_they_are:
            return True
        return [list(map(Tensor.data_ptr, lst)) for lst in kept] == self.signature[
            0
        ] and self._aliases_in_place()

    def _made_for(self, signature: Any) -> bool:
        """Whether the plan was made for tensors of ``signature`` (see :meth:`of`): the same sizes
        and layouts, and, for a plan that holds aliases, the same addresses, its aliases where
        they were."""
        if self.signature[1:] != signature[1:]:
            return False
        return self.as_they_are or (self.signature[0] == signature[0] and self._aliases_in_place())

    def _aliases_in_place(self) -> bool:
        """Whether the plan's aliases are where they were made (memory freed under a tensor moves
        its alias to null)."""
        return list(map(Tensor.data_ptr, self.aliases)) == self.alias_addresses


def _rows_sharing_memory(params: list[Tensor], marked: list[bool]) -> list[int]:
    """The rows not ``marked`` whose memory overlaps, directly or through others, a marked row's."""
    spans = []
    for i, p in enumerate(params):
        if p.numel():
            start = p.data_ptr()
            spans.append((str(p.device), start, start + bytes_spanned(p), i))
    spans.sort()
    found: list[int] = []
    cluster: list[int] = []
    end, device = -1, ""
    for dev, start, stop, i in [*spans, ("", -1, -1, -1)]:
        if dev != device or start >= end:  # a new cluster of overlapping rows begins
            if any(marked[j] for j in cluster):
                found.extend(j for j in cluster if not marked[j])
            cluster, end, device = [], stop, dev
        cluster.append(i)
        end = max(end, stop)
    return found


def _check_row_shapes(lists: tuple[list[Tensor], ...]) -> None:
    """Every gradient and slot has its parameter's shape, as the reference loop's ops require."""
    shapes = list(map(_SHAPE_OF, lists[0]))
    for j, lst in enumerate(lists[1:], start=1):
        if lst and list(map(_SHAPE_OF, lst)) != shapes:
            what = "gradient" if j == 1 else "slot"
            i = next(i for i, (t, shape) in enumerate(zip(lst, shapes, strict=True)) if t.shape != shape)
            raise ValueError(
                f"fused update: {what} {i} ({describe(lst[i])}) does not fit: its parameter has "
                f"shape {tuple(shapes[i])}"
            )


def _refuse_inference_rows(lists: tuple[list[Tensor], ...]) -> None:
    """Refuse, as the loop's in-place ops do, parameters or slots made under ``torch.inference_mode()``
    when updating outside it (the kernels write to them unchecked)."""
    for j, lst in enumerate(lists):
        if j != 1 and any(map(Tensor.is_inference, lst)):
            i = next(i for i, t in enumerate(lst) if t.is_inference())
            what = "parameter" if j == 0 else "slot"
            raise RuntimeError(
                f"fused update: {what} {i} is an inference tensor (made under torch.inference_mode()); "
                "it cannot be updated in place outside inference mode. Make a clone of it first"
            )


def _check_rows_fit(what: str, rows: list[Tensor], numels: list[int], every_step: bool = False) -> None:
    """Every row of a fused update's list has its parameter's size, and the dtype and device of
    the list's first row (the functional forms take lists from anywhere).

    ``every_step``: the check made at every step, on sizes and dtypes only (0.1 ms per 1000
    rows, against 0.25 ms with devices); any failure is then explained in full.
    """
    if not rows:
        return
    if len(rows) != len(numels):
        raise ValueError(f"fused update: {len(rows)} {what}s for {len(numels)} parameters")
    first = rows[0]
    if every_step:
        fits = len(set(map(DTYPE_OF, rows))) == 1
    else:
        fits = all(t.dtype == first.dtype and t.device == first.device for t in rows)
    if not fits or list(map(Tensor.numel, rows)) != numels:
        for i, t in enumerate(rows):
            if t.numel() != numels[i] or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"fused update: {what} {i} ({describe(t)} on {t.device}) does not fit: its "
                    f"parameter has {numels[i]} elements, and {what} 0 is {first.dtype} on {first.device}"
                )


def _filler(like: Tensor, count: int) -> list[list[Tensor]]:
    """``count`` lists of ``FUSED_CHUNK`` two-element tensors on ``like``'s device and dtype.

    Each has storage of its own: inputs that alias one another would make the
    compiled graph depend on how many of them a call takes. They are made
    outside inference mode, whatever the caller's, since every later step
    zeroes them in place.
    """
    key = (like.device, like.dtype, count, config.FUSED_CHUNK)
    if key not in _FUSED_FILLERS:
        with torch.inference_mode(False):
            _FUSED_FILLERS[key] = [
                [torch.zeros(2, dtype=like.dtype, device=like.device) for _ in range(config.FUSED_CHUNK)]
                for _ in range(count)
            ]
    return _FUSED_FILLERS[key]


def _fillers_by_list(lists: tuple[list[Tensor], ...], missing: int) -> dict[int, list[Tensor]]:
    """``missing`` fillers for each non-empty list, in that list's dtype (the kernel reads each
    list's rows as its dtype), none shared between two lists."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for j, lst in enumerate(lists):
        if lst:
            by_dtype.setdefault(lst[0].dtype, []).append(j)
    fill: dict[int, list[Tensor]] = {}
    for indices in by_dtype.values():
        made = _filler(lists[indices[0]][0], len(indices))
        fill.update((j, f[:missing]) for j, f in zip(indices, made, strict=True))
    return fill
