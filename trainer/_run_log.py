"""What the trainer tells TensorBoard, W&B or MLflow (``--log-to``): one run per worker, written by rank 0.

    claim -> step -> record   --> RunLog.step(version, metrics)        train/loss, train/reward_mean, ...
    POST /admin/evaluations   --> store.evaluations --> RunLog.evaluation(...)   eval/held_out_success, ...

Every number of a step's metrics is logged as ``train/<name>`` at the step's version: the reward's
mean and spread (``reward_mean``, ``reward_std``), the loss, the sampler/learner gap
(``logprob_mismatch_mean``, ``_max``, ``_on_policy``), tokens trained and captured (``trained_tokens``,
``samples_completion_tokens``, ``samples_call_tokens``), the step's times (``seconds``: the optimizer
step; ``job_seconds``: the job until the step's end, its batch built from the store included), its
sampling time (``sampling_seconds``: its trajectories' first call to their last answer), the version.
The run's configuration (the training config, the policy, the base model, the device) is logged once,
at the start.

Evaluations come from other processes (the demo's held-out runs, a user's benchmark), through the store:
the worker reads what is new at each beat and logs it as ``eval/<name>`` at the version it measured.
Logging never fails a step: a backend that raises, or cannot start its run, is logged (once a minute), its
trouble is recorded with each step (the dashboard's Training page, ``/metrics``), and training goes on; a run that
could not start is tried again every five minutes. What can be known before a run starts (a directory not
writable, W&B online without a key, an MLflow URI that MLflow refuses or that does not answer) is checked by
``check_destinations`` when ``tracetrain serve`` starts, before it starts anything.

The writers, one per backend, each through its library's own API:

- ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package) into
  ``LOG_DIR/RUN_NAME``; scalars at ``global_step`` = the version, the configuration as text.
- ``wandb``: ``wandb.init`` (``WANDB_PROJECT``, default ``tracetrain``; ``WANDB_MODE``, ``WANDB_ENTITY``,
  ``WANDB_DIR`` as W&B reads them, files under LOG_DIR unless ``WANDB_DIR``); every metric plotted against
  ``version`` (``define_metric``), since an evaluation of an older version may come after newer steps.
- ``mlflow``: ``MlflowClient`` against ``MLFLOW_TRACKING_URI`` (default ``sqlite:///LOG_DIR/mlflow.db``), in
  ``MLFLOW_EXPERIMENT_NAME`` (default ``tracetrain``); metrics at ``step`` = the version, the configuration
  as the run's parameters.

Each library is imported only when asked for; a missing one is a ``MissingExtra`` naming what to install.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import logging
import math
import netrc
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from store import redact

if TYPE_CHECKING:
    from store import Store

log = logging.getLogger("tracetrain.trainer.runlog")

_WARN_EVERY_S = 60.0
_RETRY_START_S = 300.0  # a run that could not start is tried again this often (W&B may take a minute to give up)
_PROBLEM_CHARS = 500  # what a step records of a backend's failure
# What to check when a backend fails, in its own words.
_HINTS = {
    "tensorboard": "check that --log-dir is a directory this process can write",
    "wandb": "set WANDB_API_KEY (wandb login), or WANDB_MODE=offline to keep runs on disk for `wandb sync`",
    "mlflow": "check MLFLOW_TRACKING_URI and that its server answers",
}

Backend = Literal["tensorboard", "wandb", "mlflow"]
BACKENDS: tuple[Backend, ...] = ("tensorboard", "wandb", "mlflow")
# The module each backend needs, and the extra that installs it.
_NEEDS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
_MLFLOW_PARAM_CHARS = 6000  # MLflow refuses longer parameter values


class MissingExtra(RuntimeError):
    """A backend's library is not installed; the message says what to install."""


def check_installed(backends: tuple[Backend, ...]) -> None:
    """Raise ``MissingExtra`` for the first backend whose library is missing (before anything starts)."""
    for backend in backends:
        if importlib.util.find_spec(_NEEDS[backend]) is None:
            raise MissingExtra(f"--log-to {backend} needs the {backend} package: pip install 'tracetrain[{backend}]'")


def parse_log_to(text: str) -> tuple[Backend, ...]:
    """``"tensorboard,wandb"`` -> the backends, in order, once each; ValueError naming a wrong one."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BACKENDS]
    if unknown:
        raise ValueError(f"--log-to: unknown {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    return tuple(dict.fromkeys(name for name in BACKENDS if name in names))


def default_run_name(policy: str) -> str:
    return f"{policy}-{time.strftime('%Y%m%d-%H%M%S')}"


class RunLog:
    """The run's writers; ``step`` and ``evaluation`` block on them (call from a thread).

    A backend that cannot start the run, or stops taking metrics, never stops training: what went wrong is in
    ``problems`` (the worker records it with each step, for the dashboard and ``/metrics``), logged once a
    minute, and a run that could not start is tried again every few minutes. The store keeps every step anyway.
    """

    def __init__(
        self, writers: Mapping[Backend, Writer], openers: Mapping[Backend, Callable[[], Writer]] | None = None
    ) -> None:
        self.writers = dict(writers)
        self.problems: dict[Backend, str] = {}
        self._openers = dict(openers or {})  # backends whose run has not started yet
        self._tried_at: dict[Backend, float] = {}
        self._warned_at: dict[str, float] = {}
        for backend in list(self._openers):
            self._start(backend, time.monotonic())

    @classmethod
    def open(cls, backends: Sequence[Backend], log_dir: Path, run_name: str, config: Mapping[str, Any]) -> RunLog:
        """Start a run in each backend (``MissingExtra`` first, before any starts)."""
        check_installed(tuple(backends))
        run = cls({}, {b: functools.partial(open_writer, b, log_dir, run_name, config) for b in backends})
        if run.writers:
            log.info("logging the run %s to %s", run_name, ", ".join(run.writers))
        return run

    def step(self, version: int, metrics: Mapping[str, Any]) -> None:
        """A recorded step's numbers, as ``train/<name>`` at ``version``."""
        values = {f"train/{name}": float(v) for name, v in metrics.items() if _is_number(v)}
        self._write(values | {"train/version": float(version)}, version)

    def evaluation(self, version: int, name: str, value: float, samples: int | None = None) -> None:
        """An evaluation of ``version``, as ``eval/<name>`` (and ``eval/<name>_samples`` when said)."""
        values = {f"eval/{name}": float(value)}
        if samples is not None:
            values[f"eval/{name}_samples"] = float(samples)
        self._write(values, version)

    def close(self) -> None:
        for backend, writer in self.writers.items():
            try:
                writer.close()
            except Exception:
                log.exception("closing the %s run failed", backend)

    def _start(self, backend: Backend, now: float) -> None:
        self._tried_at[backend] = now
        try:
            self.writers[backend] = self._openers[backend]()
        except Exception as exc:  # W&B without a key, MLflow's server down: the steps go on without it
            self._failed(backend, "starting the run", exc)
        else:
            del self._openers[backend]
            self.problems.pop(backend, None)

    def _write(self, values: Mapping[str, float], version: int) -> None:
        now = time.monotonic()
        for backend in [b for b in self._openers if now - self._tried_at[b] >= _RETRY_START_S]:
            self._start(backend, now)
        for backend, writer in self.writers.items():
            try:
                writer.scalars(values, version)
            except Exception as exc:  # a logger's trouble is never the step's
                self._failed(backend, "logging", exc)
            else:
                self.problems.pop(backend, None)

    def _failed(self, backend: Backend, doing: str, exc: Exception) -> None:
        self.problems[backend] = redact(f"{doing} failed: {type(exc).__name__}: {exc}")[:_PROBLEM_CHARS]
        now = time.monotonic()
        if now - self._warned_at.get(backend, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            self._warned_at[backend] = now
            log.error("%s to %s failed; training goes on without it (%s): %s", doing, backend, _HINTS[backend],
                      self.problems[backend])  # fmt: skip


class RunLogs:
    """One run per policy the worker trains (``{policy}-{time}``, or ``--run-name`` with the policy appended when
    several are trained), each opened at the policy's first step or evaluation by ``open_run(policy)``."""

    def __init__(self, open_run: Callable[[str], RunLog]) -> None:
        self._open_run = open_run
        self._runs: dict[str, RunLog] = {}
        self._evaluations_seen: dict[str, int] = {}  # policy -> the last evaluation id logged

    @property
    def policies(self) -> list[str]:
        return list(self._runs)

    def of(self, policy: str) -> RunLog:
        """``policy``'s run, started now if it is not yet (blocks: call from a thread)."""
        if policy not in self._runs:
            self._runs[policy] = self._open_run(policy)
        return self._runs[policy]

    def trouble(self, policy: str) -> dict[str, Any]:
        """What keeps ``policy``'s metrics from its backends now, as a step's metrics: ``run_log_failing`` (1 or 0:
        a number, so that ``/metrics`` shows its end too) and ``run_log_error`` (``mlflow: logging failed: ...``).
        Starts the policy's run if it is not yet (blocks: call from a thread)."""
        problems = self.of(policy).problems
        said = {"run_log_error": "; ".join(f"{b}: {text}" for b, text in problems.items())} if problems else {}
        return {"run_log_failing": int(bool(problems)), **said}

    def log_step(self, policy: str, version: int, metrics: Mapping[str, Any]) -> None:
        """A recorded step of ``policy`` into its run (blocks: call from a thread)."""
        self.of(policy).step(version, metrics)

    async def log_evaluations(self, store: Store, policies: Sequence[str]) -> None:
        """The evaluations of ``policies`` posted to the store since the last look, each into its policy's run;
        a failure is logged and waits for the next look."""
        try:
            for policy in policies:
                for row in await store.evaluations.since(policy, self._evaluations_seen.get(policy, 0)):
                    run = await asyncio.to_thread(self.of, policy)
                    await asyncio.to_thread(run.evaluation, row["version"], row["name"], row["value"], row["samples"])
                    self._evaluations_seen[policy] = int(row["id"])
        except Exception:
            log.exception("logging the posted evaluations failed; trying again at the next look")

    def close(self) -> None:
        for run in self._runs.values():
            run.close()
        self._runs.clear()


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# -- the destinations, checked before anything starts ----------------------------------------------------


def check_destinations(backends: Sequence[Backend], log_dir: Path) -> list[str]:
    """What keeps each backend from starting a run here, with what to do (empty: all can): ``tracetrain serve``
    asks before it starts anything (``python -m trainer --check-log-to``). It starts no run: a directory that
    cannot be written, W&B online without a key, an MLflow URI MLflow refuses or a server that does not answer."""
    problems: list[str] = []
    for backend in backends:
        try:
            if importlib.util.find_spec(_NEEDS[backend]) is None:
                raise MissingExtra(f"the {backend} package is missing: pip install 'tracetrain[{backend}]'")
            if backend == "wandb":
                _check_wandb(log_dir)
            elif backend == "mlflow":
                _check_mlflow(log_dir)
            else:
                _check_writable(log_dir)
        except Exception as exc:
            problems.append(redact(f"--log-to {backend}: {type(exc).__name__}: {exc} ({_HINTS[backend]})"))
    return problems


def _check_writable(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
        pass


def _check_wandb(log_dir: Path) -> None:
    """Online W&B needs a key, as ``wandb.init`` reads it (environment, identity token, ``~/.netrc``)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        _check_writable(Path(os.environ.get("WANDB_DIR") or log_dir))
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = (os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise RuntimeError(f"W&B runs online (WANDB_MODE is not offline) and has no API key for {host}")


def _check_mlflow(log_dir: Path) -> None:
    """The tracking URI answers (one request, no retries), and the experiment is not deleted."""
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # this process only checks, then exits
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    log_dir.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=_mlflow_uri(log_dir))
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "tracetrain"
    experiment = client.get_experiment_by_name(name)
    if experiment is not None and experiment.lifecycle_stage == "deleted":
        raise RuntimeError(f"the experiment {name!r} is deleted: restore it, or set MLFLOW_EXPERIMENT_NAME")


def _mlflow_uri(log_dir: Path) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{log_dir.resolve() / 'mlflow.db'}"


# -- the writers ---------------------------------------------------------------------------------------


class Writer(Protocol):
    def scalars(self, values: Mapping[str, float], version: int) -> None: ...
    def close(self) -> None: ...


def open_writer(backend: Backend, log_dir: Path, run_name: str, config: Mapping[str, Any]) -> Writer:
    check_installed((backend,))
    if backend == "tensorboard":
        return _TensorBoard(log_dir, run_name, config)
    if backend == "wandb":
        return _WandB(log_dir, run_name, config)
    return _MLflow(log_dir, run_name, config)


class _TensorBoard:
    def __init__(self, log_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = log_dir / run_name
        self._writer = SummaryWriter(log_dir=str(self.path))
        self._writer.add_text("config", "```json\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)
        self._writer.flush()

    def scalars(self, values: Mapping[str, float], version: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=version)
        self._writer.flush()  # a step is minutes apart: let TensorBoard show it now

    def close(self) -> None:
        self._writer.close()


class _WandB:
    def __init__(self, log_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        import wandb

        where = None if os.environ.get("WANDB_DIR") else str(log_dir)  # None: W&B's own choice
        project = None if os.environ.get("WANDB_PROJECT") else "tracetrain"
        log_dir.mkdir(parents=True, exist_ok=True)
        quiet = wandb.Settings(console="off")  # the worker's log stays the worker's: serve reads it
        self._run = wandb.init(project=project, name=run_name, config=dict(config), job_type="train", dir=where,
                               settings=quiet)  # fmt: skip
        self._run.define_metric("version")
        for family in ("train/*", "eval/*"):
            self._run.define_metric(family, step_metric="version")

    def scalars(self, values: Mapping[str, float], version: int) -> None:
        self._run.log({**values, "version": version})

    def close(self) -> None:
        self._run.finish()


class _MLflow:
    def __init__(self, log_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        log_dir.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=_mlflow_uri(log_dir))
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "tracetrain"
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
        run = self._client.create_run(experiment_id, run_name=run_name, tags={"tracetrain.run": run_name})
        self.run_id: str = run.info.run_id
        params = [Param(k, str(v)[:_MLFLOW_PARAM_CHARS]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self._client.log_batch(self.run_id, params=params[i : i + 100])

    def scalars(self, values: Mapping[str, float], version: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, version) for name, value in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list | tuple) else value
    return out
