"""``tf.gradients`` and ``tf.hessians`` on an eager PyTorch autograd graph.

TensorFlow builds a graph first and differentiates it symbolically; PyTorch
records the graph while the forward pass runs. These functions take tensors that
were computed with autograd recording (``ys``) and tensors that require grad
(``xs``) and return what ``tf.compat.v1.gradients`` / ``tf.compat.v1.hessians``
return for the same computation:

- ``gradients(ys, xs)``: for each ``x``, the derivative of ``sum(ys)`` (each
  ``y`` weighted by its ``grad_ys`` entry), ``None`` (or zeros) where ``x`` is not
  connected, with ``stop_gradients`` treated as constants;
- ``hessians(ys, xs)``: for each ``x``, the Hessian of ``sum(ys)`` with respect to
  that ``x`` alone (no cross blocks), shaped ``x.shape + x.shape``, computed by one
  batched (vmapped) backward pass instead of TF's loop of one pass per element;
- ``hessian_vector_product(ys, xs, v)``: ``H @ v`` over all ``xs`` jointly, by
  double backward, without forming ``H``.

Nothing is accumulated into ``.grad``: everything goes through
``torch.autograd.grad``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AggregationMethod",
    "UnconnectedGradients",
    "check_aggregation_method",
    "gradients",
    "hessian_vector_product",
    "hessians",
]


class AggregationMethod:
    """How TensorFlow combines several gradient terms flowing into one tensor.

    TF's graph builder either sums all terms in one ``AddN`` (``ADD_N``, the
    default) or pairwise, left to right (``EXPERIMENTAL_TREE``;
    ``EXPERIMENTAL_ACCUMULATE_N`` is an alias of it in current TF). PyTorch's
    autograd engine sums the terms itself, in the order they arrive, so here the
    constants are validated and accepted for compatibility but do not change
    the result beyond float rounding order.
    """

    ADD_N = 0
    DEFAULT = ADD_N
    EXPERIMENTAL_TREE = 1
    EXPERIMENTAL_ACCUMULATE_N = 2


class UnconnectedGradients(str, enum.Enum):
    """What ``gradients`` returns for an ``x`` that ``ys`` does not depend on (TF's enum)."""

    NONE = "none"
    ZERO = "zero"


_AGGREGATION_METHODS = (
    AggregationMethod.ADD_N,
    AggregationMethod.EXPERIMENTAL_TREE,
    AggregationMethod.EXPERIMENTAL_ACCUMULATE_N,
)


def check_aggregation_method(aggregation_method: Any) -> None:
    """Raise ``ValueError`` unless ``aggregation_method`` is None or an ``AggregationMethod`` constant."""
    if aggregation_method is None:
        return
    if isinstance(aggregation_method, bool) or aggregation_method not in _AGGREGATION_METHODS:
        raise ValueError(
            f"Invalid aggregation_method specified {aggregation_method!r}. Accepted values are "
            "[0, 1, 2] (AggregationMethod.ADD_N, EXPERIMENTAL_TREE, EXPERIMENTAL_ACCUMULATE_N) or None."
        )


def gradients(
    ys: Tensor | Iterable[Tensor],
    xs: Tensor | Iterable[Tensor],
    grad_ys: Any = None,
    name: str | None = "gradients",
    colocate_gradients_with_ops: bool = False,
    gate_gradients: bool = False,
    aggregation_method: int | None = None,
    stop_gradients: Tensor | Iterable[Tensor] | None = None,
    unconnected_gradients: str | UnconnectedGradients = UnconnectedGradients.NONE,
    *,
    create_graph: bool | None = None,
    retain_graph: bool = True,
) -> list[Tensor | None]:
    """The derivatives of ``sum(ys)`` with respect to each ``x`` in ``xs`` (TF's ``gradients``).

    For ``ys = [y_1, …, y_m]`` with weights ``grad_ys = [w_1, …, w_m]``, entry ``i``
    of the result is

    .. math::

        \\frac{\\partial}{\\partial x_i} \\sum_k \\langle w_k, y_k \\rangle,

    the vector-Jacobian product TF computes. ``w_k`` defaults to ones of
    ``y_k``'s shape, so a non-scalar ``y`` is summed.

    Differences from TensorFlow:

    1. The graph is PyTorch's: ``ys`` must have been computed with autograd
       recording and every ``x`` must require grad (TF differentiates any tensor
       of its graph; a tensor that does not require grad has no graph here).
    2. ``name``, ``colocate_gradients_with_ops``, ``gate_gradients`` and
       ``aggregation_method`` are validated and have no numerical effect: the
       autograd engine schedules and sums gradient terms itself.
    3. ``stop_gradients`` is implemented by temporary pre-hooks on the listed
       tensors' ``grad_fn`` nodes, removed before returning (while the call
       runs they also act on a backward pass through those nodes in another
       thread). As in TF, the whole op is stopped: listing one output of
       ``torch.split`` stops the others.
       A gradient blocked this way reaches a custom ``torch.autograd.Function``
       as zeros (its ``materialize_grads`` default), so an ``x`` behind one may
       get zeros instead of ``None``.
    4. The results can be differentiated again when grad mode is enabled
       (``create_graph`` defaults to ``torch.is_grad_enabled()``), and the graph
       of ``ys`` is kept (``retain_graph=True``) so it can be differentiated
       again, as a TF graph can.
    5. Sparse gradients (``nn.Embedding(sparse=True)``, TF's ``IndexedSlices``)
       come back as uncoalesced sparse COO tensors; duplicate indices are kept,
       as TF keeps them. PyTorch's sparse embedding backward is not itself
       differentiable.

    Args:
        ys: a tensor or an iterable of tensors to differentiate.
        xs: a tensor or an iterable of tensors (e.g. ``model.parameters()``) that require grad.
        grad_ys: None, or one entry per ``y`` (a single tensor when ``ys`` is
            one), each None (ones) or a tensor / number / nested list of
            ``y``'s shape. Real ``y`` take real weights, cast to ``y``'s dtype;
            complex ``y`` need complex weights.
        name: TF's name scope; unused.
        colocate_gradients_with_ops: TF's device placement hint; unused.
        gate_gradients: TF's synchronisation barrier; unused.
        aggregation_method: None or an ``AggregationMethod`` constant.
        stop_gradients: tensors to hold constant; the gradient *at* one of them
            is still reported when it is also in ``xs``.
        unconnected_gradients: ``"none"`` (None for an unconnected ``x``) or
            ``"zero"`` (``zeros_like(x)``), or an ``UnconnectedGradients``.
        create_graph: record the backward pass so the results can be
            differentiated; None means ``torch.is_grad_enabled()``.
        retain_graph: keep the graph of ``ys`` for further differentiation.

    Returns:
        A list with one entry per ``x``: a tensor of ``x``'s shape, or None.

    Raises:
        TypeError: an entry of ``ys``, ``xs`` or ``stop_gradients`` is not a
            tensor, an option has the wrong type, or a ``grad_ys`` entry has
            the wrong kind of dtype.
        ValueError: an ``x`` does not require grad, ``grad_ys`` does not match
            ``ys`` in number, shape or device, or ``aggregation_method`` /
            ``unconnected_gradients`` is unknown.

    Example:
        >>> a = torch.tensor(0.0, requires_grad=True)
        >>> b = 2 * a
        >>> gradients(a + b, [a, b])
        [tensor(3.), tensor(1.)]
        >>> gradients(a + b, [a, b], stop_gradients=[a, b])
        [tensor(1.), tensor(1.)]
    """
    ys = _as_tensor_list("ys", ys)
    xs = _as_tensor_list("xs", xs)
    stops = [] if stop_gradients is None else _as_tensor_list("stop_gradients", stop_gradients)
    _check_options(name, colocate_gradients_with_ops, gate_gradients, aggregation_method)
    unconnected = _unconnected_gradients(unconnected_gradients)
    if create_graph is not None and not isinstance(create_graph, bool):
        raise TypeError(f"create_graph must be None or a bool, got {create_graph!r}")
    if not isinstance(retain_graph, bool):
        raise TypeError(f"retain_graph must be a bool, got {retain_graph!r}")
    _check_xs(xs)
    weights = _default_grad_ys(grad_ys, ys)
    if create_graph is None:
        create_graph = torch.is_grad_enabled()

    # A y that does not require grad is a constant: it contributes nothing.
    live = [i for i, y in enumerate(ys) if y.requires_grad]
    grads: list[Tensor | None] = [None] * len(xs)
    if live and xs:
        # A recorded result refers to tensors saved in the graph of ys: keep them.
        with _stopped(stops):
            grads = list(
                torch.autograd.grad(
                    [ys[i] for i in live],
                    xs,
                    grad_outputs=[weights[i] for i in live],
                    retain_graph=retain_graph or create_graph,
                    create_graph=create_graph,
                    allow_unused=True,
                )
            )
    if unconnected is UnconnectedGradients.ZERO:
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, xs, strict=True)]
    return grads


def hessians(
    ys: Tensor | Iterable[Tensor],
    xs: Tensor | Iterable[Tensor],
    name: str | None = "hessians",
    colocate_gradients_with_ops: bool = False,
    gate_gradients: bool = False,
    aggregation_method: int | None = None,
    *,
    chunk_size: int | None = None,
    create_graph: bool | None = None,
) -> list[Tensor | None]:
    """The Hessian of ``sum(ys)`` with respect to each ``x`` in ``xs`` (TF's ``hessians``).

    Entry ``i`` is :math:`\\partial^2 \\sum ys / \\partial x_i \\partial x_i` shaped
    ``x_i.shape + x_i.shape``; there are no cross blocks between different
    ``xs`` (use ``hessian_vector_product`` for the joint Hessian's action).

    TensorFlow runs a ``while_loop`` with one backward pass per element of
    ``x``. Here the first derivative ``g`` is computed once with a graph, then
    all rows ``∂g_j/∂x`` come from one backward pass of ``g`` vectorized over
    the rows of an identity matrix (``torch.func.vmap`` of
    ``torch.autograd.grad``).

    Differences from TensorFlow:

    1. Any rank of ``x`` is accepted (TF ≤ 1.4 accepted only 1-D ``xs``; current
       TF accepts any rank with the same result shape).
    2. If ``sum(ys)`` does not depend on ``x`` the entry is None (as
       ``gradients`` gives); if it depends on ``x`` only linearly the entry is
       zeros. TF raises ``ValueError: None values not supported`` in both cases.
    3. A sparse first derivative (``nn.Embedding(sparse=True)``) raises
       ``ValueError``: PyTorch's sparse embedding backward is not
       differentiable, so the Hessian would silently be zero.

    Args:
        ys: a tensor or an iterable of tensors to differentiate.
        xs: a tensor or an iterable of tensors that require grad.
        name, colocate_gradients_with_ops, gate_gradients, aggregation_method:
            as in ``gradients`` (validated, no numerical effect).
        chunk_size: rows per batched backward pass; memory beyond the result
            grows with it. None does all rows of an ``x`` at once. ``1`` runs one ordinary backward pass
            per row (TF's algorithm), for graphs whose backward cannot be
            vmapped, e.g. a ``torch.autograd.Function`` without vmap support.
        create_graph: record the second backward pass so the Hessians can be
            differentiated; None means ``torch.is_grad_enabled()``.

    Returns:
        A list with one entry per ``x``: a tensor of shape ``x.shape + x.shape``, or None.

    Raises:
        TypeError, ValueError: as ``gradients``; ``ValueError`` also for a bad
            ``chunk_size`` or a sparse first derivative.
        RuntimeError: the batched backward pass failed; the message suggests
            ``chunk_size=1``.

    Example:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> hessians((x**3).sum() + x[0] * x[1], x, create_graph=False)[0]
        tensor([[ 6.,  1.],
                [ 1., 12.]])
    """
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)):
        raise TypeError(f"chunk_size must be None or an int, got {type(chunk_size).__name__}: {chunk_size!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"Invalid chunk_size value: {chunk_size!r}; expected None or an int >= 1")
    if create_graph is not None and not isinstance(create_graph, bool):
        raise TypeError(f"create_graph must be None or a bool, got {create_graph!r}")
    xs = _as_tensor_list("xs", xs)
    _refuse_complex_second_derivatives("hessians", xs)
    if create_graph is None:
        create_graph = torch.is_grad_enabled()
    # The first derivative and the ops on it must be recorded even under torch.no_grad().
    with torch.enable_grad():
        first = gradients(
            ys,
            xs,
            name=name,
            colocate_gradients_with_ops=colocate_gradients_with_ops,
            gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            create_graph=True,
        )
        _check_dense_first_derivatives("hessians", first)
        return [
            None if g is None else _hessian_block(g, x, i, chunk_size, create_graph)
            for i, (g, x) in enumerate(zip(first, xs, strict=True))
        ]


def hessian_vector_product(
    ys: Tensor | Iterable[Tensor],
    xs: Tensor | Iterable[Tensor],
    v: Tensor | Iterable[Tensor],
    *,
    create_graph: bool | None = None,
) -> list[Tensor | None]:
    """``H v`` for the Hessian ``H`` of ``sum(ys)`` over all ``xs`` jointly, without forming ``H``.

    With ``g = gradients(ys, xs)`` (recorded), entry ``i`` is
    :math:`\\sum_j \\partial (g_j \\cdot v_j) / \\partial x_i = \\sum_j H_{ij} v_j`:
    two backward passes, the cost of about two gradients. ``v`` is held
    constant, as TF's ``_hessian_vector_product`` wraps it in ``stop_gradient``.

    Args:
        ys: a tensor or an iterable of tensors to differentiate.
        xs: a tensor or an iterable of tensors that require grad.
        v: one tensor per ``x``, of that ``x``'s shape.
        create_graph: record the second pass so the result can be
            differentiated; None means ``torch.is_grad_enabled()``.

    Returns:
        A list with one entry per ``x``: None where ``sum(ys)`` does not depend
        on that ``x``, zeros where its gradient depends on no ``x``, else ``(H v)_i``.

    Raises:
        TypeError, ValueError: as ``gradients``; ``ValueError`` also when ``v``
            does not match ``xs`` in number or shape, or a first derivative is sparse.

    Example:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> hessian_vector_product((x**3).sum(), x, torch.tensor([1.0, 0.0]), create_graph=False)
        [tensor([6., 0.])]
    """
    if create_graph is not None and not isinstance(create_graph, bool):
        raise TypeError(f"create_graph must be None or a bool, got {create_graph!r}")
    xs = _as_tensor_list("xs", xs)
    _refuse_complex_second_derivatives("hessian_vector_product", xs)
    vs = _as_tensor_list("v", v)
    if len(vs) != len(xs):
        raise ValueError(f"xs and v must have the same length, got {len(xs)} xs and {len(vs)} v")
    for i, (vi, x) in enumerate(zip(vs, xs, strict=True)):
        if vi.shape != x.shape:
            raise ValueError(f"v[{i}] must have the shape of xs[{i}] {tuple(x.shape)}, got {tuple(vi.shape)}")
        if vi.dtype == torch.bool or vi.is_complex() != x.is_complex():
            # A complex v for a real x would lose its imaginary part in the cast (a warning only).
            kind = "complex" if x.is_complex() else "real or integer"
            raise TypeError(f"v[{i}] must be {kind} as xs[{i}] ({x.dtype}), got {vi.dtype}")
    if create_graph is None:
        create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        first = gradients(ys, xs, create_graph=True)
    _check_dense_first_derivatives("hessian_vector_product", first)
    live = [i for i, g in enumerate(first) if g is not None and g.requires_grad]
    second: list[Tensor | None] = [None] * len(xs)
    if live:
        second = list(
            torch.autograd.grad(
                [first[i] for i in live],
                xs,
                grad_outputs=[vs[i].detach().to(first[i].dtype) for i in live],
                retain_graph=True,
                create_graph=create_graph,
                allow_unused=True,
            )
        )
    return [
        None if g is None else (torch.zeros_like(x) if hv is None else hv)
        for g, hv, x in zip(first, second, xs, strict=True)
    ]


# ---------------------------------------------------------------------- helpers
def _as_tensor_list(arg: str, value: Any) -> list[Tensor]:
    """TF's ``_AsList``: a tensor becomes a one-element list; any other iterable
    (a list, ``model.parameters()``) is listed. Every entry must be a tensor."""
    if isinstance(value, Tensor) or not isinstance(value, Iterable) or isinstance(value, str):
        value = [value]
    items = list(value)
    for i, item in enumerate(items):
        if not isinstance(item, Tensor):
            raise TypeError(f"{arg}[{i}] must be a torch.Tensor, got {type(item).__name__}: {item!r}")
    return items


def _check_options(
    name: Any, colocate_gradients_with_ops: Any, gate_gradients: Any, aggregation_method: Any
) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__}: {name!r}")
    if not isinstance(colocate_gradients_with_ops, bool):
        raise TypeError(f"colocate_gradients_with_ops must be a bool, got {colocate_gradients_with_ops!r}")
    if not isinstance(gate_gradients, bool):
        raise TypeError(f"gate_gradients must be a bool, got {gate_gradients!r}")
    check_aggregation_method(aggregation_method)


def _unconnected_gradients(value: Any) -> UnconnectedGradients:
    try:
        return UnconnectedGradients(value)
    except ValueError:
        raise ValueError(
            f"Unknown value for unconnected_gradients: {value!r}; expected 'none', 'zero' "
            "or an UnconnectedGradients member"
        ) from None


def _check_xs(xs: list[Tensor]) -> None:
    for i, x in enumerate(xs):
        if not x.requires_grad:
            raise ValueError(
                f"xs[{i}] does not require grad (shape {tuple(x.shape)}, dtype {x.dtype}); "
                "differentiate with respect to a tensor with requires_grad=True or computed from one"
            )


def _as_bools(w: Any) -> Tensor | None:
    """``w`` as a tensor if it holds booleans (Python's ``True`` is also an int), else None."""
    try:
        given = torch.as_tensor(w)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None  # (an int too large for int64 is no boolean; the cast to y's dtype says the rest)
    return given if given.dtype == torch.bool else None


def _default_grad_ys(grad_ys: Any, ys: list[Tensor]) -> list[Tensor]:
    """TF's ``_DefaultGradYs``: ones where None, else checked against ``y`` and cast to its dtype."""
    if grad_ys is None:
        entries: list[Any] = [None] * len(ys)
    else:
        entries = list(grad_ys) if isinstance(grad_ys, (list, tuple)) else [grad_ys]
    if len(entries) != len(ys):
        raise ValueError(f"Length mismatch. Passed {len(entries)} grad_ys for {len(ys)} ys")
    weights = []
    for i, (w, y) in enumerate(zip(entries, ys, strict=True)):
        if w is None:
            if y.is_complex():
                raise TypeError(f"Gradients of complex tensors must set grad_ys (ys[{i}].dtype = {y.dtype})")
            weights.append(torch.ones_like(y, memory_format=torch.contiguous_format))
            continue
        if not isinstance(w, Tensor):
            if y.is_complex() and _all_real(w):
                raise TypeError(
                    f"grad_ys[{i}] holds real numbers; ys[{i}] has dtype {y.dtype}, so they must be complex"
                )
            try:
                # Booleans are refused below, as a bool tensor is: their dtype is read before the cast.
                given = _as_bools(w)
                w = given if given is not None else torch.as_tensor(w, dtype=y.dtype, device=y.device)
            except (TypeError, ValueError, RuntimeError) as e:
                raise TypeError(
                    f"grad_ys[{i}] must be None, a tensor or a number / nested list, "
                    f"got {type(w).__name__}: {w!r}"
                ) from e
        if w.dtype == torch.bool or w.is_complex() != y.is_complex():
            kind = "complex" if y.is_complex() else "real or integer"
            raise TypeError(
                f"grad_ys[{i}] has dtype {w.dtype}; ys[{i}] has dtype {y.dtype}, so it must be {kind}"
            )
        if w.shape != y.shape:
            raise ValueError(
                f"grad_ys[{i}] has shape {tuple(w.shape)}, expected ys[{i}]'s shape {tuple(y.shape)}"
            )
        if w.device != y.device:
            raise ValueError(f"grad_ys[{i}] is on {w.device}, expected ys[{i}]'s device {y.device}")
        weights.append(w.to(y.dtype))
    return weights


def _refuse_complex_second_derivatives(caller: str, xs: list[Tensor]) -> None:
    """TF differentiates the first derivative without ``grad_ys``, which for a complex x is complex
    and so refused ("Gradients of complex tensors must set grad_ys"): so here."""
    for i, x in enumerate(xs):
        if x.is_complex():
            raise TypeError(
                f"{caller}: xs[{i}] is complex ({x.dtype}); its first derivative is complex, which "
                "TensorFlow cannot differentiate again without grad_ys"
            )


def _all_real(value: Any) -> bool:
    """Whether a number or nested list holds no complex number (as TF would make a real tensor of it)."""
    if isinstance(value, (list, tuple)):
        return all(map(_all_real, value))
    return not isinstance(value, complex)


def _undefined_grads(grad_outputs: tuple[Tensor | None, ...]) -> tuple[None, ...]:
    """Node pre-hook: the op receives no gradient, so nothing flows into its inputs."""
    return tuple(None for _ in grad_outputs)


@contextmanager
def _stopped(stops: list[Tensor]) -> Iterator[None]:
    """Hold ``stops`` constant during one backward pass (TF's ``stop_gradients``).

    A pre-hook on each stop tensor's ``grad_fn`` replaces the gradients flowing
    into that node by undefined ones. The engine captures the gradient of a
    requested input *before* running that input's node and its pre-hooks, so a
    stop tensor that is also in ``xs`` still reports the gradient at itself.
    Leaves and tensors that do not require grad have nothing upstream to stop.
    """
    nodes = {id(t.grad_fn): t.grad_fn for t in stops if t.grad_fn is not None}
    handles = [node.register_prehook(_undefined_grads) for node in nodes.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _check_dense_first_derivatives(fn: str, first: list[Tensor | None]) -> None:
    for i, g in enumerate(first):
        if g is not None and g.layout != torch.strided:
            raise ValueError(
                f"{fn}: the gradient with respect to xs[{i}] is {g.layout}; PyTorch cannot "
                "differentiate it again (e.g. nn.Embedding(sparse=True)), use a dense gradient"
            )


def _hessian_block(g: Tensor, x: Tensor, i: int, chunk_size: int | None, create_graph: bool) -> Tensor:
    """``∂g/∂x`` for ``g = ∂ sum(ys)/∂x``, shaped ``x.shape + x.shape``: row ``j`` is the VJP of ``e_j``.

    Rows are computed ``chunk_size`` at a time from that many rows of the
    identity, never the whole ``n x n`` identity, and (without a graph to
    record) written into the result as they come: beyond the ``n x n`` result,
    memory grows with ``chunk_size``, not with ``n``. Materialising the identity
    and stacking the rows cost two more ``n x n`` buffers (measured, n = 6000
    float32, a 137 MiB Hessian: peak RSS 743 -> 429 MiB with chunk_size=64,
    791 -> 417 MiB with chunk_size=1, from 243 MiB before the call).
    """
    flat = g.reshape(-1)
    n = flat.numel()
    if not g.requires_grad or n == 0:  # (an empty x: TF's result is empty too, shaped x.shape + x.shape)
        return torch.zeros(x.shape + x.shape, dtype=x.dtype, device=x.device)
    row = partial(_vjp, flat, x, create_graph)
    step = n if chunk_size is None else min(chunk_size, n)
    if step == n:
        return _hessian_rows(row, flat, 0, n, chunk_size, i).reshape(x.shape + x.shape)
    spans = [(start, min(start + step, n)) for start in range(0, n, step)]
    if create_graph:
        # Each chunk stays a node of the recorded graph; writing into a buffer would chain n / step copies.
        hessian = torch.cat([_hessian_rows(row, flat, a, b, chunk_size, i) for a, b in spans])
    else:
        hessian = torch.empty((n, n), dtype=flat.dtype, device=flat.device)
        for a, b in spans:
            hessian[a:b] = _hessian_rows(row, flat, a, b, chunk_size, i)
    return hessian.reshape(x.shape + x.shape)


def _hessian_rows(
    row: Callable[[Tensor], Tensor], flat: Tensor, start: int, stop: int, chunk_size: int | None, i: int
) -> Tensor:
    """Rows ``start:stop`` of the Hessian: the VJPs of those rows of the identity."""
    basis = torch.zeros((stop - start, flat.numel()), dtype=flat.dtype, device=flat.device)
    basis.diagonal(offset=start).fill_(1)
    if chunk_size == 1:
        return row(basis[0]).reshape(1, -1)
    # torch.func.vmap, not autograd.grad(is_grads_batched=True): the latter uses the
    # legacy batching rules, which expand the weight of a batched mv into a bmm and
    # loop over tanh_backward; it was 27x slower on a 512x256 tanh layer.
    try:
        return torch.func.vmap(row)(basis).reshape(stop - start, -1)
    except RuntimeError as e:
        raise RuntimeError(
            f"hessians: the batched backward pass for xs[{i}] failed ({e}); pass chunk_size=1 "
            "to compute one row per backward pass, as TensorFlow does"
        ) from e


def _vjp(output: Tensor, x: Tensor, create_graph: bool, cotangent: Tensor) -> Tensor:
    """``cotangentᵀ ∂output/∂x``, zeros where ``output`` does not depend on ``x``."""
    (grad,) = torch.autograd.grad(
        output,
        x,
        grad_outputs=cotangent,
        retain_graph=True,
        create_graph=create_graph,
        materialize_grads=True,
    )
    return grad
