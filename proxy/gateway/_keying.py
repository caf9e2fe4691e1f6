"""Which trajectory and which group a call belongs to.

The key is read, in order, from the ``X-Trajectory-Id``/``X-Group-Id`` headers, then
from a path prefix (``/t/{id}/v1/...``, ``/g/{group}/t/{id}/v1/...``). A call with
neither joins the open unkeyed trajectory whose last request plus reply its messages
extend (threading), or starts a new one.

A group left unnamed is derived from the policy plus the messages up to the first
user message, so the same task asked N times forms one GRPO group. A derived group
takes at most ``group_size`` trajectories, then the next one opens; a group that
left the ``open`` state (a training job took it) takes no more. The store hands out
the seats (``Store.join_task_group``), so replicas sharing it fill the same groups.

A trajectory or a group belongs to one policy, the first whose call names its id: a call that names
another policy's trajectory or group is refused (404, ``TrajectoryNotFound``/``GroupNotFound``, saying
the id is taken, not by whom) instead of mixing two tenants' data, and threading hashes the policy with
the messages, so it never joins another policy's trajectory. The id is taken when the first call is
keyed, before vLLM answers it, not when its record is written: a call of another policy that comes while
the first is in flight is refused too. Where one process writes the store (SQLite with capture, whose
records seat their trajectories), this keyer's memory holds a new id until its record stores it
(``_claim``); where replicas may share the store (PostgreSQL), the store takes it at keying: a derived
group's seat writes the trajectory's row (``Store.join_task_group``), a group the call names is written
with the trajectory's row (``Store.claim_named``), and the first policy to write an id holds it
(``store.KeyTaken`` for the others). The writer checks every record's owners again (``store._batch``).

Messages are compared in a canonical form (``tracetrain_core.canonical_message``):
content parts joined, tool-call ids dropped and arguments re-serialized, unknown fields
ignored, so a framework that re-serializes the conversation still threads.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from proxy.errors import key_taken
from store import KeyTaken, Store
from tracetrain_core import canonical_message

_CACHE_SIZE = 100_000


@dataclass(frozen=True, slots=True)
class Key:
    trajectory_id: str
    group_id: str
    keyed_by: str  # "header" | "path" | "thread" | "new"
    task_key: str | None  # set when the group was derived from the task prompt
    # > 0: a new trajectory not seated yet; its record seats it in a derived group of this size
    # (``CallWrite.seat_in``) and ``group_id`` is "" until then (``Keyer.seated``).
    seat_in: int = 0
    # The version that served the trajectory's calls so far (its last one), when known: None for a new
    # trajectory. A canary trial keeps a trajectory on its version (``PolicyRegistry.for_trajectory``).
    served_by: int | None = None


@dataclass(frozen=True, slots=True)
class KeyHints:
    """What the request itself says about its key."""

    header_trajectory: str | None = None
    header_group: str | None = None
    path_trajectory: str | None = None
    path_group: str | None = None


def new_trajectory_id() -> str:
    return f"traj-{uuid.uuid4().hex}"


class Conversation:
    """Hashes of a request's messages: its task key and the prefixes that may thread."""

    def __init__(self, policy: str, messages: Sequence[dict[str, Any]] | None, prompt: Any = None) -> None:
        h = hashlib.blake2b(policy.encode(), digest_size=16)
        self.task_key: str
        self.thread_candidates: list[str] = []  # longest first
        if messages is None:
            h.update(orjson.dumps(prompt))
            self.task_key = h.hexdigest()
            self._hasher = None
            return
        task_key = None
        for message in messages:
            h.update(canonical_message(message))
            role = message.get("role")
            if role == "user" and task_key is None:
                task_key = h.hexdigest()
            elif role == "assistant":
                self.thread_candidates.append(h.hexdigest())
        self.thread_candidates.reverse()
        self.task_key = task_key or h.hexdigest()
        self._hasher = h

    def tail_after(self, reply: dict[str, Any]) -> str | None:
        """Hash of the messages plus ``reply``: what a continuation's prefix will hash to."""
        if self._hasher is None:
            return None
        h = self._hasher.copy()
        h.update(canonical_message(reply))
        return h.hexdigest()


class Keyer:
    """Resolves keys from the store; caches what never changes (the group and policy of a stored trajectory, the
    policy of a stored group) and the version that served each recent trajectory's last call here (``served``),
    all bounded."""

    def __init__(self, store: Store, *, group_size: int, thread_ttl_s: float) -> None:
        self._store = store
        self._group_size = group_size  # a derived group's size unless the call's policy says another
        self._thread_ttl_s = thread_ttl_s
        self._groups_of: OrderedDict[str, tuple[str, str]] = OrderedDict()  # trajectory id -> (group id, policy)
        self._group_policies: OrderedDict[str, str] = OrderedDict()  # group id -> policy
        self._served_by: OrderedDict[str, int] = OrderedDict()  # trajectory id -> version of its last call here
        # trajectory id -> policy: a new trajectory id taken by a call here, before its row is stored (``_claim``)
        self._owners: OrderedDict[str, str] = OrderedDict()

    async def resolve(
        self, policy: str, hints: KeyHints, conversation: Conversation, *, alone: bool = False,
        defer_seat: bool = False, group_size: int | None = None,
    ) -> Key:  # fmt: skip
        """``alone``: the only call in flight: a seat is written on this thread (``Store.join_task_group``).

        ``defer_seat`` (where the store seats with records: one process writes it): a new trajectory's seat
        is left to the caller, alone or not. A non-streamed call's record takes it (one commit instead of
        two: its group is told to the client only once it is recorded; the group is then known, ``seated``);
        a stream takes it (``seat``) while vLLM starts on the call. Another call of the same trajectory keyed
        meanwhile seats it, and the later seat finds that one. ``group_size``: the policy's derived groups'
        size (default: the keyer's). A trajectory or group of another policy is a 404; a new id named by the
        call is taken for ``policy`` here and now (see the module's docstring), and left again if the call is
        refused.
        """
        size = group_size or self._group_size
        trajectory_id = hints.header_trajectory or hints.path_trajectory
        group_hint = hints.header_group or hints.path_group
        if trajectory_id:
            keyed_by = "header" if hints.header_trajectory else "path"
            known = await self._known_group(trajectory_id, policy)
            if known is not None:
                return Key(trajectory_id, known[0], keyed_by, None, served_by=known[1])
            # New: taken at once (no await since _known_group's last check), before the store holds it.
            took = self._claim(self._owners, "trajectory", trajectory_id, policy)
            try:
                return await self._new(
                    policy, trajectory_id, keyed_by, group_hint, conversation, alone, defer_seat, size
                )
            except BaseException:
                if took:  # refused (its group is another policy's) or not keyed: the id is not taken
                    self._owners.pop(trajectory_id, None)
                raise
        if group_hint is None:
            found = await self._find_thread(conversation.thread_candidates)
            if found is not None:
                return Key(found[0], found[1], "thread", None, served_by=found[2])
        return await self._new(policy, new_trajectory_id(), "new", group_hint, conversation, alone, defer_seat, size)

    async def _new(
        self, policy: str, trajectory_id: str, keyed_by: str, group_hint: str | None, conversation: Conversation,
        alone: bool, defer_seat: bool, group_size: int,
    ) -> Key:  # fmt: skip
        """A trajectory the store does not hold yet: in the group it names, or a seat in its task's group."""
        if group_hint is not None:
            group_id = await self._named_group(policy, trajectory_id, keyed_by, group_hint)
            return self._remember(Key(trajectory_id, group_id, keyed_by, None), policy)
        task_key = conversation.task_key
        if defer_seat and self._store.seats_with_records:
            return Key(trajectory_id, "", keyed_by, task_key, seat_in=group_size)
        try:
            group_id = await self._store.join_task_group(
                policy, task_key, trajectory_id, keyed_by=keyed_by, group_size=group_size, alone=alone
            )
        except KeyTaken as exc:
            raise self._refused(exc) from exc
        return self._remember(Key(trajectory_id, group_id, keyed_by, task_key), policy)

    async def seat(self, policy: str, key: Key, *, alone: bool) -> Key:
        """Seat now a trajectory whose seat ``resolve`` deferred."""
        try:
            group_id = await self._store.join_task_group(
                policy, str(key.task_key), key.trajectory_id, keyed_by=key.keyed_by, group_size=key.seat_in,
                alone=alone,
            )  # fmt: skip
        except KeyTaken as exc:
            raise self._refused(exc) from exc
        return self.seated(key, group_id, policy)

    def seated(self, key: Key, group_id: str, policy: str) -> Key:
        """``key`` once its record seated it (``resolve``'s ``defer_seat``) in ``group_id``."""
        return self._remember(Key(key.trajectory_id, group_id, key.keyed_by, key.task_key), policy)

    def forget(self, trajectory_id: str) -> None:
        """A call of ``trajectory_id`` was not recorded and its seat given back (or the id is another policy's):
        ask the store next time."""
        self._groups_of.pop(trajectory_id, None)
        self._owners.pop(trajectory_id, None)

    def served(self, trajectory_id: str, version: int) -> None:
        """The version routed to serve a trajectory's call (what its next call here keeps, during a trial)."""
        self._served_by[trajectory_id] = version
        self._served_by.move_to_end(trajectory_id)
        if len(self._served_by) > _CACHE_SIZE:
            self._served_by.popitem(last=False)

    def _remember(self, key: Key, policy: str) -> Key:
        self._groups_of.setdefault(key.trajectory_id, (key.group_id, policy))
        if len(self._groups_of) > _CACHE_SIZE:
            self._groups_of.popitem(last=False)
        return Key(key.trajectory_id, self._groups_of[key.trajectory_id][0], key.keyed_by, key.task_key)

    async def _known_group(self, trajectory_id: str, policy: str) -> tuple[str, int | None] | None:
        """(group, version of its last call) of a trajectory keyed before, here or (the store) on any replica;
        None when it is new; a 404 when it is another policy's."""
        known = self._groups_of.get(trajectory_id)
        served_by = self._served_by.get(trajectory_id)
        if known is None:
            self._claim(self._owners, "trajectory", trajectory_id, policy, only_check=True)
            stored = await self._store.trajectory_group(trajectory_id)
            # Another call of the same new trajectory may have been keyed while we waited.
            known = self._groups_of.get(trajectory_id)
            served_by = self._served_by.get(trajectory_id)
            if known is None and stored is not None:
                known = self._groups_of[trajectory_id] = (stored[0], stored[1])
                served_by = stored[2]
        if known is None:
            self._claim(self._owners, "trajectory", trajectory_id, policy, only_check=True)  # taken while we waited?
            return None
        if known[1] != policy:
            raise key_taken("trajectory", trajectory_id)
        return known[0], served_by

    async def _named_group(self, policy: str, trajectory_id: str, keyed_by: str, group_id: str) -> str:
        """The group of a new trajectory whose call names ``group_id``: that group, unless another policy holds it
        (a 404); a new group is taken for ``policy`` at once (see the module's docstring)."""
        owner = self._group_policies.get(group_id)
        if owner is None:
            owner = await self._store.group_policy(group_id)
            if owner is not None:
                self._claim(self._group_policies, "group", group_id, owner)
        if owner is not None and owner != policy:
            raise key_taken("group", group_id)
        if self._store.seats_with_records:  # one process writes the store: taken here until the record stores it
            self._claim(self._group_policies, "group", group_id, policy)
            return group_id
        if owner is not None and keyed_by == "new":
            return group_id  # a stored group of the policy, and a trajectory id of ours that no client can name
        try:
            group_id = await self._store.claim_named(policy, trajectory_id, group_id, keyed_by=keyed_by)
        except KeyTaken as exc:
            raise self._refused(exc) from exc
        self._claim(self._group_policies, "group", group_id, policy)
        return group_id

    def _claim(
        self, owners: OrderedDict[str, str], kind: Literal["trajectory", "group"], key: str, policy: str,
        *, only_check: bool = False,
    ) -> bool:  # fmt: skip
        """Take ``key`` for ``policy`` in ``owners`` (bounded), or a 404 when another policy took it first.
        True when this took it (it was nobody's)."""
        owner = owners.get(key)
        if owner is not None and owner != policy:
            raise key_taken(kind, key)
        if owner is not None or only_check:
            return False
        owners[key] = policy
        if len(owners) > _CACHE_SIZE:
            owners.popitem(last=False)
        return True

    def _refused(self, exc: KeyTaken) -> Exception:
        """The store found the id another policy's: forget what this keyer took, and answer a 404."""
        if exc.kind == "trajectory":
            self._owners.pop(exc.key, None)
        return key_taken(exc.kind, exc.key)

    async def _find_thread(self, candidates: Sequence[str]) -> tuple[str, str, int] | None:
        # Asked of the store every time: a call's record (and its tail) commits before its
        # reply is sent, so the store is never behind the client, on any replica.
        if not candidates:
            return None
        stored = await self._store.find_open_thread(candidates, since=time.time() - self._thread_ttl_s)
        return (stored[0], stored[1], stored[3]) if stored else None
