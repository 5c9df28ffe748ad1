"""Asynchronous training with a parameter server: TF contrib's AGN (Accumulated Gradient Normalization).

Workers wrap their optimizer in :class:`AGNOptimizer`; one process runs
:func:`run_parameter_server`. The math is in ``optimizer.py`` and ``server.py``,
the transport (``torch.distributed.rpc`` by default) in ``transport.py``, what
joins the two (``run_parameter_server``) in ``run.py`` and the errors in
``errors.py``.
"""

from .errors import (
    AGNCheckpointWarning,
    AGNError,
    AGNNameInUseError,
    AGNServerFullError,
    AGNServerNotReadyError,
    AGNServerUnavailableError,
    AGNWorkerLostWarning,
)
from .optimizer import AGNOptimizer
from .run import run_parameter_server
from .server import ParameterServer
from .transport import (
    LocalEndpoint,
    LocalServerHost,
    RpcEndpoint,
    RpcServerHost,
    ServerEndpoint,
    ServerHost,
    init_rpc_from_env,
)

__all__ = [
    "AGNCheckpointWarning",
    "AGNError",
    "AGNNameInUseError",
    "AGNOptimizer",
    "AGNServerFullError",
    "AGNServerNotReadyError",
    "AGNServerUnavailableError",
    "AGNWorkerLostWarning",
    "LocalEndpoint",
    "LocalServerHost",
    "ParameterServer",
    "RpcEndpoint",
    "RpcServerHost",
    "ServerEndpoint",
    "ServerHost",
    "init_rpc_from_env",
    "run_parameter_server",
]
