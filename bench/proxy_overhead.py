"""What tracetrain's capture costs: the proxy against the upstream itself and against LiteLLM.

Three processes, each a process group of its own: ``direct`` (the fake vLLM of
``tests/fake_vllm.py``), ``tracetrain`` (``tracetrain serve``, capture into SQLite) and
``litellm`` (LiteLLM's proxy, one worker, no database), both proxies in front of that fake.
tracetrain is measured on chat (target ``tracetrain``) and, as targets ``responses`` and
``messages``, on ``/v1/responses`` and ``/v1/messages`` (translated to chat for the same fake).
Per mode ("plain", "stream") and concurrency the targets run back to back under ``wrk``
(``bench/wrk/chat.lua``: a fresh ``X-Trajectory-Id`` per request), each after a warm-up and
a wait for quiet. Time to first streamed byte is probed apart at concurrency 1, and every
request tracetrain answered must then be a row of its ``calls`` table (else exit status 1).
bench/README.md says how to run it and what to keep in mind reading the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Sequence
from pathlib import Path

# bench/ is not a package: Python puts this script's folder first on sys.path, so its helpers
# (bench/_proxy/, bench/_host.py) import as top-level names.
from _proxy.exports import collect
from _proxy.options import TARGETS, Options
from _proxy.probe import check_answers
from _proxy.pyspy import profile_tracetrain
from _proxy.records import count_records, merged
from _proxy.report import Results, machine_info, print_report, write_json
from _proxy.runs import Bench, measure_all_ttfb, run_matrix, warm_up
from _proxy.servers import litellm_setup_notes, start_servers


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
    parser.add_argument(
        "--upstreams", type=int, default=1, help="fake vLLM servers behind tracetrain (2: its router spreads them)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 s cells, concurrency 1,64, 30 TTFB probes")
    parser.add_argument(
        "--observe",
        action="store_true",
        help="tracetrain with --langfuse (a local sink) and /metrics scraped each second",
    )
    args = parser.parse_args(argv)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    if not targets or set(targets) - set(TARGETS):
        parser.error(f"--targets: choose from {','.join(TARGETS)}")
    if args.quick:
        return Options(2, 1, (1, 64), targets, 30, args.out, args.profile, args.upstreams, args.observe)
    concurrency = tuple(int(c) for c in args.concurrency.split(","))
    return Options(
        args.duration,
        args.warmup,
        concurrency,
        targets,
        args.ttfb_requests,
        args.out,
        args.profile,
        args.upstreams,
        args.observe,
    )


def scrape_metrics(url: str, stop: threading.Event, every_s: float = 1.0) -> None:
    """GET ``url`` every ``every_s`` until ``stop`` (``--observe``: what a Prometheus scraping the proxy costs)."""
    while not stop.wait(every_s):
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as response:
            response.read()


def run(opts: Options, workdir: Path, stack: contextlib.ExitStack) -> Results:
    """Start the servers, run everything the options ask for, count the records."""
    print(f"starting servers in {workdir} ...", file=sys.stderr, flush=True)
    servers = start_servers(stack, opts.targets, workdir, opts.upstreams, opts.observe)
    if opts.observe and "tracetrain" in servers:
        stop = threading.Event()
        scraper = threading.Thread(target=scrape_metrics, args=(servers["tracetrain"].url + "/metrics", stop))
        scraper.start()
        stack.callback(scraper.join)
        stack.callback(stop.set)
    bench = Bench(servers, opts, "bench" + secrets.token_hex(3))
    notes = litellm_setup_notes(servers["litellm"]) if "litellm" in servers else []
    for name, server in servers.items():
        if name == "collector":
            continue
        tag = f"{bench.run_id}-{name}-check"
        sent = check_answers(server, tag)
        bench.note(name, tag, sent, sent)
    print("warming up ...", file=sys.stderr, flush=True)
    warm_up(bench)
    cells = run_matrix(bench)
    ttfb = measure_all_ttfb(bench)
    profile = records = exported = None
    if "tracetrain" in servers and opts.profile is not None:  # started for any of its APIs
        print("profiling tracetrain under plain c=64 load ...", file=sys.stderr, flush=True)
        profile = profile_tracetrain(bench, opts.profile, opts.duration_s)
    parts = []
    for process in ("tracetrain", "exporting"):  # each tracetrain process has its database
        if process in servers:
            bench.settle()
            mine = [b for b in bench.batches if (b[0].split("-")[1] == "exporting") == (process == "exporting")]
            parts.append(count_records(workdir / process / "tracetrain.db", mine))
    if parts:
        records = merged(parts)
    if "exporting" in servers:
        exported = collect(servers["collector"], servers["exporting"], parts[-1].stored, parts[-1].completed)
    return Results(machine_info(opts, notes), cells, ttfb, records, profile, exported)


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
