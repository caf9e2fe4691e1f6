"""The load runs: a warm-up, then every mode x concurrency with the targets back to back."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field

from _host import machine_busy_seconds

from .options import MODES, TARGETS, TRACETRAIN_APIS, Options
from .probe import TTFB_WARMUP, Ttfb, measure_ttfb
from .servers import Server, children, cpu_seconds, settle
from .wrk import WrkResult, run_wrk


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
        if target in TRACETRAIN_APIS:
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


def own_and_children_cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the wrk runs)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


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
    for name, server in bench.servers.items():
        if name.startswith("upstream") and target in ("tracetrain", "exporting"):
            pids[name] = server.proc.pid
    if target == "exporting" or (bench.opts.observe and target in TRACETRAIN_APIS):
        pids["collector"] = bench.servers["collector"].proc.pid
    # The processes the target started itself: the trace export's (and multiprocessing's resource tracker).
    export = children(bench.servers[target].proc.pid) if target in ("exporting",) else []

    def snapshot() -> dict[str, float]:
        return {
            **{name: cpu_seconds(pid) for name, pid in pids.items()},
            **({"export": sum(cpu_seconds(pid) for pid in export)} if export else {}),
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
