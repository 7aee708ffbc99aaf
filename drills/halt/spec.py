"""``halt:`` in a scenario: the blast radius a drill may not exceed. Each list item names one kind:

```yaml
halt:
  - error_rate: {max: 0.5, window_requests: 4}          # or window: 30s
  - ttft: {percentile: 95, max: 20s, min_samples: 4}
  - metric: {service: cache, name: lmcache_mp_l1_usage_bytes, op: ">", threshold: 2e9}
  - http: {url: "{lmcache}/health", status: 200, timeout: 2s, failures: 3}
```

A breach stops the drill with verdict ABORTED and the reason ``halted: <condition>: observed X > threshold Y``.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from drills.durations import Duration

Op = Literal[">", "<", ">=", "<="]
# the run's own services an http condition may name as {service}; which exist depends on the stack
SERVICE_PLACEHOLDER = re.compile(r"^\{([a-z][a-z0-9-]*)\}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorRate(_Strict):
    """Fraction of failed engine requests (HTTP errors, refused connections, past their deadline)."""

    max: float = Field(ge=0, lt=1, description="halt when the failed fraction is above this")
    window_requests: int | None = Field(None, ge=1, le=1000, description="over the last N chaos responses")
    window: Duration | None = Field(None, description="or over the responses of the last N seconds")
    min_requests: int | None = Field(
        None, ge=1, description="responses needed before judging; default: the whole window_requests, or 1 "
                                "for a time window")

    @model_validator(mode="after")
    def _one_window(self) -> ErrorRate:
        if (self.window_requests is None) == (self.window is None):
            raise ValueError("give exactly one of window_requests (a count) and window (a duration)")
        return self

    @property
    def needed(self) -> int:
        return self.min_requests or self.window_requests or 1


class Ttft(_Strict):
    """A percentile of the time to first token of answered chaos requests (failed ones have none: use
    error_rate for them)."""

    percentile: int = Field(95, ge=1, le=100, description="1-99, or 100 for the slowest")
    max: Duration = Field(description="halt when the percentile is above this")
    min_samples: int = Field(4, ge=1, description="answered requests needed before judging")
    window_requests: int | None = Field(None, ge=1, description="only the last N answered requests")


class Metric(_Strict):
    """A Prometheus series scraped live from a service of the stack (summed over matching label sets)."""

    service: Literal["engine", "cache"] = Field(description="engine: vLLM's /metrics; cache: LMCache's (the "
                                                           "Mooncake master's on sandbox-mooncake)")
    name: str = Field(min_length=1, description="sample name as exported, e.g. vllm:num_requests_waiting")
    labels: dict[str, str] = Field(default_factory=dict, description="only series carrying these labels")
    op: Op = Field(description="halt when `observed <op> threshold`")
    threshold: float
    interval: Duration = Field(1.0, description="scrape period")


class HttpProbe(_Strict):
    """A GET that must keep answering: a URL the isolation rules allow (loopback unless the scenario's
    targets.hosts and --allow-target both name its host), or {service}/path for the run's own services."""

    url: str = Field(description="http://127.0.0.1:PORT/path, or {engine}/health, {lmcache}/..., {baseline}/...")
    status: int = Field(200, ge=100, le=599, description="the status a healthy answer has")
    timeout: Duration = 2.0
    failures: int = Field(3, ge=1, description="halt after this many failed probes in a row")
    interval: Duration = Field(1.0, description="probe period")

    @field_validator("url")
    @classmethod
    def _loopback_or_own(cls, v: str) -> str:
        if SERVICE_PLACEHOLDER.match(v):
            check_service_url(v)
            return v
        check_http_url(v)
        return v


def check_http_url(url: str) -> SplitResult:
    """A probe URL must be an http(s) URL with a host and nothing that changes where it goes: no
    userinfo (``http://127.0.0.1:8000@10.0.0.5/`` goes to 10.0.0.5), a valid port, no whitespace or
    control characters (which clients strip or split on). Whether kvdrill may contact that host is the
    isolation policy's call at preflight, the same rule as for every other target."""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValueError(f"{url!r} holds whitespace or a control character; expected a plain URL")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL (or {{engine}}/path, {{lmcache}}/path, ... for the "
                         "run's own services)")
    if "@" in parts.netloc:
        raise ValueError(f"{url!r} carries userinfo ('user@'): refused, it can send the request to another host "
                         "than the one it seems to name")
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    return parts


# what a {service} placeholder stands for when its URL is checked: the run's own service on loopback
_SERVICE_BASE = "http://127.0.0.1:1"


def check_service_url(url: str) -> None:
    """``{service}`` must be followed by a path (or nothing): ``{engine}@10.0.0.5/x`` would make the
    service's host:port the userinfo of a request to 10.0.0.5. Checked as the URL it becomes."""
    m = SERVICE_PLACEHOLDER.match(url)
    assert m is not None
    rest = url[m.end():]
    if rest and rest[0] not in "/?":
        raise ValueError(f"{url!r}: after {{{m.group(1)}}} comes a path ('/...') or nothing, not {rest[:1]!r}")
    if check_http_url(_SERVICE_BASE + rest).hostname != "127.0.0.1":
        raise ValueError(f"{url!r} does not stay on the service {{{m.group(1)}}}")


class HaltCondition(_Strict):
    """One condition: exactly one of the keys below."""

    name: str | None = Field(None, description="how the reason names it (default: its kind and target)")
    error_rate: ErrorRate | None = None
    ttft: Ttft | None = None
    metric: Metric | None = None
    http: HttpProbe | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> HaltCondition:
        given = [k for k in ("error_rate", "ttft", "metric", "http") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a halt condition has exactly one of error_rate, ttft, metric, http (got "
                             f"{', '.join(given) or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("error_rate", "ttft", "metric", "http") if getattr(self, k) is not None)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.ttft is not None:
            return f"ttft p{self.ttft.percentile}"
        if self.metric is not None:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(self.metric.labels.items()))
            return f"metric {self.metric.service} {self.metric.name}" + (f"{{{labels}}}" if labels else "")
        if self.http is not None:
            return f"http GET {self.http.url}"
        return "error_rate"
