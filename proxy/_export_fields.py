"""Where captured calls are exported besides the store: Langfuse and OpenTelemetry (docs/OBSERVABILITY.md).
``Settings`` inherits these settings; each is declared once here (``proxy._declare``)."""

from __future__ import annotations

import os
from typing import Self

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from proxy._declare import OBSERVABILITY, flag
from proxy._otel_env import endpoint_from_env, traces_url
from store import redact


class ExportFields(BaseModel):
    """Langfuse's and OTLP's settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    # Export trajectories, calls and rewards to Langfuse (proxy.observability._langfuse). The keys and the URL are
    # read from Langfuse's usual variables: LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY, LANGFUSE_BASE_URL
    # (or LANGFUSE_HOST).
    langfuse: bool = Field(default=False, description="also send each trajectory to Langfuse as a trace (calls as "
                           "generations, rewards as scores), in the background; keys from LANGFUSE_PUBLIC_KEY and "
                           "LANGFUSE_SECRET_KEY, server from LANGFUSE_BASE_URL (default https://cloud.langfuse.com)",
                           json_schema_extra=flag("--langfuse", group=OBSERVABILITY))
    langfuse_public_key: str | None = Field(default=None, validation_alias="langfuse_public_key")
    langfuse_secret_key: SecretStr | None = Field(default=None, validation_alias="langfuse_secret_key")
    langfuse_base_url: str = Field(
        default="https://cloud.langfuse.com", validation_alias=AliasChoices("langfuse_base_url", "langfuse_host")
    )
    # Export each call as an OpenTelemetry span (the GenAI semantic conventions) over OTLP/HTTP
    # (proxy.observability._otlp). Unset: the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    # OTEL_EXPORTER_OTLP_ENDPOINT, unless OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER names no otlp.
    otlp_endpoint: str | None = Field(
        default=None, description="also export each captured call as an OpenTelemetry span (GenAI semantic "
        "conventions; a trajectory is a trace, a reward a span with evaluation events) over OTLP/HTTP to this "
        "collector, e.g. http://127.0.0.1:4318 (/v1/traces is appended), in the background. Default: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT when set; headers from "
        "OTEL_EXPORTER_OTLP_HEADERS", json_schema_extra=flag("--otlp-endpoint", "URL", group=OBSERVABILITY,
                                                             url=True))  # fmt: skip
    # Opt-in, as the conventions make them. Langfuse always gets them.
    otlp_content: bool = Field(
        default=False,
        validation_alias=AliasChoices(
            "otlp_content", "tracetrain_otlp_content", "otel_instrumentation_genai_capture_message_content"
        ),
        description="with the OTLP export: put prompts and replies in the spans (gen_ai.input.messages, "
        "gen_ai.output.messages); off by default, as the conventions say (also "
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true)",
        json_schema_extra=flag("--otlp-content", group=OBSERVABILITY),
    )

    @model_validator(mode="before")
    @classmethod
    def _otlp_from_otel_variables(cls, data: object) -> object:
        """No endpoint named: OpenTelemetry's standard variables name it (``proxy._otel_env``)."""
        if not isinstance(data, dict) or data.get("otlp_endpoint") or os.environ.get("TRACETRAIN_OTLP_ENDPOINT"):
            return data
        url = endpoint_from_env()
        return {**data, "otlp_endpoint": url} if url else data

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_traces_url(cls, value: str | None) -> str | None:
        return traces_url(value)

    @model_validator(mode="after")
    def _check_langfuse(self) -> Self:
        if self.langfuse and not (self.langfuse_public_key and self.langfuse_secret_key):
            raise ValueError(
                "--langfuse needs the project's keys: set LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY "
                "(and LANGFUSE_BASE_URL unless the project is on https://cloud.langfuse.com)"
            )
        if self.langfuse and not self.langfuse_base_url.startswith(("http://", "https://")):
            raise ValueError(f"LANGFUSE_BASE_URL must be an http(s) URL, got {redact(self.langfuse_base_url)!r}")
        return self
