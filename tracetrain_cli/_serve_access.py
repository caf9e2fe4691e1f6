"""``tracetrain serve``'s flags for who may reach it and how: the keys and the admin token, and the front door's
limits (bodies, connections, slow clients, stale seats, /metrics, reverse proxies; docs/OPERATIONS.md).
"""

from __future__ import annotations

import argparse

from tracetrain_cli._models import setting_default


def add_key_flags(p: argparse.ArgumentParser) -> None:
    """Who may call what: inference, reward and adapter keys, the admin token."""
    p.add_argument(
        "--api-keys", metavar="K1,K2", help="inference keys agents must send as Bearer tokens (every policy)"
    )
    p.add_argument(
        "--reward-keys", metavar="K1,K2", help="keys reward services must send to POST /v1/rewards (every policy)"
    )
    p.add_argument(
        "--policy-key",
        action="append",
        default=[],
        metavar="NAME=KEY",
        help="a key bound to policy NAME: it calls that policy's model, reads its trajectories and groups and "
        "posts its rewards, and nothing else (another policy's is a 404); repeatable, one key may be named for "
        "several policies. Prefer TRACETRAIN_POLICY_KEYS=NAME=KEY,... (a flag shows in ps)",
    )
    p.add_argument(
        "--adapter-keys", metavar="K1,K2", help="keys that only read adapter files (what vLLM's resolver sends)"
    )
    p.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="the token of the dashboard (/admin) and the admin API; prefer TRACETRAIN_ADMIN_TOKEN (a flag shows in "
        "ps). Without one, serve makes one and keeps it in DATA_DIR/admin-token",
    )


def add_door_flags(p: argparse.ArgumentParser) -> None:
    """The front door's limits: bodies, connections, slow clients, stale seats, who reads /metrics (OPERATIONS.md)."""
    p.add_argument(
        "--max-body-mb",
        type=float,
        metavar="MB",
        help="a request body longer than this many MB (10^6 bytes) is refused (413) before it is read"
        + setting_default("max_body_mb"),
    )
    p.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="connections and requests served at once; past it a request is answered 503"
        + setting_default("max_connections"),
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        metavar="SECONDS",
        help="a request's line and headers must arrive within this time, or its connection is closed"
        + setting_default("header_timeout_s"),
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        metavar="SECONDS",
        help="a request's body must arrive within this time after its headers, or its connection is closed"
        + setting_default("body_timeout_s"),
    )
    p.add_argument(
        "--seat-timeout",
        type=float,
        metavar="SECONDS",
        help="a new trajectory's seat in a derived group whose call was never recorded (its proxy died) is given "
        "back after this long, so the group is not left waiting; keep it above the longest call"
        + setting_default("seat_timeout_s"),
    )
    p.add_argument(
        "--protect-metrics-and-docs",
        action="store_true",
        default=None,
        help="/metrics, /docs, /redoc and /openapi.json then need 'Authorization: Bearer' with the admin token or a "
        "reward key (default: open, like /healthz)",
    )
    p.add_argument(
        "--forwarded-allow-ips",
        metavar="IPS",
        help="the reverse proxies (addresses or networks, comma-separated, e.g. 172.28.0.0/16) whose "
        "X-Forwarded-For and X-Forwarded-Proto are believed: a request from one of them counts as its client's "
        "(the admin log-in throttle, the Secure cookie). Default: none, not even loopback; env "
        "TRACETRAIN_FORWARDED_ALLOW_IPS (docs/OPERATIONS.md)",
    )
