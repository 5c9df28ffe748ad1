"""What the AGN server and its transports raise and warn: one module that both import."""

__all__ = [
    "AGNCheckpointWarning",
    "AGNError",
    "AGNNameInUseError",
    "AGNServerFullError",
    "AGNServerNotReadyError",
    "AGNServerUnavailableError",
    "AGNWorkerLostWarning",
]


class AGNError(RuntimeError):
    """A request the AGN server refused: unknown worker, stale worker incarnation, a shut-down server."""


class AGNServerNotReadyError(AGNError):
    """The server process is up but no parameter server of that name is serving yet; workers retry."""


class AGNServerUnavailableError(AGNError):
    """The AGN server did not answer: it died, stopped answering within the timeout, or never started."""


class AGNNameInUseError(AGNError):
    """A join under the name of a worker that is running; ``join`` retries it up to ``startup_timeout``."""


class AGNServerFullError(AGNError):
    """A join under a new name while ``num_worker`` workers are running or finished and one of them
    runs; ``join`` retries it up to ``startup_timeout`` (a worker restarted under another name waits
    for the server to find its previous process dead)."""


class AGNCheckpointWarning(RuntimeWarning):
    """The server could not write its checkpoint; the update stands and the next one tries again."""


class AGNWorkerLostWarning(RuntimeWarning):
    """A worker stopped answering before it called ``finish()``; the server went on without it."""
