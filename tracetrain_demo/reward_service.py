"""The demo's reward service: its own process, scoring finished trajectories.

It stands for whatever judges an agent's work in a real deployment (a test suite, a
user's thumbs-up, a checker). The agent reports an ended attempt with
`POST /finished {"trajectory_id": ...}`; the service reads the trajectory back from
the proxy (`GET /v1/trajectories/{id}`), scores the final reply with the task's
checker, and posts the reward with the `tracetrain` SDK (`POST /v1/rewards`). With
`--call-rewards` it also rewards each call the checker can judge on its own (the tool
task's find_hotel calls: 1 when a call named the destination, else 0), addressed by the
call's id, in the same request as the trajectory's reward: a group is trained once its
trajectories are rewarded, so their calls' rewards must be there by then.

    python -m tracetrain_demo.reward_service --proxy http://127.0.0.1:8100 --port 8190
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tracetrain import Client, RewardIn, Trajectory
from tracetrain_demo.tasks import TASKS, Scored

log = logging.getLogger("tracetrain_demo.rewards")


def score_trajectory(trajectory: Trajectory, task: str = "city") -> Scored:
    """Score a captured attempt from what the proxy recorded: its last call's request and reply."""
    return TASKS[task].score_trajectory(trajectory)


class _Handler(BaseHTTPRequestHandler):
    client: Client
    task: str = "city"
    call_rewards: bool = False

    def do_POST(self) -> None:
        if self.path != "/finished":
            self.send_error(HTTPStatus.NOT_FOUND)
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            trajectory = self.client.get_trajectory(str(body["trajectory_id"]))
            result = score_trajectory(trajectory, self.task)
            calls = TASKS[self.task].score_calls if self.call_rewards else None
            self.client.post_rewards([*(RewardIn(trajectory_id=trajectory.id, reward=reward, call_id=call_id)
                                        for call_id, reward in (calls(trajectory) if calls else [])),
                                      RewardIn(trajectory_id=trajectory.id, reward=result.reward,
                                               metrics=result.metrics())])  # fmt: skip
        except Exception as exc:  # one bad report must not stop the service
            log.warning("could not score %r: %s", self.path, exc)
            self.send_error(HTTPStatus.BAD_REQUEST, str(exc)[:200])
            return
        self.send_response(HTTPStatus.NO_CONTENT)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per attempt would drown the demo's output


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tracetrain_demo.reward_service", description=__doc__.split("\n\n")[0])
    p.add_argument("--proxy", required=True, help="the tracetrain server's root URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--port", type=int, default=8190, help="where the agent reports ended attempts (default 8190)")
    p.add_argument("--reward-key", help="the proxy's reward key, if it requires one")
    p.add_argument("--task", choices=sorted(TASKS), default="city", help="the task whose checker scores (default city)")
    p.add_argument("--call-rewards", action="store_true",
                   help="also reward each call the task's checker judges on its own (lookup, agents-sdk: each "
                   "find_hotel call, 1 when it named the destination, else 0), by its call id")  # fmt: skip
    args = p.parse_args(argv)
    if args.call_rewards and TASKS[args.task].score_calls is None:
        p.error(f"--call-rewards: the {args.task} task's checker judges whole attempts only")
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _Handler.client = Client(args.proxy, api_key=args.reward_key)
    _Handler.task = args.task
    _Handler.call_rewards = args.call_rewards
    server = ThreadingHTTPServer(("127.0.0.1", args.port), _Handler)
    log.info("reward service on http://127.0.0.1:%d/finished, posting to %s", args.port, args.proxy)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
