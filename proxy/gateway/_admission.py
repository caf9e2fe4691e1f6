"""One owner for each call's bookkeeping: admitted, counted, recorded and released by its ``Admission``.

A call is counted in three places while it runs: the process's calls in flight (``Calls.in_flight``: a lone
call's store writes are committed on the event loop's thread, ``store._writer``), its policy version's
(``PolicyRegistry.in_flight``: a version is never unloaded under a call) and its vLLM server's (the router's:
placement and ``/metrics``). ``Calls.admit`` lets a call past the gate and hands back its ``Admission``; the
forwarder, then a stream's relay, tell it what happened (routed, answered, opened, recorded) and it raises and
lowers each count once, however the call ends (``close``, which may run any number of times).

    Calls.admit ─> Admission ─ serving(route) ─ answered() ─ opened(done) ─ record(write) ─ recorded() ─ close()
                   gate entered   version +1     gate left    server's count   the store      in flight -1   all back
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.errors import store_errors
from proxy.gateway._call import Call
from proxy.gateway._gate import Gate
from proxy.gateway._keying import Keyer
from proxy.gateway._policies import PolicyRegistry, Route
from proxy.observability._exporters import Exporters
from proxy.observability._metrics import Metrics
from store import CallWrite, RecordRefused, Store, StoreError, StoreFull


class Calls:
    """The calls in flight in this process (one per app); each one's bookkeeping is its ``Admission``'s."""

    def __init__(
        self,
        store: Store,
        keyer: Keyer,
        registry: PolicyRegistry,
        metrics: Metrics,
        exporters: Exporters | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.store, self.keyer, self.registry, self.metrics = store, keyer, registry, metrics
        self.exporters = exporters  # OTLP and Langfuse: each record queued for them, never awaited
        # Closed only while a training step has the GPU (--share-gpu); open, passing it costs nothing.
        self.gate = gate if gate is not None else Gate(wait_s=0.0)
        self.in_flight = 0  # calls admitted and not yet recorded

    @property
    def alone(self) -> bool:
        """The call asking is the only one in flight."""
        return self.in_flight == 1

    async def admit(self) -> Admission:
        """Let a call in: held here while a training step has the GPU, and routed after (the new version
        serves it)."""
        await self.gate.enter()
        self.in_flight += 1
        return Admission(self)


class Admission:
    """One call's counts and record, from the gate to its release (see the module's docstring)."""

    __slots__ = ("_calls", "_counted", "_gated", "_on_close", "_version", "handed_over")

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._counted = True  # in Calls.in_flight, until recorded()
        self._gated = True  # inside the gate, until answered()
        self._version: tuple[str, int] | None = None  # the policy version it counts in, once routed
        self._on_close: Callable[[], None] | None = None  # lowers its vLLM server's count, once opened
        self.handed_over = False  # a stream's relay owns the rest of the call (and its close)

    def serving(self, route: Route) -> None:
        """The call goes to ``route``'s version: it counts there until ``close``."""
        if self._version is None:
            self._version = (route.policy, route.version)
            self._calls.registry.in_flight[self._version] += 1

    def answered(self) -> None:
        """vLLM answered (a stream: its headers): a hand-over may pause it now."""
        if self._gated:
            self._gated = False
            self._calls.gate.leave()

    def opened(self, done: Callable[[], None]) -> None:
        """A stream was opened on a server: ``done`` lowers that server's count at ``close``."""
        self._on_close = done

    async def record(self, write: CallWrite) -> bool:
        """Commit the call's record (see ``Store.record_call``) and count it; False when the store's disk is full.

        A full disk stops capture, not serving: the call is answered and counted unrecorded
        (``tracetrain_capture_failures{reason="disk_full"}``); capture resumes once space is freed.
        Any other store failure is a 503: the store may be back in a moment, and the client retries; a
        record the store refuses (``RecordRefused``: it could never be written) is a 400.
        """
        calls = self._calls
        with store_errors():
            try:
                await calls.store.record_call(write, alone=calls.alone)
            except StoreFull:
                calls.metrics.call_unrecorded(write.call)
                return False
            except StoreError as exc:
                calls.metrics.call_not_recorded(write.call, refused=isinstance(exc, RecordRefused))
                calls.keyer.forget(write.trajectory_id)  # its seat was given back (store._writer)
                raise
        self._recorded(write)
        return True

    def record_nowait(self, write: CallWrite) -> None:
        """Queue the call's record without waiting (its client is gone; nobody waits for the answer)."""
        self._calls.store.record_call_nowait(write)
        self._recorded(write)

    def _recorded(self, write: CallWrite) -> None:
        self._calls.metrics.call_recorded(write.call)
        if self._calls.exporters is not None:
            self._calls.exporters.call_recorded(write)

    def broken(self, call: Call, reason: str) -> None:
        """vLLM broke the call's stream: ``reason`` is "upstream_error" (its error event) or "upstream_closed"."""
        self._calls.metrics.stream_broken(call.api or call.endpoint, reason)

    def recorded(self) -> None:
        """The record is written (or handed to the writer): one call less in flight, before the closing bytes
        (the client's next call may arrive before ``close`` runs)."""
        if self._counted:
            self._counted = False
            self._calls.in_flight -= 1

    def close(self) -> None:
        """Every count this call raised, lowered; runs once however the call ended (again: nothing)."""
        self.answered()
        self.recorded()
        if self._version is not None:
            self._calls.registry.in_flight[self._version] -= 1
            self._version = None
        if self._on_close is not None:
            done, self._on_close = self._on_close, None
            done()
