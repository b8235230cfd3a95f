"""Configuration of the remote engine (``remote_engine``): service addresses, the pipeline
switch, admission bounds, a deadline for every kind of call, the drafter retry interval, the
data-plane switch and the gRPC channel options (explicit message sizes, short reconnect
backoff so a returning drafter is found quickly)."""

from __future__ import annotations

from dataclasses import dataclass

from services.codec import MAX_VERIFY_STEPS
from services.tls import ClientTls, channel_options


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    verifier_addr: str
    drafter_addr: str | None = None  # None: target-only decoding
    method: str = "lyanna"  # the drafter service's method (its Info wins when reachable)
    pipeline: bool = True  # two micro-batches in flight; False = draft, then verify
    max_running: int = 8
    max_waiting: int = 64
    queue_timeout: float = 60.0  # seconds a request may wait for a slot before BackendBusy
    prefill_deadline: float = 120.0  # seconds, per call
    verify_deadline: float = 60.0
    # seconds the drafter may take to draft (it then answers DEADLINE_EXCEEDED); one more
    # second without its `drafted` event and the gateway takes it for stuck: either way the
    # step runs target-only and the drafter is retried after drafter_retry_seconds
    draft_deadline: float = 2.0
    control_deadline: float = 10.0  # Start, Release, Capacity, Info
    drafter_retry_seconds: float = 1.0
    # plain decode steps one Verify may run when nobody drafts (tokens still stream one by
    # one as they are read, but arrive in bursts of up to this many)
    max_steps_per_call: int = 8
    use_data_plane: bool = False  # hidden states verifier -> drafter over torch.distributed
    max_message_mb: int = 64
    # hidden states kept per sequence to restart a hidden-state drafter from its history;
    # past this a drafter that loses the sequence leaves it target-only (None: max_message_mb)
    max_hidden_mb: float | None = None
    drain_seconds: float = 30.0
    tls: ClientTls | None = None  # None: plaintext channels to both services

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_waiting < 1 or self.max_message_mb < 1:
            raise ValueError("max_running, max_waiting and max_message_mb must be >= 1")
        deadlines = (self.prefill_deadline, self.verify_deadline, self.draft_deadline)
        if min(*deadlines, self.control_deadline, self.queue_timeout) <= 0:
            raise ValueError("deadlines and queue_timeout must be > 0")
        if not 1 <= self.max_steps_per_call <= MAX_VERIFY_STEPS:
            raise ValueError(
                f"max_steps_per_call must be in [1, {MAX_VERIFY_STEPS}] (the verifier's bound)"
            )
        if self.drafter_retry_seconds < 0:
            raise ValueError("deadlines must be > 0 and drafter_retry_seconds >= 0")
        if self.use_data_plane and self.drafter_addr is None:
            raise ValueError("the data plane needs a drafter")

    @property
    def max_hidden_bytes(self) -> int:
        mb = self.max_message_mb if self.max_hidden_mb is None else self.max_hidden_mb
        return int(mb * 1024 * 1024)

    def channel_options(self) -> list[tuple[str, int]]:
        return channel_options(self.max_message_mb)


def use_pipeline(requested: bool | None, remote: bool, device: str) -> bool:
    """Two lanes overlap one micro-batch's drafting with the other's verification: that pays
    where the services compute apart, not when they share this CPU's cores (2 cores: one lane
    served 27-28 % more tokens/s at concurrency 4, 9-29 % at 16; docs/benchmarks.md)."""
    return (remote or device != "cpu") if requested is None else requested
