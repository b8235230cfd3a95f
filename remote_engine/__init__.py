"""The remote engine: ``lyanna.engine.StepLoop`` over the drafter and verifier gRPC services
(``remote_engine.engine``), with the drafter-sync protocol (``remote_engine.drafter``) and each
request's remote state (``remote_engine.seq``). The gateway imports it; it imports the core
and the services' contract, never the gateway."""

from remote_engine.config import RemoteConfig
from remote_engine.engine import RemoteEngine, Unavailable

__all__ = ["RemoteConfig", "RemoteEngine", "Unavailable"]
