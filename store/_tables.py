"""The store's tables: the only state shared by the proxy, the trainer and the dashboard.

One row per captured call, trajectory, group, reward, training job and adapter
version. Times are unix seconds (float). Token ids and logprobs are JSON arrays so a
call can be read back exactly as vLLM sampled it (a call that continues an earlier one of
its trajectory stores only what is new: ``store._compact``). Group readiness is derived, never
stored: a group in state ``open`` whose trajectories are all rewarded and that has at
least the policy's minimum size is *ready* (see ``store._store``).

The trainer reads these tables (``trainer`` may import ``store._tables``); the proxy
never imports the trainer.
"""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import JSON, Column, Index, LargeBinary, Table, UniqueConstraint, text
from sqlmodel import Field, SQLModel

KeyedBy = Literal["header", "path", "thread", "new"]


def _json(default: Any = None) -> Any:
    return Field(default_factory=lambda: default() if callable(default) else default, sa_column=Column(JSON))


class Policy(SQLModel, table=True):
    """A name agents use as ``model``; ``active_version`` is what ``policy`` routes to."""

    __tablename__ = "policies"

    name: str = Field(primary_key=True)
    base_model: str
    active_version: int = 0
    created_at: float
    updated_at: float
    # store.TrainingState: "paused" after the regression guard rolled a version back, until an admin resumes.
    training: str = Field(default="active", sa_column_kwargs={"server_default": "active"})
    training_reason: str | None = None  # why it was paused
    paused_at: float | None = None
    # The guard's last rollback: an adapter whose step started before it was trained from the bad version.
    rolled_back_at: float | None = None
    # The settings this policy overrides (proxy.PolicyOverrides: group size, batch, retention, guard, judge,
    # sampling defaults); None: the server's for all of them.
    config: dict[str, Any] | None = _json(None)
    # store.PolicyState: "serving", or "retired" (not served or trained; its data stays readable) since retired_at.
    state: str = Field(default="serving", sa_column_kwargs={"server_default": "serving"})
    retired_at: float | None = None


class Group(SQLModel, table=True):
    """Trajectories that answer the same task: the unit of GRPO's relative advantage."""

    __tablename__ = "groups"
    # One replica opens a task's next derived group: the others find it (store._derived).
    __table_args__ = (Index("ux_groups_task_seq", "policy", "task_key", "task_seq", unique=True),)

    id: str = Field(primary_key=True)
    policy: str = Field(index=True)
    # Hash of the task prompt for groups the proxy derived; None for groups named by the client.
    task_key: str | None = Field(default=None, index=True)
    state: str = Field(default="open", index=True)  # store.GroupState
    job_id: int | None = None
    created_at: float
    # Derived groups: the task's groups numbered 1, 2, ... and the trajectories keying placed in this one.
    task_seq: int | None = None
    seats: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    # The judge's claim: the replica judging the group now, until its lease runs out.
    judge_owner: str | None = None
    judge_lease_expires_at: float | None = None


class Trajectory(SQLModel, table=True):
    """One episode of the agent: its calls in order, and the reward it earned."""

    __tablename__ = "trajectories"
    # Seats taken at keying whose call is not recorded yet: the sweep that gives back stale ones (store._derived).
    __table_args__ = (
        Index("ix_trajectories_unrecorded", "created_at", sqlite_where=text("n_calls = 0"),
              postgresql_where=text("n_calls = 0")),
    )  # fmt: skip

    pk: int | None = Field(default=None, primary_key=True)
    id: str = Field(unique=True)
    group_id: str = Field(index=True)
    policy: str = Field(index=True)
    keyed_by: str  # KeyedBy
    created_at: float = Field(index=True)
    updated_at: float
    n_calls: int = 0
    last_version: int = 0
    # Unkeyed trajectories: hash of (policy, messages + last reply) so a continuation can join.
    tail_hash: str | None = Field(default=None, index=True)
    reward: float | None = None
    reward_source: str | None = None  # "service" | "judge" | "human" (store.REWARD_SOURCES); a person's score wins
    reward_note: str | None = None  # the person's note, or the judge's explanation, of the reward it holds
    metrics: dict[str, float] = _json(dict)
    rewarded_at: float | None = None
    # The answer a person wrote with their score (POST /admin/trajectories/{id}/feedback): export and sft read it.
    demonstration: str | None = None


class Call(SQLModel, table=True):
    """One request through the proxy, with the exact tokens vLLM saw and sampled."""

    __tablename__ = "calls"
    __table_args__ = (Index("ix_calls_trajectory_started", "trajectory_id", "started_at"),)

    pk: int | None = Field(default=None, primary_key=True)
    id: str = Field(unique=True)
    trajectory_id: str
    group_id: str
    policy: str
    endpoint: str  # "chat.completions" | "completions"
    model: str  # as the client asked
    served_model: str  # as vLLM served it: the base model or "policy@N"
    version: int
    stream: bool
    request: dict[str, Any] = _json(dict)
    # The response as the client saw it (streams reassembled), without token-level fields.
    response: dict[str, Any] | None = _json(None)
    prompt_token_ids: list[int] = _json(list)
    completion_token_ids: list[int] = _json(list)
    logprobs: list[float] = _json(list)  # sampling logprob of each completion token
    # Choices 1..n-1 when n > 1: [{"token_ids", "logprobs", "finish_reason"}].
    other_choices: list[dict[str, Any]] = _json(list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status_code: int
    error: str | None = None
    latency_ms: float
    ttft_ms: float | None = None
    started_at: float
    # Compact capture (store._compact): this call's prompt ids continue the first ``prefix_tokens`` ids of
    # call ``prefix_of``'s prompt + completion, and its request's messages the first ``prefix_messages`` of
    # that call's; only the rest is stored here. NULL: stored whole (every row before revision 0007).
    prefix_of: str | None = None
    prefix_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    prefix_messages: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    # The structured-output specification vLLM sampled the completion under (tracetrain_core.structured_outputs):
    # the grammar the trainer masks its logits with. NULL: unconstrained (and every row before revision 0013).
    structured_outputs: dict[str, Any] | None = _json(None)
    # This call's own reward (POST /v1/rewards with its call_id; the latest wins), beside its trajectory's.
    reward: float | None = None


class Reward(SQLModel, table=True):
    """Every reward posted (or judged); the trajectory keeps the latest external one."""

    __tablename__ = "rewards"

    pk: int | None = Field(default=None, primary_key=True)
    trajectory_id: str = Field(index=True)
    group_id: str
    value: float
    metrics: dict[str, float] = _json(dict)
    source: str = "service"  # "service" (POST /v1/rewards) | "judge" | "human" (a person's score, with a note)
    explanation: str | None = None
    created_at: float
    call_id: str | None = None  # the call rewarded; None: the whole trajectory


class TrainingJob(SQLModel, table=True):
    """A request for one training step over a batch of ready groups."""

    __tablename__ = "training_jobs"
    # One step of a policy at a time: of workers claiming together, one wins (store._jobs.Jobs.claim).
    # The policy served least recently is found by its newest start (store.Jobs.claim_next).
    __table_args__ = (
        Index("ux_training_jobs_running", "policy", unique=True, sqlite_where=text("state = 'running'"),
              postgresql_where=text("state = 'running'")),
        Index("ix_training_jobs_policy_started", "policy", "started_at"),
    )  # fmt: skip

    id: int | None = Field(default=None, primary_key=True)
    policy: str = Field(index=True)
    state: str = Field(default="queued", index=True)  # store.JobState
    group_ids: list[str] = _json(list)
    version: int | None = None  # the adapter version its step records: set by the claim, None if it recorded none
    metrics: dict[str, Any] = _json(dict)
    progress: float = 0.0
    error: str | None = None
    worker: str | None = None  # the claim's owner: "host:pid" of the worker running it
    lease_expires_at: float | None = None  # a running job whose lease expired is queued again
    # Times it was taken back from a worker that stopped renewing its lease.
    reclaimed: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    # The hand-over of a GPU shared with vLLM around the step (store.GpuHandover; --share-gpu).
    gpu_state: str = Field(default="none", sa_column_kwargs={"server_default": "none"})
    gpu_requested_at: float | None = None
    gpu_granted_at: float | None = None
    gpu_released_at: float | None = None  # released by the worker, or revoked by the proxy
    gpu_asleep_s: float | None = None  # how long vLLM slept for this step (sleep to wake-up)


class AdapterVersion(SQLModel, table=True):
    """A LoRA adapter on disk, served as ``policy@version`` once published."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("policy", "version"),)

    pk: int | None = Field(default=None, primary_key=True)
    policy: str = Field(index=True)
    version: int
    path: str
    job_id: int | None = None
    state: str = "trained"  # store.AdapterState
    lease_owner: str | None = None  # the proxy replica publishing it (state "loading")
    lease_expires_at: float | None = None
    # Times it was taken back from a replica that died while publishing.
    reclaimed: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    error: str | None = None
    metrics: dict[str, Any] = _json(dict)
    created_at: float
    published_at: float | None = None
    # The regression guard's watch over this version once published (proxy.training._guard): its
    # baseline, the group-mean rewards compared, and the verdict. None when it was never watched.
    guard: dict[str, Any] | None = _json(None)


class Trial(SQLModel, table=True):
    """A canary trial: a newly published version (``candidate``) serving ``fraction`` of new trajectories while
    ``baseline`` serves the rest, until their rewards (or its bound, or an admin) decide (``store._trials``)."""

    __tablename__ = "trials"
    # One trial of a policy at a time: of replicas starting one together, one wins.
    __table_args__ = (
        Index("ux_trials_running", "policy", unique=True, sqlite_where=text("state = 'running'"),
              postgresql_where=text("state = 'running'")),
    )  # fmt: skip

    id: int | None = Field(default=None, primary_key=True)
    policy: str = Field(index=True)
    candidate: int
    baseline: int
    fraction: float
    state: str = "running"  # store.TrialState
    started_at: float
    ended_at: float | None = None
    decided_by: str | None = None  # "test" (the paired test), "bound" (its size or time), "admin", "alias"
    reason: str | None = None
    # The last look at its rewards (proxy.training._canary_verdict): shares, means with intervals, the test.
    verdict: dict[str, Any] | None = _json(None)


class AdapterFile(SQLModel, table=True):
    """One file of an adapter version, kept in the store so that vLLM need not see the trainer's disk.

    The worker writes an adapter's files with its ``adapters`` row, in one transaction; the
    proxy serves them (``GET /v1/adapters/{policy}/{version}/files/{name}``) to the resolver
    that vLLM runs (``tracetrain_vllm``). ``sha256`` is the hex digest of ``data``.
    """

    __tablename__ = "adapter_files"
    __table_args__ = (UniqueConstraint("policy", "version", "name"),)

    pk: int | None = Field(default=None, primary_key=True)
    policy: str
    version: int
    name: str  # a plain file name: "adapter_model.safetensors", "adapter_config.json", ...
    size: int
    sha256: str
    data: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    created_at: float


class Judgement(SQLModel, table=True):
    """One run of the group judge (``proxy.judge._service``): its scores, or why it failed.

    ``state`` is "ok" or "failed"; an ok row's scores were written as ``rewards`` rows
    (source "judge") in the same transaction, a failed row wrote nothing else. Rows with
    the same ``cache_key`` asked the judge model the same thing: a new run reuses an ok
    row's ``scores`` instead of asking again.
    """

    __tablename__ = "judgements"

    id: int | None = Field(default=None, primary_key=True)
    group_id: str = Field(index=True)
    policy: str = Field(index=True)
    reward_source: str  # the proxy's --reward-source when it ran: "judge" wrote trajectory rewards
    trigger: str  # "complete" | "idle" | "admin"
    state: str = Field(index=True)  # "ok" | "failed"
    model: str
    cache_key: str = Field(index=True)
    cached: bool = False  # the scores came from an earlier run with the same cache_key
    attempts: int = 0  # requests made to the judge model (0 when cached)
    n_trajectories: int = 0
    # [{"trajectory_id", "label", "score", "explanation"}] in label order; empty when failed.
    scores: list[dict[str, Any]] = _json(list)
    error: str | None = None
    usage: dict[str, Any] = _json(dict)  # prompt_tokens, completion_tokens summed over attempts
    started_at: float
    finished_at: float


class RevokedSession(SQLModel, table=True):
    """A dashboard session ended on the server (its nonce; logged out), or ``*``: every session issued before
    ``revoked_at`` (store._sessions)."""

    __tablename__ = "revoked_sessions"

    nonce: str = Field(primary_key=True)
    revoked_at: float
    expires_at: float  # when the session would have ended anyway: the row is useless after it


class Evaluation(SQLModel, table=True):
    """A score of one version on something it was not trained on: a held-out set, a benchmark.

    Posted by whoever measured it (``POST /admin/evaluations``: the demo's held-out runs, a user's
    evaluation job); the trainer worker logs each into its run (``--log-to``) beside the steps, at the
    version's step. At most ``store._evaluations.KEEP`` rows per policy are kept, the oldest deleted.
    """

    __tablename__ = "evaluations"
    __table_args__ = (Index("ix_evaluations_policy_id", "policy", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    policy: str
    version: int
    name: str  # e.g. "held_out_success"
    value: float
    samples: int | None = None  # how many attempts the value stands for, when said
    created_at: float


def _table(model: type[SQLModel]) -> Table:
    table = model.__table__  # type: ignore[attr-defined]  # set by SQLModel's metaclass
    assert isinstance(table, Table)
    return table


# The tables as SQLAlchemy Core sees them: the store's queries are written against these.
policies = _table(Policy)
groups = _table(Group)
trajectories = _table(Trajectory)
calls = _table(Call)
rewards = _table(Reward)
training_jobs = _table(TrainingJob)
adapters = _table(AdapterVersion)
adapter_files = _table(AdapterFile)
trials = _table(Trial)
judgements = _table(Judgement)
revoked_sessions = _table(RevokedSession)
evaluations = _table(Evaluation)
