"""How many modules one streamed call's path enters, in the proxy as ``tracetrain serve`` runs it, per tree.

The proxy (``create_app`` under uvicorn, as ``serve`` configures it) runs in this process on its own
thread, in front of the fake vLLM (``tests/fake_vllm.py``, a process of its own). After warm-up calls,
``threading.setprofile``/``sys.setprofile`` note the source file of every Python function called on the
server's thread while one streamed chat call is sent and read to its end. Background tasks that happen
to run meanwhile would add their modules, so the call is repeated and only the files entered every
time count ("always"); "any" is their union. Each ``--tree NAME=PATH`` runs in its own process with its
sources first on the path. Run from the repository root:

    .venv/bin/python bench/call_modules.py --tree base=/tmp/base-tree --tree this=.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
REPEATS = 5


def _stream_once(conn: http.client.HTTPConnection, n: int) -> None:
    """One streamed chat call on ``conn`` (kept alive, as wrk's are), read to its end."""
    body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    headers = {"Content-Type": "application/json", "X-Trajectory-Id": f"mods-{n}"}
    conn.request("POST", "/v1/chat/completions", json.dumps(body).encode(), headers)
    response = conn.getresponse()
    assert response.status == 200 and response.read().endswith(b"data: [DONE]\n\n")


def _label(filename: str) -> str:
    """A file as a module path: under site-packages, "stdlib/..." for Python's own, else under the tree."""
    path = filename.replace(os.sep, "/")
    if "/site-packages/" in path:
        return path.split("/site-packages/", 1)[1]
    if "/lib/python3" in path:
        return "stdlib/" + path.split("/lib/python3", 1)[1].split("/", 1)[1]
    return path.removeprefix(str(Path.cwd()).replace(os.sep, "/") + "/")


def worker() -> dict[str, Any]:
    import uvicorn
    import uvloop

    from proxy import Settings, create_app
    from tracetrain_cli._http_server import server_config

    sys.path.insert(0, str(REPO / "bench"))
    from _host import free_port, wait_http

    fake_port, port = free_port(), free_port()
    fake = subprocess.Popen([sys.executable, str(REPO / "tests" / "fake_vllm.py"), "--host", "127.0.0.1", "--port",
                             str(fake_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{fake_port}/v1/models", fake)
        with tempfile.TemporaryDirectory() as tmp:
            settings = Settings(upstream=f"http://127.0.0.1:{fake_port}/v1", data_dir=Path(tmp), port=port)
            server = uvicorn.Server(server_config(create_app(settings), settings, log_level="warning"))
            seen: list[set[str]] = []
            current: set[str] = set()

            def hook(frame: FrameType, event: str, _arg: object) -> None:
                if event == "call":
                    current.add(frame.f_code.co_filename)

            def serve() -> None:  # on uvloop, as ``tracetrain serve`` runs it
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    runner.run(server.serve())

            thread = threading.Thread(target=serve, name="proxy")
            thread.start()
            wait_http(f"http://127.0.0.1:{port}/readyz")
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            for n in range(20):
                _stream_once(conn, n)
            time.sleep(0.5)
            loop = _loop_of(server)
            for n in range(REPEATS):
                current = set()
                # The hook is installed on the server's thread from inside its loop, then the call runs.
                loop.call_soon_threadsafe(sys.setprofile, hook)
                time.sleep(0.05)
                _stream_once(conn, 100 + n)
                removed = threading.Event()
                loop.call_soon_threadsafe(_unhook, removed)
                removed.wait(5)
                seen.append({f for f in current if not f.startswith("<") and Path(f).name != Path(__file__).name})
                time.sleep(0.2)
            conn.close()
            server.should_exit = True
            thread.join(30)
    finally:
        fake.terminate()
        fake.wait(10)
    always = set.intersection(*seen)
    every = set.union(*seen)
    by_package = Counter(_label(f).split("/", 1)[0] for f in always)
    return {"always": len(always), "any": len(every), "by_package": dict(by_package.most_common()),
            "modules": sorted(_label(f) for f in always)}  # fmt: skip


def _unhook(removed: threading.Event) -> None:
    sys.setprofile(None)
    removed.set()


def _loop_of(server: Any) -> asyncio.AbstractEventLoop:
    """The running loop of the uvicorn server (its first server socket's)."""
    for _ in range(100):
        servers = getattr(server, "servers", None)
        if servers:
            loop: asyncio.AbstractEventLoop = servers[0].get_loop()
            return loop
        time.sleep(0.05)
    raise RuntimeError("the server never started")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--list", action="store_true", help="print every module entered, per tree")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    results = {}
    for name, path in (tree.split("=", 1) for tree in args.tree):
        root = Path(path).resolve()
        env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'sdk'}"}
        done = subprocess.run([sys.executable, __file__, "--worker", "--tree", f"{name}={root}"], env=env, cwd=root,
                              capture_output=True, text=True, check=True)  # fmt: skip
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"source files (modules) one streamed chat call enters, in all of {REPEATS} calls (in any of them):")
    for name, r in results.items():
        packages = ", ".join(f"{p} {n}" for p, n in r["by_package"].items())
        print(f"  {name}: {r['always']} ({r['any']}); by package: {packages}")
    if args.list:
        for name, r in results.items():
            print(f"\n{name}:\n  " + "\n  ".join(r["modules"]))


if __name__ == "__main__":
    main()
