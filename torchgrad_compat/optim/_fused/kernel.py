"""A rule's reference loop compiled by Inductor into one kernel per chunk, called directly."""

from __future__ import annotations

import threading
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..._torch_internals import (
    compiled_fx_graph_type,
    fused_compile_settings,
    inductor_compile,
    triton_options,
    triton_rounds_as_eager,
)
from . import config
from .config import _FUSED_GRAPH_LIMIT, _FUSED_SIZE_HINT


class _FusedKernel:
    """``single`` compiled for chunks of ``FUSED_CHUNK`` flat rows, called without dynamo's per-call work.

    Through ``torch.compile`` a call over 32 rows of four tensors cost 160 µs
    of host time, whatever the sizes: dynamo's guards, the size of every
    input read back through a Python call, Inductor's check of every input's
    size and stride. The kernel itself, for tiny tensors, is 2 µs. So the
    graph is compiled once, through ``torch.compile`` with a backend that
    keeps Inductor's compiled function (without the size checks), and each
    later call hands that function its inputs directly, in the order of the
    graph's placeholders: 16 µs a call. The graph is compiled on tensors of
    zeros (see :meth:`_compile`) and the order read from that call: each
    tensor input is found among its tensors by identity, and each symbolic
    size through the tensor it is the size of. The guards
    dynamo would check are what the caller guarantees: rows are 1-D,
    contiguous, of at least two elements, and of the dtypes, device and
    options of this kernel's key (see :meth:`of`). Should the graph take an
    input that cannot be placed so (a torch release that lifts something
    else), every call goes through ``torch.compile`` as usual. Below that
    function sits Inductor's generated Python (:func:`_generated_call`), and on
    CPU below that one C++ function, which calls go to where they can
    (:func:`_kernel_alone`).
    """

    _compiled: ClassVar[dict[Any, _FusedKernel]] = {}

    def __init__(self, single: Callable[..., None], device: torch.device):
        self.device = device
        self.layout: list[tuple[str, Any]] | None = None
        self.direct: Callable[..., Any] | None = None
        # Inductor's generated ``call``, under ``direct``'s wrappers (see :func:`_generated_call`).
        # It leaves autograd's version counters of what it writes to the caller.
        self.inner: Callable[[list[Any]], Any] | None = None
        # On CPU, the one C++ function ``inner`` calls, taken alone (see :func:`_kernel_alone`).
        self.alone: Callable[..., Any] | None = None
        # Where each argument of what a call goes to (``alone``, ``inner`` or ``direct``) comes
        # from, as ``layout`` says it (see :meth:`_FusedPlan.call`).
        self.call_layout: list[tuple[str, Any]] | None = None
        self._captured: tuple[torch.fx.GraphModule, list[Any], Callable[..., Any]] | None = None
        self._tried = False
        self._through_dynamo = torch.compile(single, dynamic=True, fullgraph=True, backend=self._backend)

    @classmethod
    def of(
        cls, single: Callable[..., None], lists: tuple[list[Tensor], ...], scalars: dict[str, Any]
    ) -> _FusedKernel:
        """The kernel for this rule, chunk size, device, dtypes and options (compiled at its first call)."""
        # (Comprehensions, not generators: this runs at every step, replayed ones too.)
        key = (
            single,
            config.FUSED_CHUNK,
            lists[0][0].device,
            tuple([lst[0].dtype if lst else None for lst in lists]),
            tuple(
                [
                    (name, (v.dtype, v.device, v.dim()) if isinstance(v, Tensor) else v)
                    for name, v in sorted(scalars.items())
                ]
            ),
        )
        kernel = cls._compiled.get(key)
        if kernel is None:
            kernel = cls._compiled[key] = cls(single, lists[0][0].device)
        return kernel

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        options = {"size_asserts": False}
        if self.device.type == "cuda":
            options.update(triton_options(config.FUSED_CHUNK))
            if not triton_rounds_as_eager(options):
                warnings.warn(
                    "fused=True on CUDA: this torch's Inductor has no option that turns off Triton's "
                    "contraction of a multiply and an add into one fused multiply-add, so the fused "
                    "update rounds once where the reference loop rounds twice (its last bits differ)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        compiled = inductor_compile(gm, example_inputs, options)
        self._captured = (gm, list(example_inputs), compiled)
        return compiled

    def ready(self, lists: tuple[list[Tensor], ...], scalars: dict[str, Any]) -> None:
        """Compile, if not tried yet, for lists of the dtypes and device of ``lists``."""
        if self.direct is None and not self._tried:
            self._compile(lists, scalars)

    def _compile(self, lists: Sequence[list[Tensor]], scalars: dict[str, Any]) -> None:
        """Compile on rows of zeros shaped as ``_FUSED_SIZE_HINT`` (the user's tensors are not touched).

        Inductor's C++ makes a loop OpenMP-parallel only if the sizes it
        compiles for are large enough, and its disk cache does not key on
        them: a kernel first compiled for small tensors would run on one
        thread for every size, in every later process (Adam, 10M parameters
        in 1000 tensors, 2 threads: 19.7 ms a step against 13.6 ms). So
        the sizes it sees are always the same.
        """
        self._tried = True
        like = [lst[0] if lst else None for lst in lists]
        dummies = [
            [
                torch.zeros(_FUSED_SIZE_HINT + i, dtype=t.dtype, device=t.device)
                for i in range(config.FUSED_CHUNK)
            ]
            if t is not None
            else []
            for t in like
        ]
        self._through_dynamo_patched(dummies, scalars)
        if self._captured is not None:
            gm, inputs, compiled = self._captured
            self._captured = None
            self.layout = _placeholder_layout(gm, inputs, dummies, scalars)
            if self.layout is not None:
                self.direct = compiled
                self.call_layout = self.layout
                self.inner = _generated_call(self, compiled, like, scalars)
                if self.inner is not None and self.device.type == "cpu":
                    alone = _kernel_alone(self, self.inner, like, scalars)
                    if alone is not None:
                        self.alone, self.call_layout = alone

    def _through_dynamo_patched(self, lists: list[list[Tensor]], scalars: dict[str, Any]) -> None:
        # Without duck shaping, tensors that happen to share a size get their own symbols, so
        # that the graph does not depend on it. Each option an optimizer's rule tests in Python
        # (Ftrl's l1, l2, shrinkage, power) and each dtype is a graph of its own: more than
        # dynamo's default limit of 8 per function, which fullgraph turns into an error.
        with fused_compile_settings(_FUSED_GRAPH_LIMIT):
            self._through_dynamo(*lists, **scalars)


def _generated_call(
    kernel: _FusedKernel, compiled: Callable[..., Any], like: list[Tensor | None], scalars: dict[str, Any]
) -> Callable[[list[Any]], Any] | None:
    """The ``call`` Inductor generated for ``compiled`` (``kernel``'s, placed by its layout), if
    calling it alone gives the same rows.

    Between ``compiled`` and that function sit AOT autograd's runtime wrappers:
    8 of a call's 19 µs of host time, for a call over 16 tiny rows (CPU). What
    they do for this graph, which updates its inputs in place and returns
    nothing, is to bump the version counters of the inputs it writes: the plan
    does that for its rows once per step (:meth:`_FusedPlan.call`). Found by
    watching one call of ``compiled`` reach Inductor's compiled graph with the
    same inputs, and kept only if that function, called alone on random rows,
    writes the very values ``compiled`` writes on a copy of them. Else (another
    torch release's wrappers, a graph that leaves a write to them) None.
    """
    graph_type = compiled_fx_graph_type()
    if graph_type is None or any(t is not None and not t.is_floating_point() for t in like):
        return None
    with _PROBE_LOCK:
        return _probed_call(kernel, compiled, like, scalars, graph_type)


# One probe at a time: each patches CompiledFxGraph.__call__ for the whole process.
_PROBE_LOCK = threading.Lock()


def _probed_call(
    kernel: _FusedKernel,
    compiled: Callable[..., Any],
    like: list[Tensor | None],
    scalars: dict[str, Any],
    graph_type: Any,
) -> Callable[[list[Any]], Any] | None:
    rows = _probe_rows(like)
    copies = [[r.clone() for r in lst] for lst in rows]
    seen: list[tuple[Any, list[Any]]] = []
    original = graph_type.__call__
    probing = threading.get_ident()

    def watched(graph: Any, inputs: list[Any]) -> Any:
        if threading.get_ident() == probing:  # (compiled code other threads run meanwhile)
            seen.append((graph, list(inputs)))
        return original(graph, inputs)

    arguments = _probe_arguments(kernel.layout, rows, scalars)
    graph_type.__call__ = watched
    try:
        compiled(*arguments)
    except Exception:  # the probe only chooses how later calls are made; they still go through compiled
        return None
    finally:
        graph_type.__call__ = original
    if len(seen) != 1 or not _same_arguments(seen[0][1], arguments):
        return None
    generated = getattr(seen[0][0], "current_callable", None)
    if generated is None:
        return None
    try:
        generated(_probe_arguments(kernel.layout, copies, scalars))
    except Exception:
        return None
    return generated if _same_rows(rows, copies) else None


def _kernel_alone(
    kernel: _FusedKernel,
    generated: Callable[[list[Any]], Any],
    like: list[Tensor | None],
    scalars: dict[str, Any],
) -> tuple[Callable[..., Any], list[tuple[str, Any]]] | None:
    """The one C++ function that ``generated`` (Inductor's ``call`` on CPU) hands the rows to, and
    where each of its arguments comes from (as :attr:`_FusedKernel.layout` says it), if calling
    it alone gives the same rows.

    ``generated`` is Python: it unpacks its inputs, reads each row's size back
    through ``Tensor.size()`` and passes everything on to that function. With the
    cache cold, as it is after a model's backward pass, that took 35 to 40 µs a
    call over 16 rows (0.27 ms of a step over 100 rows of 10,000 floats, where the
    kernels themselves took 0.5 ms); the chunk knows the sizes already. Found by
    recording the calls ``generated`` makes to the compiled functions of its module
    during one call on rows of distinct sizes: exactly one must be made, and each of
    its arguments must be one of the inputs (by identity) or the size of exactly one
    row. Kept only if that function, called alone so, writes on random rows the very
    values ``generated`` writes on a copy of them. Else (a graph of several kernels or
    of buffers of its own, another torch release's code) None, and calls go through
    ``generated``.
    """
    code, namespace = getattr(generated, "__code__", None), getattr(generated, "__globals__", None)
    if code is None or not isinstance(namespace, dict):
        return None
    names = [n for n in code.co_names if isinstance(namespace.get(n), types.BuiltinFunctionType)]
    rows = _probe_rows(like)
    arguments = _probe_arguments(kernel.layout, rows, scalars)
    seen: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    probing = threading.get_ident()

    def recorded(function: Callable[..., Any]) -> Callable[..., Any]:
        def record(*args: Any) -> Any:
            if threading.get_ident() == probing:  # (other threads running this graph meanwhile)
                seen.append((function, args))
            return function(*args)

        return record

    with _PROBE_LOCK:
        originals = {n: namespace[n] for n in names}
        namespace.update({n: recorded(f) for n, f in originals.items()})
        try:
            generated(list(arguments))
        except Exception:
            return None
        finally:
            namespace.update(originals)
    if len(seen) != 1:
        return None
    function, args = seen[0]
    at = {id(a): k for k, a in enumerate(arguments) if isinstance(a, Tensor)}
    rows_of_size: dict[int, list[int]] = {}
    for i, t in enumerate(rows[0]):
        rows_of_size.setdefault(t.numel(), []).append(i)
    layout: list[tuple[str, Any]] = []
    for a in args:
        if isinstance(a, Tensor) and id(a) in at:
            layout.append(kernel.layout[at[id(a)]])
        elif type(a) is int and len(rows_of_size.get(a, ())) == 1:
            layout.append(("size", rows_of_size[a][0]))
        else:
            return None
    if {where for kind, where in layout if kind == "size"} != set(range(len(rows[0]))):
        return None
    rows, copies = _probe_rows(like), _probe_rows(like)
    try:
        generated(_probe_arguments(kernel.layout, rows, scalars))
        function(*_probe_arguments(layout, copies, scalars))
    except Exception:
        return None
    return (function, layout) if _same_rows(rows, copies) else None


def _probe_rows(like: list[Tensor | None]) -> list[list[Tensor]]:
    """A chunk's rows for a probe of a compiled kernel: random, every row of its own size."""
    generator = torch.Generator().manual_seed(0)
    return [
        [
            torch.rand(_FUSED_SIZE_HINT + i, generator=generator, dtype=t.dtype).add_(0.5).to(t.device)
            for i in range(config.FUSED_CHUNK)
        ]
        if t is not None
        else []
        for t in like
    ]


def _probe_arguments(
    layout: list[tuple[str, Any]], lists: list[list[Tensor]], scalars: dict[str, Any]
) -> list[Any]:
    """Arguments placed as ``layout`` says, for a chunk of all of ``lists``'s rows."""
    return [
        lists[where[0]][where[1]]
        if kind == "row"
        else scalars[where]
        if kind == "scalar"
        else lists[0][where].numel()
        for kind, where in layout
    ]


def _same_rows(rows: list[list[Tensor]], copies: list[list[Tensor]]) -> bool:
    return all(
        torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())
        for lst, copied in zip(rows, copies, strict=True)
        for a, b in zip(lst, copied, strict=True)
    )


def _same_arguments(seen: list[Any], given: list[Any]) -> bool:
    return len(seen) == len(given) and all(
        a is b or (type(a) is int and type(b) is int and a == b) for a, b in zip(seen, given, strict=True)
    )


def _placeholder_layout(
    gm: torch.fx.GraphModule, inputs: list[Any], lists: list[list[Tensor]], scalars: dict[str, Any]
) -> list[tuple[str, Any]] | None:
    """Where each input of a compiled chunk comes from, or None where one cannot be placed.

    ``("row", (j, i))``: ``lists[j][i]``; ``("scalar", name)``: the keyword
    argument; ``("size", i)``: the length of row ``i``. Every row must have
    its size as an input (a size the graph took as a constant would hold for
    no other chunk).
    """
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return None
    rows = {id(t): (j, i) for j, lst in enumerate(lists) for i, t in enumerate(lst)}
    names = {id(v): name for name, v in scalars.items() if isinstance(v, Tensor)}
    size_row: dict[Any, int] = {}
    for node, value in zip(placeholders, inputs, strict=True):
        fake = node.meta.get("example_value")
        if isinstance(value, Tensor) and id(value) in rows and isinstance(fake, Tensor) and fake.dim() == 1:
            if isinstance(fake.shape[0], torch.SymInt):
                size_row.setdefault(fake.shape[0].node.expr, rows[id(value)][1])
    layout: list[tuple[str, Any]] = []
    for node, value in zip(placeholders, inputs, strict=True):
        fake = node.meta.get("example_value")
        if isinstance(value, Tensor) and id(value) in rows:
            layout.append(("row", rows[id(value)]))
        elif isinstance(value, Tensor) and id(value) in names:
            layout.append(("scalar", names[id(value)]))
        elif isinstance(fake, torch.SymInt) and fake.node.expr in size_row:
            layout.append(("size", size_row[fake.node.expr]))
        else:
            return None
    sized = {where for kind, where in layout if kind == "size"}
    if sized != set(range(len(lists[0]))):
        return None
    return layout
