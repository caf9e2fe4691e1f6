"""The proxy's own CPU per captured call, this tree beside an earlier commit, in one invocation.

Two ``tracetrain serve`` processes in front of one fake vLLM (``tests/fake_vllm.py``, asked by each
proxy for token ids and logprobs as vLLM is): one run from a copy of ``--base`` (``git archive``
into a temporary folder), one from this working tree, each with its own sources first on
``PYTHONPATH`` and its own SQLite database. For each API (chat, Responses, Messages) and mode
(plain, streamed) the two proxies take the same ``wrk`` load at ``--concurrency`` (64), one after
the other in an order that alternates, ``--rounds`` times; each cell waits for a quiet machine
first. A cell's figure is the proxy process's CPU time (``/proc/PID/stat``, user + system, every
thread) over the calls it answered. Then each proxy and the fake alone take ``wrk -c1`` (chat,
plain and streamed), interleaved the same way: the proxy's added p50 is its p50 less the fake's.

With ``--floor``, two relays that do none of the proxy's work take the chat cells beside them, in
front of the same fake (``bench/_proxy/floor.py``): a TCP pipe (the sockets' and the loop's cost of a
call) and uvicorn with the proxy's HTTP/1.1 client passing bodies through (the server's and the client's).

The median of the rounds is reported for each side, with the spread (min-max) and the ratio
this/base. Run from the repository root (``wrk`` from Debian):

    .venv/bin/python bench/proxy_cpu.py --base 08d4e8b --rounds 3 --duration 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from _host import free_port, wait_http
from _proxy.servers import BASE_MODEL, HOST, POLICY, REPO, Server, _process, cpu_seconds, settle
from _proxy.wrk import WrkResult, run_wrk

APIS = ("chat", "responses", "messages")
MODES = ("plain", "stream")


def base_tree(commit: str, into: Path) -> Path:
    """``commit``'s files (``git archive``), extracted under ``into``."""
    tree = into / f"base-{commit}"
    tree.mkdir()
    archive = into / "base.tar"
    with archive.open("wb") as sink:
        subprocess.run(["git", "-C", str(REPO), "archive", commit], stdout=sink, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def start(stack: contextlib.ExitStack, name: str, argv: list[str], ready: str, model: str, cwd: Path,
          workdir: Path) -> Server:  # fmt: skip
    """One server from the sources under ``cwd``, answering ``ready`` before this returns."""
    port, log = free_port(HOST), workdir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": f"{cwd}{os.pathsep}{cwd / 'sdk'}"}
    proc = stack.enter_context(_process([*argv, "--host", HOST, "--port", str(port)], log, env, cwd))
    wait_http(f"http://{HOST}:{port}{ready}", proc, log)
    return Server(name, port, model, proc, log)


def proxy(stack: contextlib.ExitStack, name: str, tree: Path, upstream: Server, workdir: Path) -> Server:
    argv = [sys.executable, "-m", "tracetrain_cli", "serve", "--upstream", f"{upstream.url}/v1",
            "--data-dir", str(workdir / name), "--no-train", "--log-level", "warning"]  # fmt: skip
    return start(stack, name, argv, "/readyz", POLICY, tree, workdir)


def floors(stack: contextlib.ExitStack, upstream: Server, workdir: Path) -> dict[str, Server]:
    """The relays of ``bench/_proxy/floor.py`` in front of ``upstream``, sent chat as the proxy forwards it."""
    relays = {}
    for relay in ("pipe", "asgi"):
        argv = [sys.executable, "bench/_proxy/floor.py", relay, "--upstream", f"{HOST}:{upstream.port}"]
        server = start(stack, f"floor-{relay}", argv, "/v1/models", BASE_MODEL, REPO, workdir)
        relays[f"floor: {relay}"] = with_api(server, "chat-as-proxied")
    return relays


def with_api(server: Server, api: str) -> Server:
    return Server(server.name, server.port, server.model, server.proc, server.log, api)


def cpu_per_call(server: Server, mode: str, c: int, seconds: int, tag: str) -> tuple[float, WrkResult]:
    """ms of the server's CPU per answered call under ``wrk -c{c}``."""
    before = cpu_seconds(server.proc.pid)
    result = run_wrk(server, mode, c, seconds, tag)
    used = cpu_seconds(server.proc.pid) - before
    if result.completed == 0 or result.error_count:
        raise SystemExit(f"{server.name} {server.api} {mode}: {result}")
    return used / result.completed * 1000, result


def cpu_cell(cpu: dict[tuple[str, str, str], list[float]], server: Server, name: str, api: str, mode: str,
             round_: int, args: argparse.Namespace) -> None:  # fmt: skip
    """One cell of the table: ``server``'s CPU per call under ``args``' load, kept under (name, api, mode)."""
    tag = f"r{round_}-{server.name}-{api}-{mode}"
    ms, result = cpu_per_call(server, mode, args.concurrency, args.duration, tag)
    cpu.setdefault((name, api, mode), []).append(ms)
    print(f"round {round_ + 1} {api:9} {mode:6} {name:16} {ms:.3f} ms/call {result.rps:7.0f} req/s",
          file=sys.stderr, flush=True)  # fmt: skip


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="08d4e8b", help="the commit to run beside this working tree")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=4, help="seconds of wrk per cell")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--apis", default=",".join(APIS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--no-c1", action="store_true", help="skip the c=1 added-latency cells")
    parser.add_argument("--floor", action="store_true",
                        help="run two relays that do none of the proxy's work beside the chat cells")  # fmt: skip
    args = parser.parse_args(argv)
    apis, modes = args.apis.split(","), args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="tracetrain-cpu-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        trees = {f"base {args.base}": base_tree(args.base, workdir), "this tree": REPO}
        print(f"starting servers in {workdir} ...", file=sys.stderr, flush=True)
        fake = start(stack, "direct", [sys.executable, "tests/fake_vllm.py"], "/v1/models", BASE_MODEL, REPO, workdir)
        proxies = {name: proxy(stack, f"proxy{i}", tree, fake, workdir) for i, (name, tree) in enumerate(trees.items())}
        relays = floors(stack, fake, workdir) if args.floor else {}
        everyone = [fake, *proxies.values(), *relays.values()]
        for server in proxies.values():  # warm-up: every API and mode once
            for api in apis:
                for mode in modes:
                    cpu_per_call(with_api(server, api), mode, 16, 1, f"warm-{server.name}-{api}-{mode}")
        cpu: dict[tuple[str, str, str], list[float]] = {}
        p50: dict[tuple[str, str], list[float]] = {}
        order = list(proxies)
        for round_ in range(args.rounds):
            for api in apis:
                for mode in modes:
                    for name in order:
                        settle(everyone)
                        server = with_api(proxies[name], api)
                        cpu_cell(cpu, server, name, api, mode, round_, args)
                    order.reverse()
            for mode in modes if "chat" in apis else ():
                for name, server in relays.items():
                    settle(everyone)
                    cpu_cell(cpu, server, name, "chat", mode, round_, args)
            if args.no_c1:
                continue
            for mode in modes:
                for name, server in [("direct", fake), *((n, proxies[n]) for n in order)]:
                    settle(everyone)
                    result = run_wrk(server, mode, 1, args.duration, f"c1-r{round_}-{server.name}-{mode}")
                    p50.setdefault((name, mode), []).append(result.p50_ms)
                order.reverse()
        base, this = trees
        print(f"\nproxy CPU ms per captured call, wrk -c{args.concurrency}, median (min-max) of {args.rounds} rounds")
        print(f"| API | mode | {base} | {this} | this/base |")
        print("|---|---|---:|---:|---:|")
        for api in apis:
            for mode in modes:
                old, new = cpu[(base, api, mode)], cpu[(this, api, mode)]
                ratio = statistics.median(new) / statistics.median(old)
                print(f"| {api} | {mode} | {spread(old)} | {spread(new)} | {ratio:.2f} |")
        if relays:
            print("\nchat beside the floor: the relays' CPU ms per call, median (min-max), and the proxy's above the")
            print("uvicorn relay's (what its own work costs)")
            print(f"| mode | {' | '.join(relays)} | {this} | {this} less floor: asgi |")
            print("|---|---:|---:|---:|---:|")
            for mode in modes:
                cells = [spread(cpu[(name, "chat", mode)]) for name in [*relays, this]]
                asgi = statistics.median(cpu[("floor: asgi", "chat", mode)])
                own = statistics.median(cpu[(this, "chat", mode)]) - asgi
                print(f"| {mode} | {' | '.join(cells)} | {own:.3f} |")
        if p50:
            print("\nadded p50 at c=1 (chat), ms: the proxy's p50 less the fake's in the same round, median (min-max)")
            print(f"| mode | fake alone p50 | {base} | {this} |")
            print("|---|---:|---:|---:|")
            for mode in modes:
                direct = p50[("direct", mode)]
                added = {n: [p - d for p, d in zip(p50[(n, mode)], direct, strict=True)] for n in trees}
                print(f"| {mode} | {spread(direct)} | {spread(added[base])} | {spread(added[this])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
