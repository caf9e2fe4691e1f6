"""What tracetrain's capture costs: the proxy against the upstream itself and against LiteLLM.

Three targets, each a process group of its own: ``direct`` (the fake vLLM of
``tests/fake_vllm.py``), ``tracetrain`` (``tracetrain serve``, capture into SQLite) and
``litellm`` (LiteLLM's proxy, one worker, no database), both proxies in front of that fake.
Per mode ("plain", "stream") and concurrency the targets run back to back under ``wrk``
(``bench/wrk/chat.lua``: a fresh ``X-Trajectory-Id`` per request), each after a warm-up and
a wait for quiet. Time to first streamed byte is probed apart at concurrency 1, and every
request tracetrain answered must then be a row of its ``calls`` table (else exit status 1).
bench/README.md says how to run it and what to keep in mind reading the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import secrets
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WRK_SCRIPT = Path(__file__).resolve().parent / "wrk" / "chat.lua"
TARGETS = ("direct", "tracetrain", "litellm")
MODES = ("plain", "stream")
PROMPT = "Write one short sentence about proxies, trajectories and rewards for this benchmark."
BASE_MODEL = "fake/base-model"
POLICY = "agent"
HOST = "127.0.0.1"
TTFB_WARMUP = 20  # probes sent, and not timed, before the measured ones
PROFILE_RATE_HZ = 100


@dataclass(frozen=True, slots=True)
class Options:
    duration_s: int
    warmup_s: int
    concurrency: tuple[int, ...]
    targets: tuple[str, ...]
    ttfb_requests: int
    out: Path | None
    profile: Path | None


def parse_options(argv: Sequence[str] | None) -> Options:
    """Read the command line; ``--quick`` shortens everything for a smoke run."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " See bench/README.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--duration", type=int, default=10, help="seconds of wrk load per cell (whole seconds)")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of warm-up per target before each cell")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated wrk connection counts")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset of " + ",".join(TARGETS))
    parser.add_argument("--ttfb-requests", type=int, default=200, help="streamed requests per target for TTFB")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--profile", type=Path, metavar="RAW", help="then py-spy tracetrain under plain c=64 into RAW")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 s cells, concurrency 1,64, 30 TTFB probes")
    args = parser.parse_args(argv)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    if not targets or set(targets) - set(TARGETS):
        parser.error(f"--targets: choose from {','.join(TARGETS)}")
    if args.quick:
        return Options(2, 1, (1, 64), targets, 30, args.out, args.profile)
    concurrency = tuple(int(c) for c in args.concurrency.split(","))
    return Options(args.duration, args.warmup, concurrency, targets, args.ttfb_requests, args.out, args.profile)


# ------------------------------------------------------------------ servers


@dataclass(frozen=True, slots=True)
class Server:
    """One running target: where it listens, the model name it serves, its process."""

    name: str
    port: int
    model: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _tool(name: str) -> str:
    """A console script of the running interpreter's environment (the project's .venv)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: run this with the project's .venv (make bench-proxy)")
    return found


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 90.0) -> None:
    """Poll ``url`` until it answers 200; fail with the server's log if it dies or never answers."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def _process(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` in its own process group; stop the whole group on exit, whatever happens."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        for sig, grace_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
                break


def _litellm_config(workdir: Path, upstream_port: int) -> Path:
    path = workdir / "litellm.yaml"
    path.write_text(
        f"model_list:\n  - model_name: {POLICY}\n    litellm_params:\n      model: openai/{BASE_MODEL}\n"
        f"      api_base: http://{HOST}:{upstream_port}/v1\n      api_key: unused\n"
    )
    return path


def start_servers(stack: contextlib.ExitStack, targets: Sequence[str], workdir: Path) -> dict[str, Server]:
    """Start the fake upstream and the proxies the run needs, each answering before this returns."""

    def start(name: str, argv: list[str], ready_path: str, model: str, env: dict[str, str] | None = None) -> Server:
        port, log = _free_port(), workdir / f"{name}.log"
        proc = stack.enter_context(_process([*argv, "--host", HOST, "--port", str(port)], log, env))
        _wait_http(f"http://{HOST}:{port}{ready_path}", proc, log)
        return Server(name, port, model, proc, log)

    fake = start("direct", [sys.executable, "tests/fake_vllm.py"], "/v1/models", BASE_MODEL)
    servers = {"direct": fake}
    upstream = f"{fake.url}/v1"
    if "tracetrain" in targets:
        argv = [_tool("tracetrain"), "serve", "--upstream", upstream, "--data-dir", str(workdir / "tracetrain")]
        servers["tracetrain"] = start("tracetrain", [*argv, "--no-train", "--log-level", "warning"], "/readyz", POLICY)
    if "litellm" in targets:
        quiet = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "DISABLE_ADMIN_UI": "True", "LITELLM_LOG": "ERROR"}
        config = str(_litellm_config(workdir, fake.port))
        argv = [_tool("litellm"), "--config", config, "--num_workers", "1", "--telemetry", "False"]
        servers["litellm"] = start("litellm", argv, "/health/liveliness", POLICY, {**os.environ, **quiet})
    return servers


def litellm_setup_notes(server: Server) -> list[str]:
    """What in LiteLLM's start-up could tilt the comparison: debug logging, the callbacks it runs."""
    notes = []
    if re.search(r"\bDEBUG\b", server.log.read_text(errors="replace")):
        notes.append("LiteLLM logged DEBUG lines at start-up")
    with urllib.request.urlopen(server.url + "/active/callbacks", timeout=5) as response:
        active = json.loads(response.read()).get("all_litellm_callbacks", [])
    names = sorted({re.sub(r"^<(?:bound method )?([\w.]+).*", r"\1", c).rsplit(".", 1)[-1] for c in active})
    notes.append(f"LiteLLM runs its proxy's built-in hooks only (none configured): {', '.join(names)}")
    return notes


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, all its threads (finished ones included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU time all cores spent busy since boot (``/proc/stat``), in seconds."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_and_children_cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the wrk runs)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def settle(servers: Sequence[Server], window_s: float = 0.3, limit_s: float = 20.0) -> None:
    """Wait until each server is idle (< 5% of a CPU: its left-over work is done) and the whole
    machine nearly so (< 15%: no other job running), for at most ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = [cpu_seconds(s.proc.pid) for s in servers], machine_busy_seconds()
        time.sleep(window_s)
        after = [cpu_seconds(s.proc.pid) for s in servers], machine_busy_seconds()
        idle = all(b - a <= 0.05 * window_s for a, b in zip(before[0], after[0], strict=True))
        if idle and after[1] - before[1] <= 0.15 * window_s:
            return


# ------------------------------------------------------------------ wrk


@dataclass(frozen=True, slots=True)
class WrkResult:
    """What ``chat.lua``'s ``done()`` reports for one wrk run (latencies in ms)."""

    sent: int  # requests written, including those in flight when wrk stopped
    completed: int  # responses received
    duration_s: float
    errors: dict[str, int]  # connect, read, write, timeout, status (non-2xx/3xx answers)
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.completed / self.duration_s

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def parse_wrk(stdout: str) -> WrkResult:
    """Read the ``BENCH_RESULT key=value ...`` line that ``bench/wrk/chat.lua`` prints."""
    match = re.search(r"^BENCH_RESULT (.*)$", stdout, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"wrk printed no BENCH_RESULT line:\n{stdout}")
    v = {key: float(value) for key, value in (pair.split("=") for pair in match.group(1).split())}
    return WrkResult(
        sent=int(v["sent"]),
        completed=int(v["completed"]),
        duration_s=v["duration_us"] / 1e6,
        errors={k: int(v[k]) for k in ("connect", "read", "write", "timeout", "status")},
        p50_ms=v["p50_us"] / 1000,
        p99_ms=v["p99_us"] / 1000,
    )


def run_wrk(server: Server, mode: str, concurrency: int, seconds: int, tag: str) -> WrkResult:
    """``wrk --latency`` with min(2, c) threads and c connections; ids are ``TAG-<thread>-<n>``."""
    load = [f"-t{min(2, concurrency)}", f"-c{concurrency}", f"-d{seconds}s", "--latency", "--timeout", "30s"]
    argv = ["wrk", *load, "-s", str(WRK_SCRIPT), server.url, "--", server.model, mode, tag]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr}{done.stdout}")
    return parse_wrk(done.stdout)


# ------------------------------------------------------------------ raw HTTP, for time to first byte


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    first_byte_ms: float  # from sending the request to receiving the body's first byte
    body: bytes


class Connection:
    """One keep-alive HTTP/1.1 connection that notes when a response's first body byte arrived."""

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection((HOST, port), timeout=30)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buffer = b""
        self._received_ns = 0  # when the unread bytes arrived: all came with the last recv

    def close(self) -> None:
        self._sock.close()

    def _recv(self) -> None:
        data = self._sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self._buffer += data
        self._received_ns = time.perf_counter_ns()

    def _until(self, marker: bytes) -> bytes:
        while (end := self._buffer.find(marker)) < 0:
            self._recv()
        found, self._buffer = self._buffer[:end], self._buffer[end + len(marker) :]
        return found

    def _take(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._recv()
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken

    def _next_byte_arrival_ns(self) -> int:
        if not self._buffer:
            self._recv()
        return self._received_ns

    def exchange(self, request: bytes) -> Reply:
        """Send one request and read its whole response (chunked or sized)."""
        start_ns = time.perf_counter_ns()
        self._sock.sendall(request)
        head = self._until(b"\r\n\r\n").split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in head[1:])}
        first_ns, parts = 0, []
        if headers.get(b"transfer-encoding") == b"chunked":
            while (size := int(self._until(b"\r\n").split(b";")[0], 16)) > 0:
                first_ns = first_ns or self._next_byte_arrival_ns()
                parts.append(self._take(size + 2)[:-2])
            self._until(b"\r\n")
        else:
            length = int(headers.get(b"content-length", b"0"))
            first_ns = self._next_byte_arrival_ns() if length else time.perf_counter_ns()
            parts.append(self._take(length))
        return Reply(int(head[0].split(b" ", 2)[1]), (first_ns - start_ns) / 1e6, b"".join(parts))


def chat_request(server: Server, trajectory_id: str, stream: bool) -> bytes:
    """The chat completion ``chat.lua`` sends, as raw HTTP/1.1."""
    body: dict[str, Any] = {"model": server.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}
    if stream:
        body["stream"] = True
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{server.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nX-Trajectory-Id: {trajectory_id}\r\n\r\n"
    )
    return head.encode() + data


def check_answers(server: Server, tag: str) -> int:
    """A plain and a streamed call must answer 200 with the fake's echo; returns the calls made."""
    conn = Connection(server.port)
    try:
        for i, stream in enumerate((False, True)):
            reply = conn.exchange(chat_request(server, f"{tag}-{i}", stream))
            complete = b"data: [DONE]" in reply.body if stream else b'"choices"' in reply.body
            if reply.status != 200 or b"echo" not in reply.body or not complete:
                raise SystemExit(f"{server.name} answered {reply.status}: {reply.body[:500]!r}")
    finally:
        conn.close()
    return 2


@dataclass(frozen=True, slots=True)
class Ttfb:
    n: int
    p50_ms: float
    p99_ms: float


def measure_ttfb(server: Server, requests: int, tag: str) -> Ttfb:
    """Streamed requests one after the other on one keep-alive connection: ms to the first body byte."""
    conn = Connection(server.port)
    times = []
    try:
        for i in range(TTFB_WARMUP + requests):
            reply = conn.exchange(chat_request(server, f"{tag}-{i}", stream=True))
            if reply.status != 200:
                raise RuntimeError(f"TTFB probe to {server.name} answered {reply.status}: {reply.body[:300]!r}")
            if i >= TTFB_WARMUP:
                times.append(reply.first_byte_ms)
    finally:
        conn.close()
    cuts = statistics.quantiles(times, n=100, method="inclusive")
    return Ttfb(len(times), cuts[49], cuts[98])


# ------------------------------------------------------------------ the runs


@dataclass(slots=True)
class Bench:
    """What every load run needs, and the ledger of the batches of requests sent to tracetrain.

    A batch is (tag, sent, answered); its trajectory ids start with ``tag-`` and no tag is
    another's prefix up to a "-", so the store's rows are counted with ``LIKE 'tag-%'``.
    """

    servers: dict[str, Server]
    opts: Options
    run_id: str
    batches: list[tuple[str, int, int]] = field(default_factory=list)

    def note(self, target: str, tag: str, sent: int, answered: int) -> None:
        if target == "tracetrain":
            self.batches.append((tag, sent, answered))

    @property
    def targets(self) -> list[str]:
        """The measured targets in the usual order (the fake runs even when "direct" is not measured)."""
        return [t for t in TARGETS if t in self.opts.targets]

    def settle(self) -> None:
        settle(list(self.servers.values()))

    def load(self, target: str, mode: str, c: int, seconds: int, label: str) -> WrkResult:
        """A wrk run against ``target``, noted in the ledger."""
        tag = f"{self.run_id}-{target}-{label}"
        result = run_wrk(self.servers[target], mode, c, seconds, tag)
        self.note(target, tag, result.sent, result.completed)
        return result


@dataclass(frozen=True, slots=True)
class Cell:
    target: str
    mode: str
    concurrency: int
    result: WrkResult
    # CPUs kept busy during the run (1.0 = one core): the target, the upstream behind a proxy,
    # wrk (with this script), and the rest of the machine (other processes, if any).
    cpus: dict[str, float]


def warm_up(bench: Bench) -> None:
    """Load every target in both modes before anything is measured (LiteLLM imports lazily)."""
    for target in bench.targets:
        for mode in MODES:
            bench.load(target, mode, 16, max(2, 2 * bench.opts.warmup_s), f"{mode}-warmup")


def measure_cell(bench: Bench, target: str, mode: str, c: int) -> Cell:
    """A warm-up at the cell's concurrency, a wait for quiet, then the measured wrk run."""
    bench.load(target, mode, c, bench.opts.warmup_s, f"{mode}-c{c}-w")
    bench.settle()
    pids = {target: bench.servers[target].proc.pid}
    if target != "direct":
        pids["upstream"] = bench.servers["direct"].proc.pid

    def snapshot() -> dict[str, float]:
        return {
            **{name: cpu_seconds(pid) for name, pid in pids.items()},
            "wrk": own_and_children_cpu_seconds(),
            "machine": machine_busy_seconds(),
        }

    before = snapshot()
    result = bench.load(target, mode, c, bench.opts.duration_s, f"{mode}-c{c}-m")
    used = {name: (value - before[name]) / result.duration_s for name, value in snapshot().items()}
    machine = used.pop("machine")
    used["rest"] = max(0.0, machine - sum(used.values()))
    return Cell(target, mode, c, result, used)


def run_matrix(bench: Bench) -> list[Cell]:
    """Every mode x concurrency, the targets back to back in an order that rotates per cell."""
    cells, order = [], bench.targets
    for mode in MODES:
        for c in bench.opts.concurrency:
            for target in order:
                cells.append(measure_cell(bench, target, mode, c))
                r = cells[-1].result
                numbers = f"{r.rps:7.1f} req/s  p50 {r.p50_ms:8.2f} ms  p99 {r.p99_ms:8.2f} ms  errors {r.error_count}"
                print(f"  {mode:6} c={c:<3} {target:10} {numbers}", file=sys.stderr, flush=True)
            order = order[1:] + order[:1]
    return cells


@dataclass(frozen=True, slots=True)
class Records:
    stored: int  # rows in ``calls`` for the benchmark's requests
    completed: int  # responses the clients received
    sent: int  # requests written, including those in flight when wrk stopped
    short: list[str]  # batches with fewer rows than responses
    by_batch: dict[str, tuple[int, int, int]]  # tag -> (sent, answered, stored)

    @property
    def ok(self) -> bool:
        return not self.short


def count_records(db: Path, batches: Sequence[tuple[str, int, int]]) -> Records:
    """Rows per trajectory-id prefix; a batch is short when it has fewer rows than responses."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    by_batch, short = {}, []
    try:
        for tag, sent, answered in batches:
            (rows,) = conn.execute("SELECT count(*) FROM calls WHERE trajectory_id LIKE ?", (tag + "-%",)).fetchone()
            by_batch[tag] = (sent, answered, rows)
            if rows < answered:
                short.append(f"{tag}: {rows} stored < {answered} answered")
    finally:
        conn.close()
    sent, answered, stored = (sum(counts[i] for counts in by_batch.values()) for i in range(3))
    return Records(stored, answered, sent, short, by_batch)


def profile_tracetrain(bench: Bench, raw: Path, seconds: int) -> str:
    """py-spy on tracetrain during a plain c=64 wrk run: samples of the GIL holder's stack.

    Blocking mode (py-spy pauses the process for each sample): ``--nonblocking`` reads the
    stacks while they change, and truncated most of them here.
    """
    bench.settle()
    sampling = ["--rate", str(PROFILE_RATE_HZ), "--gil", "--format", "raw", "--output", str(raw)]
    pid = str(bench.servers["tracetrain"].proc.pid)
    argv = [_tool("py-spy"), "record", "--pid", pid, "--duration", str(seconds), *sampling]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as spy:
        time.sleep(0.5)
        result = bench.load("tracetrain", "plain", 64, seconds + 2, "profile")
        spy.wait(seconds + 30)
    return summarize_pyspy(raw, seconds) + f"\n  (load while profiled: {result.rps:.0f} req/s)"


def _frame_key(frame: str) -> str:
    """``Forwarder.handle (proxy/gateway/_forward.py:115)`` -> ``proxy/gateway/_forward.py:Forwarder.handle``."""
    match = re.match(r"^(.*) \((.*?)(?::\d+)?\)$", frame)
    return f"{match.group(2)}:{match.group(1)}" if match else frame


def _thread_kind(frames: Sequence[str]) -> str:
    """The event loop's thread, or a worker thread named by the function it runs."""
    if not frames[0].startswith("threading.py:"):
        return "main thread (event loop)"
    return next((f for f in frames if not f.startswith("threading.py:")), "threading")


def summarize_pyspy(raw: Path, seconds: int, top: int = 15) -> str:
    """Samples by thread, top functions by own samples, tracetrain's by total, own samples by package."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [_frame_key(f) for f in stack.split(";") if f] or ["<no Python frame>"]
        threads[_thread_kind(frames)] += int(count)
        own[frames[-1]] += int(count)
        packages[frames[-1].split("/")[0].split(":")[0]] += int(count)
        total.update(dict.fromkeys((f for f in frames if not f.startswith("tracetrain_cli/_main.py")), int(count)))
    samples = sum(own.values())
    if not samples:
        return "py-spy recorded no samples"

    def rows(counter: Counter[str], keep: int, prefix: str = "") -> list[str]:
        picked = [(k, v) for k, v in counter.most_common() if k.startswith(prefix)][:keep]
        return [f"    {100 * v / samples:5.1f}%  {k}" for k, v in picked]

    held = 100 * samples / (PROFILE_RATE_HZ * seconds)
    lines = [f"py-spy --gil, {PROFILE_RATE_HZ} Hz, {seconds} s: {samples} samples (GIL held {held:.0f}% of the time)"]
    lines += ["  by thread (% of samples):", *rows(threads, 5)]
    lines += ["  own time, top functions:", *rows(own, top)]
    lines += ["  total time, tracetrain's functions (proxy/):", *rows(total, top, "proxy/")]
    lines += ["  own time by package:", *rows(packages, 12)]
    return "\n".join(lines)


# ------------------------------------------------------------------ report


@dataclass(slots=True)
class Results:
    info: dict[str, Any]
    cells: list[Cell]
    ttfb: dict[str, Ttfb]
    records: Records | None
    profile: str | None

    def find(self, target: str, mode: str, c: int) -> WrkResult | None:
        return next((x.result for x in self.cells if (x.target, x.mode, x.concurrency) == (target, mode, c)), None)

    def added(self, target: str, mode: str, c: int, percentile: str) -> float | None:
        """A target's latency percentile (``p50_ms``, ``p99_ms``) minus the direct one."""
        mine, direct = self.find(target, mode, c), self.find("direct", mode, c)
        return getattr(mine, percentile) - getattr(direct, percentile) if mine and direct else None

    def ratio(self, mode: str, c: int) -> float | None:
        """tracetrain's requests/s over LiteLLM's."""
        tt, ll = self.find("tracetrain", mode, c), self.find("litellm", mode, c)
        return tt.rps / ll.rps if tt and ll and ll.rps else None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


SUMMARY_HEAD = "mode|conc|direct req/s|tracetrain req/s|litellm req/s|tracetrain/litellm|tt +p50 ms|tt +p99 ms|"
SUMMARY_HEAD += "litellm +p50 ms|litellm +p99 ms"


def summary_rows(res: Results, opts: Options) -> list[list[str]]:
    """Per (mode, concurrency): req/s of each target, the ratio, added p50/p99 of each proxy."""
    rows = []
    for mode in MODES:
        for c in opts.concurrency:
            rps = [_fmt(r.rps if (r := res.find(t, mode, c)) else None, ".0f") for t in TARGETS]
            ratio = res.ratio(mode, c)
            added = [_fmt(res.added(t, mode, c, p), "+.2f") for t in TARGETS[1:] for p in ("p50_ms", "p99_ms")]
            rows.append([mode, str(c), *rps, f"{ratio:.1f}x" if ratio else "n/a", *added])
    return rows


DETAIL_HEAD = "mode|conc|target|req/s|p50 ms|p99 ms|answered/sent|CPUs busy|CPU ms/req|wrk errors"


def detail_rows(res: Results) -> list[list[str]]:
    """Absolute numbers per run, with the CPU the processes used and any error wrk saw."""
    rows = []
    for x in res.cells:
        r = x.result
        errors = ", ".join(f"{k} {v}" for k, v in r.errors.items() if v) or "-"
        cpus = " ".join(f"{k} {v:.2f}" for k, v in x.cpus.items())
        cpu_ms = 1000 * x.cpus[x.target] / r.rps if r.completed else None
        row = [f"{r.rps:.0f}", f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}", f"{r.completed}/{r.sent}", cpus]
        rows.append([x.mode, str(x.concurrency), x.target, *row, _fmt(cpu_ms, ".2f"), errors])
    return rows


def text_table(head: str, rows: Sequence[Sequence[str]]) -> str:
    names = head.split("|")
    widths = [max(len(n), *(len(r[i]) for r in rows)) for i, n in enumerate(names)]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in [names, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def markdown_table(head: str, rows: Sequence[Sequence[str]]) -> str:
    names = head.split("|")
    return "\n".join([f"| {' | '.join(names)} |", "|" + "---:|" * len(names), *(f"| {' | '.join(r)} |" for r in rows)])


def verdicts(res: Results, opts: Options) -> list[str]:
    """The issue's targets, each met or not, with its numbers."""

    def line(ok: bool, text: str) -> str:
        return f"{'met    ' if ok else 'NOT MET'}  {text}"

    out, top = [], max(opts.concurrency)
    ratios = {m: res.ratio(m, top) for m in MODES}
    if all(ratios.values()):
        shown = ", ".join(f"{m} {r:.1f}x" for m, r in ratios.items())
        worst = min(r or 0 for r in ratios.values())
        out.append(line(worst >= 5, f"req/s >= 5x LiteLLM's at c={top} (aim 10x): {shown}"))
    added = {m: res.added("tracetrain", m, 1, "p50_ms") for m in MODES}
    if all(a is not None for a in added.values()):
        shown = ", ".join(f"{m} {a:+.2f} ms" for m, a in added.items())
        out.append(line(max(a or 0 for a in added.values()) <= 1, f"added p50 <= 1 ms at c=1: {shown}"))
    if "tracetrain" in res.ttfb and "direct" in res.ttfb:
        d50 = res.ttfb["tracetrain"].p50_ms - res.ttfb["direct"].p50_ms
        d99 = res.ttfb["tracetrain"].p99_ms - res.ttfb["direct"].p99_ms
        out.append(line(d50 <= 1, f"first streamed byte delayed <= 1 ms: p50 {d50:+.2f} ms (p99 {d99:+.2f} ms)"))
    if res.records is not None:
        shown = f"{res.records.stored} stored / {res.records.completed} answered"
        out.append(line(res.records.ok, f"every request is in the store: {shown}"))
    return out


def ttfb_rows(res: Results) -> list[list[str]]:
    direct = res.ttfb.get("direct")
    rows = []
    for name, t in res.ttfb.items():
        added = [t.p50_ms - direct.p50_ms, t.p99_ms - direct.p99_ms] if direct else [None, None]
        rows.append([name, str(t.n), f"{t.p50_ms:.2f}", f"{t.p99_ms:.2f}", *(_fmt(a, "+.2f") for a in added)])
    return rows


TTFB_HEAD = "target|n|TTFB p50 ms|TTFB p99 ms|added p50 ms|added p99 ms"


def print_report(res: Results, opts: Options) -> None:
    info = res.info
    where = f"{info['cpus']} CPUs ({info['cpu_model']}), {info['wrk']}, {opts.duration_s} s per cell"
    print(f"\n# tracetrain proxy overhead: {info['date']}, {where}")
    for note in info["notes"]:
        print(f"note: {note}")
    print("\n" + text_table(SUMMARY_HEAD, summary_rows(res, opts)))
    print("\nper run (CPUs busy: the target, the upstream behind a proxy, wrk, everything else):")
    print(text_table(DETAIL_HEAD, detail_rows(res)))
    bad = [f"{x.target} {x.mode} c={x.concurrency}: {x.result.errors}" for x in res.cells if x.result.error_count]
    print("\nERRORS: " + "; ".join(bad) if bad else "\nwrk errors: none (no socket error, no non-2xx answer)")
    if res.ttfb:
        print("\ntime to first streamed byte (concurrency 1, one keep-alive connection):")
        print(text_table(TTFB_HEAD, ttfb_rows(res)))
    if res.records is not None:
        r = res.records
        abandoned = f"{r.sent} written, counting those wrk abandoned in flight when it stopped"
        print(f"\nrecords: {r.stored} stored / {r.completed} sent (answered requests; {abandoned})")
        for short in r.short:
            print(f"MISSING: {short}")
    print("\nverdicts:\n" + "\n".join(f"  {v}" for v in verdicts(res, opts)))
    print("\nMarkdown (for docs/BENCHMARKS.md):\n")
    print(markdown_table(SUMMARY_HEAD, summary_rows(res, opts)))
    if res.ttfb:
        print("\n" + markdown_table(TTFB_HEAD, ttfb_rows(res)))
    if res.profile:
        print("\n" + res.profile)


def machine_info(opts: Options, notes: Sequence[str]) -> dict[str, Any]:
    wrk = subprocess.run(["wrk", "-v"], capture_output=True, text=True, check=False).stdout.split(" [")[0]
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu_model = next((x.split(":", 1)[1].strip() for x in cpuinfo if x.startswith("model name")), "?")
    versions = {}
    for dist in ("tracetrain", "litellm", "uvicorn", "fastapi", "httpx"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    machine = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpus": os.cpu_count(), "cpu_model": cpu_model}
    return machine | {"python": platform.python_version(), "wrk": wrk, "versions": versions, "notes": list(notes)}


def write_json(path: Path, res: Results, opts: Options) -> None:
    records = {**asdict(res.records), "ok": res.records.ok} if res.records else None
    ttfb = {k: asdict(v) for k, v in res.ttfb.items()}
    doc: dict[str, Any] = {
        "meta": res.info,
        "cells": [{**asdict(x), "rps": x.result.rps} for x in res.cells],
        "ttfb": ttfb,
    }
    doc |= {"records": records, "verdicts": verdicts(res, opts), "profile": res.profile}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


# ------------------------------------------------------------------ main


def measure_all_ttfb(bench: Bench) -> dict[str, Ttfb]:
    """Time to first streamed byte, one quiet target after the other."""
    print("time to first streamed byte ...", file=sys.stderr, flush=True)
    ttfb, sent = {}, TTFB_WARMUP + bench.opts.ttfb_requests
    for name in bench.targets:
        bench.settle()
        tag = f"{bench.run_id}-{name}-ttfb"
        ttfb[name] = measure_ttfb(bench.servers[name], bench.opts.ttfb_requests, tag)
        bench.note(name, tag, sent, sent)
    return ttfb


def run(opts: Options, workdir: Path, stack: contextlib.ExitStack) -> Results:
    """Start the servers, run everything the options ask for, count the records."""
    print(f"starting servers in {workdir} ...", file=sys.stderr, flush=True)
    servers = start_servers(stack, opts.targets, workdir)
    bench = Bench(servers, opts, "bench" + secrets.token_hex(3))
    notes = litellm_setup_notes(servers["litellm"]) if "litellm" in servers else []
    for name, server in servers.items():
        tag = f"{bench.run_id}-{name}-check"
        sent = check_answers(server, tag)
        bench.note(name, tag, sent, sent)
    print("warming up ...", file=sys.stderr, flush=True)
    warm_up(bench)
    cells = run_matrix(bench)
    ttfb = measure_all_ttfb(bench)
    profile = records = None
    if "tracetrain" in servers:
        if opts.profile is not None:
            print("profiling tracetrain under plain c=64 load ...", file=sys.stderr, flush=True)
            profile = profile_tracetrain(bench, opts.profile, opts.duration_s)
        bench.settle()
        records = count_records(workdir / "tracetrain" / "tracetrain.db", bench.batches)
    return Results(machine_info(opts, notes), cells, ttfb, records, profile)


def _exit_on_sigterm(_signum: int, _frame: object) -> None:
    raise SystemExit(143)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_options(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found (Debian: apt-get install wrk)")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # unwinds the ExitStack, which stops the servers
    with tempfile.TemporaryDirectory(prefix="tracetrain-bench-") as tmp, contextlib.ExitStack() as stack:
        res = run(opts, Path(tmp), stack)
    print_report(res, opts)
    if opts.out is not None:
        write_json(opts.out, res, opts)
        print(f"\nJSON: {opts.out}")
    if res.records is not None and not res.records.ok:
        print(f"FAIL: {len(res.records.short)} batch(es) of requests are missing from the store", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
