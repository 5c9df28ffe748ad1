"""The AGN parameter server: center parameters, the server's optimizer, and every request under one lock.

This module knows nothing of the network. A transport (``transport.py``) hands
it requests (``join``, ``push``, ``finish``) with the calling worker's name and
tells it which workers are still alive; ``run_parameter_server`` (``run.py``)
joins the two.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..optim.wrapper import describe
from .errors import (
    AGNCheckpointWarning,
    AGNError,
    AGNNameInUseError,
    AGNServerFullError,
    AGNWorkerLostWarning,
)

__all__ = ["ParameterServer", "checkpoint_digest", "serve"]

CHECKPOINT_FORMAT = "torchgrad_compat.agn.server/1"
CHECKPOINT_KEYS = ("center", "format", "global_step", "optimizer", "sha256")
PROBES_MISSED_BEFORE_DEAD = 3  # consecutive liveness probes a worker misses before it counts as dead


# What ``join`` hands a worker and every later request of it carries: (incarnation, secret key).
Session = tuple[int, str]


@dataclasses.dataclass
class _Worker:
    incarnation: int = 0
    key: str = ""
    last_seq: int = 0
    pushes: int = 0
    state: str = "running"  # "running", "finished" or "dead"
    join_nonce: str = ""  # the worker's token for the join that made its session (a retry sends it again)


def _apply(optimizer: torch.optim.Optimizer, params: list[Tensor], grads: dict[int, Tensor]) -> None:
    """One update of ``optimizer`` over ``params``; parameters without an entry in ``grads`` are skipped."""
    if hasattr(optimizer, "apply_gradients"):
        optimizer.apply_gradients([(grads[i], p) for i, p in enumerate(params) if i in grads])
        return
    for i, p in enumerate(params):
        p.grad = grads.get(i)
    optimizer.step()
    for p in params:
        p.grad = None


class ParameterServer:
    """Center copies of ``params`` and ``optimizer_fn(center)``; requests are applied one at a time.

    Contract:

    * ``join`` returns the current center (TF's ``get_init_op``: local := center)
      and starts a new *session* of that worker: an incarnation number and a
      random key that its ``push`` and ``finish`` must carry, so no other
      process can push or finish under its name. A running worker's name is
      taken: joining under it is refused unless the join carries that worker's
      session (the same worker starting over). A worker that finished or died
      (the transport stopped answering for it) may join again, as a restarted
      process; requests of the old session are refused. At most ``num_worker``
      names are running or finished at once: a new name joins only in place of
      a dead worker (a restarted process under another name), and the server
      is done only when no worker is running, so it does not return while such
      a replacement still pushes.
    * ``push`` applies the server's optimizer once to the center with the pushed
      (already normalized) gradients and returns the center after the update. The
      whole of it runs under one lock, so N workers × K pushes are exactly N·K
      updates. A repeated ``(incarnation, seq)`` is answered without applying it
      again, so a retried push is never applied twice.
    * Pushes are validated before the lock is taken: index, layout, shape and
      dtype must match the center, and every value must be finite (one NaN
      would make the center and every worker NaN); a bad push raises
      ``ValueError``/``TypeError`` to that worker and leaves the center untouched.
    * The server's optimizer is its own object with its own state. Unlike TF
      contrib, where the local and center applies share one Adam and its
      ``beta1_power`` advances on both (twice per communication), here the
      server's Adam advances once per push and the workers' once per local step.
    * Every ``checkpoint_every`` updates the center, the optimizer's
      ``state_dict``, ``global_step`` and a SHA-256 of them are saved to
      ``checkpoint_path`` (plain tensors and numbers:
      ``torch.load(weights_only=True)`` reads it), written to a temporary file
      and renamed, so a crash mid-save leaves the previous checkpoint. The
      directory is checked at construction. A save that fails later (disk
      full) does not fail the push, which is applied exactly once: the server
      warns with :class:`AGNCheckpointWarning` and saves again after the next
      update. ``restore_from`` continues from such a file after checking its
      checksum and values (finite center and optimizer state, ``global_step
      >= 0``); a bad file raises ``ValueError`` naming what is wrong.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        optimizer_fn: Callable[[list[Tensor]], torch.optim.Optimizer],
        num_worker: int,
        *,
        name: str = "ps",
        checkpoint_path: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 0,
        restore_from: str | os.PathLike[str] | None = None,
    ):
        if isinstance(num_worker, bool) or not isinstance(num_worker, int) or num_worker < 1:
            raise ValueError(f"num_worker must be an int >= 1, got {num_worker!r}")
        if (
            isinstance(checkpoint_every, bool)
            or not isinstance(checkpoint_every, int)
            or checkpoint_every < 0
        ):
            raise ValueError(f"checkpoint_every must be an int >= 0, got {checkpoint_every!r}")
        if checkpoint_every and checkpoint_path is None:
            raise ValueError(f"checkpoint_every={checkpoint_every} needs a checkpoint_path")
        params = list(params)
        if not params:
            raise ValueError("params must hold at least one tensor, got an empty list")
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"params must be tensors, got {describe(p)}")
        self.name = name
        self.num_worker = num_worker
        self.center = [p.detach().clone() for p in params]
        self.optimizer = optimizer_fn(self.center)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer_fn must return a torch.optim.Optimizer, got {describe(self.optimizer)}"
            )
        self.global_step = 0
        self.workers: dict[str, _Worker] = {}
        self._awaited = num_worker  # workers to end before done
        self._checkpoint_path = None if checkpoint_path is None else _writable(checkpoint_path)
        self._checkpoint_every = checkpoint_every
        self._save_due = False  # a save failed; try again after the next update
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        if restore_from is not None:
            self._restore(os.fspath(restore_from))

    # ------------------------------------------------------------------ requests
    def join(
        self,
        worker: str,
        num_worker: int,
        specs: Sequence[tuple[tuple[int, ...], torch.dtype]],
        session: Session | None = None,
        nonce: str | None = None,
    ) -> tuple[Session, list[Tensor], int]:
        """Register ``worker``; ``(session, center, global_step)``. The worker's parameters must match.

        ``session``: the worker's current session, to start it over while it is running.
        ``nonce``: the worker's token for this join. A join whose answer was lost is sent again
        with it, and gets the session it made (not "name in use" from its own first attempt).
        """
        if num_worker != self.num_worker:
            raise ValueError(
                f"AGN server {self.name!r} serves num_worker={self.num_worker}, worker {worker!r} "
                f"has num_worker={num_worker}"
            )
        expected = [(tuple(c.shape), c.dtype) for c in self.center]
        if [(tuple(s), d) for s, d in specs] != expected:
            raise ValueError(
                f"AGN server {self.name!r}: worker {worker!r} has parameters {list(specs)}, "
                f"the center has {expected}"
            )
        with self._lock:
            record = self.workers.get(worker)
            if (
                record is not None
                and record.state == "running"
                and isinstance(nonce, str)
                and nonce
                and hmac.compare_digest(nonce, record.join_nonce)
            ):
                return (record.incarnation, record.key), self._center_copy(), self.global_step
            if record is not None and record.state == "running" and not self._holds(record, session):
                raise AGNNameInUseError(
                    f"AGN server {self.name!r}: a worker named {worker!r} is running (session "
                    f"{record.incarnation}); a name is bound to the process that joined with it. If that "
                    "process died, the server notices within its liveness probe and the name is free again"
                )
            if record is None or record.state == "dead":
                # A new name, or a dead worker's, needs a slot no other worker holds. (A finished
                # name is its own slot: a restarted process may join under it again.)
                taken = sorted(w for w, r in self.workers.items() if r.state != "dead" and w != worker)
                if len(taken) >= self.num_worker:
                    message = (
                        f"AGN server {self.name!r} serves num_worker={self.num_worker}, and workers "
                        f"{taken} are running or finished; worker {worker!r} would be one more"
                    )
                    if any(self.workers[w].state == "running" for w in taken):
                        raise AGNServerFullError(
                            f"{message} (a worker restarted under another name joins once the "
                            "server has found its previous process dead)"
                        )
                    raise ValueError(message)
            record = self.workers.setdefault(worker, _Worker())
            record.incarnation += 1
            record.key = secrets.token_hex(16)
            record.join_nonce = nonce if isinstance(nonce, str) else ""
            record.last_seq = 0
            record.state = "running"
            self._changed.notify_all()
            return (record.incarnation, record.key), self._center_copy(), self.global_step

    def push(
        self, worker: str, session: Session, seq: int, grads: dict[int, Tensor]
    ) -> tuple[list[Tensor], int]:
        """Apply one normalized push from ``worker``; ``(center, global_step)`` after it."""
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            # (A float inf would be applied and then swallow every later push as a repeat.)
            raise ValueError(f"Invalid seq value: {seq!r}; expected the push's number, an int >= 1")
        self._check_push(worker, grads)
        with self._lock:
            record = self._running(worker, session)
            if seq > record.last_seq:
                with torch.no_grad():
                    _apply(self.optimizer, self.center, grads)
                record.last_seq = seq
                record.pushes += 1
                self.global_step += 1
                if self._save_due or (
                    self._checkpoint_every and self.global_step % self._checkpoint_every == 0
                ):
                    self._save_after_update()
            return self._center_copy(), self.global_step

    def finish(self, worker: str, session: Session) -> int:
        """Record that ``worker`` is done; the server's ``global_step``."""
        with self._lock:
            self._running(worker, session).state = "finished"
            self._changed.notify_all()
            return self.global_step

    def snapshot(self, worker: str) -> tuple[list[Tensor], int]:
        """``(center, global_step)`` without changing anything (monitoring and tests)."""
        with self._lock:
            return self._center_copy(), self.global_step

    def holds(self, worker: str, session: Any) -> bool:
        """Whether ``session`` is the current session of ``worker`` and it runs (a transport's liveness
        check: only the process that joined as ``worker`` can keep it alive)."""
        with self._lock:
            record = self.workers.get(worker)
            return record is not None and record.state == "running" and self._holds(record, session)

    def mark_dead(self, worker: str) -> None:
        """A transport found ``worker`` gone before ``finish()``, or before it joined: stop waiting for it."""
        with self._lock:
            record = self.workers.get(worker)
            if record is None:
                self.workers[worker] = _Worker(state="dead")
                self._changed.notify_all()
            elif record.state == "running":
                record.state = "dead"
                self._changed.notify_all()

    # ------------------------------------------------------------------ waiting
    @property
    def done(self) -> bool:
        """Every awaited worker finished or died (``num_worker``, fewer after ``stop_waiting_for_absent``),
        and none is running (one that joined in a dead worker's place under another name)."""
        states = [r.state for r in self.workers.values()]
        return "running" not in states and len(states) >= self._awaited

    def stop_waiting_for_absent(self) -> int:
        """Wait no longer for workers that have not joined; how many that is."""
        with self._lock:
            absent = max(0, self._awaited - len(self.workers))
            self._awaited -= absent
            self._changed.notify_all()
            return absent

    def running_workers(self) -> list[str]:
        with self._lock:
            return [w for w, r in self.workers.items() if r.state == "running"]

    def dead_workers(self) -> list[str]:
        with self._lock:
            return [w for w, r in self.workers.items() if r.state == "dead"]

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for :attr:`done`; whether it is."""
        with self._lock:
            return self._changed.wait_for(lambda: self.done, timeout=timeout)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return self._state_dict()

    def _state_dict(self) -> dict[str, Any]:
        state = {
            "format": CHECKPOINT_FORMAT,
            "center": self._center_copy(),
            "optimizer": self.optimizer.state_dict(),
            "global_step": self.global_step,
        }
        state["sha256"] = checkpoint_digest(state)
        return state

    def save(self) -> None:
        """Write a checkpoint to ``checkpoint_path`` now (a server that is being torn down)."""
        if self._checkpoint_path is None:
            raise RuntimeError(f"AGN server {self.name!r} has no checkpoint_path to save to")
        with self._lock:
            self._save()

    def _save(self) -> None:
        # Written beside the target and renamed, so a crash mid-save leaves the previous checkpoint.
        fd, tmp = _new_file_beside(self._checkpoint_path)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(self._state_dict(), f)
            os.replace(tmp, self._checkpoint_path)
        except BaseException:
            os.unlink(tmp)
            raise

    def _save_after_update(self) -> None:
        """Save after an applied update; a failure must not fail (and so repeat) the push."""
        try:
            self._save()
        except Exception as e:  # OSError, or torch.save's RuntimeError for a vanished directory
            self._save_due = True
            warnings.warn(
                f"AGN server {self.name!r} could not save its checkpoint {self._checkpoint_path} at update "
                f"{self.global_step} ({type(e).__name__}: {e}); it keeps serving and tries again after "
                "the next update",
                AGNCheckpointWarning,
                stacklevel=2,
            )
        else:
            self._save_due = False

    def _restore(self, path: str) -> None:
        state = _read_checkpoint(path)
        center = state["center"]
        expected = [(tuple(c.shape), c.dtype) for c in self.center]
        found = [(tuple(c.shape), c.dtype) for c in center]
        if found != expected:
            raise ValueError(f"checkpoint {path} holds parameters {found}, the server has {expected}")
        # Restoring runs inside the constructor: a failure leaves no half-restored server behind.
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for c, saved in zip(self.center, center, strict=True):
                c.copy_(saved)
        self.global_step = state["global_step"]

    # ------------------------------------------------------------------ helpers
    def _center_copy(self) -> list[Tensor]:
        return [c.clone() for c in self.center]

    @staticmethod
    def _holds(record: _Worker, session: Any) -> bool:
        """Whether ``session`` is ``record``'s current one (the key compared in constant time)."""
        return (
            isinstance(session, tuple)
            and len(session) == 2
            and session[0] == record.incarnation
            and isinstance(session[1], str)
            and hmac.compare_digest(session[1], record.key)
        )

    def _running(self, worker: str, session: Any) -> _Worker:
        record = self.workers.get(worker)
        if record is None:
            raise AGNError(f"AGN server {self.name!r}: worker {worker!r} has not joined")
        incarnation = session[0] if isinstance(session, tuple) and session else None
        if isinstance(incarnation, int) and incarnation != record.incarnation:
            raise AGNError(
                f"AGN server {self.name!r}: worker {worker!r} incarnation {incarnation!r} was replaced by "
                f"{record.incarnation} (the worker rejoined)"
            )
        if not self._holds(record, session):
            raise AGNError(
                f"AGN server {self.name!r}: a request for worker {worker!r} carried a wrong session key; "
                f"only the process that joined as {worker!r} may push or finish for it"
            )
        if record.state != "running":
            raise AGNError(f"AGN server {self.name!r}: worker {worker!r} is {record.state}")
        return record

    def _check_push(self, worker: str, grads: Any) -> None:
        where = f"AGN server {self.name!r}: push from worker {worker!r}"
        if not isinstance(grads, dict) or not grads:
            got = f"{len(grads)} entries" if isinstance(grads, dict) else type(grads).__name__
            raise TypeError(f"{where} must be a non-empty dict of parameter index to tensor, got {got}")
        for i, g in grads.items():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.center):
                raise ValueError(
                    f"{where} names parameter {i!r}; the center has {len(self.center)} parameters"
                )
            if not isinstance(g, Tensor) or g.layout != torch.strided:
                kind = g.layout if isinstance(g, Tensor) else type(g).__name__
                raise TypeError(f"{where}: gradient {i} must be a dense tensor, got {kind}")
            c = self.center[i]
            if g.shape != c.shape or g.dtype != c.dtype:
                raise ValueError(
                    f"{where}: gradient {i} is {describe(g)}, the center parameter is {describe(c)}"
                )
            # A host read per push: the server must decide before the lock, and one NaN poisons everyone.
            if g.is_floating_point() and not bool(torch.isfinite(g).all()):
                raise ValueError(
                    f"{where}: gradient {i} has non-finite values (NaN or inf); the push is refused and "
                    "the center is unchanged (under loss scaling, skip the step instead of pushing it)"
                )


def _writable(path: str | os.PathLike[str]) -> str:
    """``path`` as a string, once a file can be created beside it (checked by creating one)."""
    path = os.fspath(path)
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path} is a directory")
        fd, probe = _new_file_beside(path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(
            f"Invalid checkpoint_path value: {path!r}; expected a file in an existing, writable directory "
            f"({type(e).__name__}: {e})"
        ) from e
    return path


def _new_file_beside(path: str) -> tuple[int, str]:
    """A new file of a name of its own beside ``path``, open for writing: created, so never a file
    someone else put there or a symlink planted to make the server write elsewhere."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    directory, name = os.path.split(path)
    for _ in range(100):
        temporary = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(temporary, flags, 0o666), temporary
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def checkpoint_digest(state: dict[str, Any]) -> str:
    """SHA-256 of a server checkpoint's content (every key but ``sha256``), independent of pickling."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in state.items() if k != "sha256"})
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    """Add ``value`` to ``digest`` with its type and structure, so that different values differ."""
    if isinstance(value, Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}:".encode())
        for k in sorted(value, key=repr):
            _feed(digest, k)
            _feed(digest, value[k])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}:".encode())
        for v in value:
            _feed(digest, v)
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def _read_checkpoint(path: str) -> dict[str, Any]:
    """Load and check a server checkpoint; ``ValueError`` naming the file and what is wrong with it."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # a truncated or garbled zip/pickle raises many types
        raise ValueError(f"AGN checkpoint {path} cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not an AGN server checkpoint ({CHECKPOINT_FORMAT})")
    missing = [k for k in CHECKPOINT_KEYS if k not in state]
    if missing:
        raise ValueError(f"AGN checkpoint {path} misses keys {missing}")
    if checkpoint_digest(state) != state["sha256"]:
        raise ValueError(f"AGN checkpoint {path} fails its checksum: the file is corrupt or was edited")
    step = state["global_step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"AGN checkpoint {path}: global_step must be an int >= 0, got {step!r}")
    center = state["center"]
    if not isinstance(center, list) or not all(isinstance(c, Tensor) for c in center):
        raise ValueError(f"AGN checkpoint {path}: center must be a list of tensors")
    for i, c in enumerate(center):
        if c.is_floating_point() and not bool(torch.isfinite(c).all()):
            raise ValueError(f"AGN checkpoint {path}: center[{i}] has non-finite values")
    optimizer = state["optimizer"]
    if not isinstance(optimizer, dict) or not {"state", "param_groups"} <= set(optimizer):
        raise ValueError(
            f"AGN checkpoint {path}: optimizer must be a state_dict with 'state' and 'param_groups'"
        )
    for g, group in enumerate(optimizer["param_groups"]):
        for key, value in group.items():
            for v in value if isinstance(value, (list, tuple)) else [value]:
                # Tensors too: optimizer-wide state (Adam's beta powers) lives in the groups.
                finite = (
                    bool(torch.isfinite(v).all())
                    if isinstance(v, Tensor) and v.is_floating_point()
                    else not isinstance(v, float) or math.isfinite(v)
                )
                if not finite:
                    raise ValueError(f"AGN checkpoint {path}: optimizer param_groups[{g}][{key!r}] is {v!r}")
    for p, slots in optimizer["state"].items():
        for slot, v in slots.items():
            if isinstance(v, Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise ValueError(
                    f"AGN checkpoint {path}: optimizer state[{p}][{slot!r}] has non-finite values"
                )
    return state


def serve(
    server: ParameterServer,
    is_alive: Callable[[str], bool],
    liveness_interval: float,
    peers: Callable[[], Iterable[str]] = list,
    join_timeout: float | None = None,
) -> list[Tensor]:
    """Wait until every worker has finished or died, probing running workers every ``liveness_interval`` s.

    A worker that misses ``PROBES_MISSED_BEFORE_DEAD`` probes in a row is dead.

    ``peers()``: the workers the transport knows of (asked at every probe); one
    that dies before it joins is marked dead too, so the server does not wait
    for it forever. After ``join_timeout`` seconds (None: no limit) it waits
    no longer for workers that have not joined.

    Returns copies of the final center tensors; warns with
    :class:`AGNWorkerLostWarning` naming the workers that died.
    """
    misses: dict[str, int] = {}
    join_deadline = None if join_timeout is None else time.monotonic() + join_timeout
    absent = 0
    while not server.wait(liveness_interval):
        if join_deadline is not None and time.monotonic() >= join_deadline:
            absent, join_deadline = server.stop_waiting_for_absent(), None
            continue
        known = list(peers())
        with server._lock:
            unjoined = [w for w in known if w not in server.workers]
        for worker in server.running_workers() + unjoined:
            # A dead peer fails every probe at once; a live one on a loaded host may miss one.
            misses[worker] = 0 if is_alive(worker) else misses.get(worker, 0) + 1
            if misses[worker] >= PROBES_MISSED_BEFORE_DEAD:
                server.mark_dead(worker)
    dead = server.dead_workers()
    if dead or absent:
        never = f"; {absent} never joined within join_timeout={join_timeout} s" if absent else ""
        warnings.warn(
            f"AGN server {server.name!r}: worker(s) {dead} stopped answering before finish(){never}; "
            f"the server served the others to the end ({server.global_step} updates)",
            AGNWorkerLostWarning,
            stacklevel=2,
        )
    with server._lock:
        return server._center_copy()
