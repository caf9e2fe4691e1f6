"""The settings of the front door and of who may pass it: bodies, connections, slow clients, stale seats, reverse
proxies, and the keys and the admin token (docs/OPERATIONS.md). ``Settings`` inherits them; each is declared once
here (``proxy._declare``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr
from pydantic_settings import NoDecode

from proxy import _setting_values as values
from proxy._declare import DOOR, KEYS, flag

Secrets = Annotated[tuple[SecretStr, ...], NoDecode]


class AccessFields(BaseModel):
    """The front door's limits and the credentials."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The front door (docs/OPERATIONS.md). The server's own limits (connections, header and body timeouts) are
    # tracetrain serve's (tracetrain_cli._http_server).
    max_body_mb: float = Field(default=32.0, gt=0, allow_inf_nan=False, description="a request body longer than "
                               "this many MB (10^6 bytes) is refused (413) before it is read", json_schema_extra=flag(
                                   "--max-body-mb", "MB", group=DOOR))  # fmt: skip
    seat_timeout_s: float = Field(default=900.0, gt=0, allow_inf_nan=False, description="a new trajectory's seat in "
                                  "a derived group whose call was never recorded (its proxy died) is given back after "
                                  "this long, so the group is not left waiting; keep it above the longest call",
                                  json_schema_extra=flag("--seat-timeout", "SECONDS", group=DOOR))
    protect_metrics_and_docs: bool = Field(default=False, description="/metrics, /docs, /redoc and /openapi.json then "
                                           "need 'Authorization: Bearer' with the admin token or a reward key "
                                           "(default: open, like /healthz)", json_schema_extra=flag(
                                               "--protect-metrics-and-docs", group=DOOR))  # fmt: skip
    max_connections: int = Field(default=1024, ge=1, description="connections and requests served at once; past it a "
                                 "request is answered 503", json_schema_extra=flag("--max-connections", "N",
                                                                                   group=DOOR))  # fmt: skip
    header_timeout_s: float = Field(default=15.0, gt=0, allow_inf_nan=False, description="a request's line and "
                                    "headers must arrive within this time, or its connection is closed",
                                    json_schema_extra=flag("--header-timeout", "SECONDS", group=DOOR))
    body_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False, description="a request's body must "
                                  "arrive within this time after its headers, or its connection is closed",
                                  json_schema_extra=flag("--body-timeout", "SECONDS", group=DOOR))
    # The log-in throttle counts per client address (proxy._throttle). Empty: the connection's peer is the client,
    # whatever a header says (uvicorn alone would believe any loopback sender).
    forwarded_allow_ips: Annotated[tuple[str, ...], NoDecode, AfterValidator(values.proxy_addresses)] = Field(
        default=(), description="the reverse proxies (addresses or networks, e.g. 172.28.0.0/16) whose "
        "X-Forwarded-For and X-Forwarded-Proto are believed: a request from one of them counts as its client's (the "
        "admin log-in throttle, the Secure cookie). Default: none, not even loopback (docs/OPERATIONS.md)",
        json_schema_extra=flag("--forwarded-allow-ips", "IPS", group=DOOR))  # fmt: skip

    # Credentials: inference keys authorize /v1 generation calls, reward keys /v1/rewards; both for every policy.
    api_keys: Secrets = Field(default=(), description="inference keys agents must send as Bearer tokens (every "
                              "policy)", json_schema_extra=flag("--api-keys", "K1,K2", group=KEYS, secret=True))
    reward_keys: Secrets = Field(default=(), description="keys reward services must send to POST /v1/rewards (every "
                                 "policy)", json_schema_extra=flag("--reward-keys", "K1,K2", group=KEYS, secret=True))
    # A key named for several policies reaches each of them (proxy._policy_keys).
    policy_keys: Annotated[tuple[tuple[str, SecretStr], ...], NoDecode] = Field(
        default=(), description="a key bound to policy NAME: it calls that policy's model, reads its trajectories and "
        "groups and posts its rewards, and nothing else (another policy's is a 404); repeatable, one key may be "
        "named for several policies. Prefer the environment (a flag shows in ps)",
        json_schema_extra=flag("--policy-key", "NAME=KEY", group=KEYS, secret=True))  # fmt: skip
    admin_token: SecretStr | None = Field(default=None, description="the token of the dashboard (/admin) and the "
                                          "admin API; prefer the environment (a flag shows in ps). Without one, serve "
                                          "makes one and keeps it in DATA_DIR/admin-token", json_schema_extra=flag(
                                              "--admin-token", "TOKEN", group=KEYS, secret=True))  # fmt: skip
    # What vLLM's resolver sends (TRACETRAIN_ADAPTERS_KEY there). The admin token reads them too; without adapter
    # keys it alone does.
    adapter_keys: Secrets = Field(default=(), description="keys that only read adapter files (what vLLM's resolver "
                                  "sends)", json_schema_extra=flag("--adapter-keys", "K1,K2", group=KEYS, secret=True))
