"""The proxy's settings: one typed object, built from the command line and a config file.

Precedence: command line > config file (YAML or TOML, ``--config``) > defaults. Secrets
(API keys) may also come from the environment so they never need to sit in a file:
``PD_PROXY_API_KEYS`` (comma separated), ``PD_PROXY_ADMIN_KEY``, ``PD_PROXY_BACKEND_KEY``.
"""

from __future__ import annotations

import argparse
import math
import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix")
BACKEND_AUTH = ("passthrough", "key", "none")
# Weights are relative; the prefix ring holds 64 points per unit of weight, so an unbounded
# weight is an unbounded rebuild (1e9 stalled the event loop for seconds).
MAX_WEIGHT = 100.0
MAX_URL_LEN = 2048


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 5.0
    # The whole prefill leg; long prompts on slow prefillers need minutes.
    prefill_s: float = 300.0
    # Decode leg: until its first body byte (non-streaming: the whole answer).
    decode_s: float = 600.0
    # Streaming: longest silence between two chunks from the decoder.
    idle_s: float = 120.0
    # Waiting for a free connection of an instance's pool (all max_connections busy): past
    # it the request gets 503 "proxy overloaded", which is not the instance's failure.
    pool_wait_s: float = 5.0


@dataclass(frozen=True)
class InstanceSpec:
    url: str
    weight: float = 1.0
    # The prefiller's KV side channel (host:port), informational: the connector advertises
    # the address it really uses in kv_transfer_params.
    side_channel: str | None = None

    def __post_init__(self) -> None:
        # Everything is checked before any pool sees the spec: an admin add either fully
        # happens or changes nothing.
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"instance URL must start with http:// or https://: {self.url!r}")
        if len(self.url) > MAX_URL_LEN or not self.url.isprintable() or " " in self.url:
            raise ValueError(f"instance URL is too long or has control characters: {self.url!r}")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, int | float):
            raise ValueError(f"instance weight must be a number: {w!r}")
        if not (math.isfinite(w) and 0 < w <= MAX_WEIGHT):
            raise ValueError(f"instance weight must be finite, > 0 and <= {MAX_WEIGHT:g}: {w!r}")
        sc = self.side_channel
        if sc is not None and (not isinstance(sc, str) or len(sc) > 256 or not sc.isprintable()):
            raise ValueError(f"side_channel must be a short host:port string: {sc!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        object.__setattr__(self, "weight", float(w))


@dataclass(frozen=True)
class HealthSettings:
    interval_s: float = 5.0
    timeout_s: float = 3.0
    # Consecutive failed checks before an instance is marked down, successes before up.
    fall: int = 2
    rise: int = 1


@dataclass(frozen=True)
class BreakerSettings:
    """Outlier detection per instance (see docs/proxy.md, "Ejection and panic routing").

    Two kinds of failure are counted apart: a gateway failure (connect error, reset,
    timeout) says the instance is sick; a 5xx answer may be the request's own fault (a
    poison request fails the same way everywhere), so it takes more of them, or never
    (0). A 4xx answer is never the instance's failure.
    """

    # Consecutive gateway failures that eject (open) an instance; 0: never.
    gateway_failures: int = 3
    # Consecutive 5xx answers that eject an instance; 0: never.
    answer_failures: int = 5
    # How long an ejected instance stays out before one trial request (half-open) passes.
    open_s: float = 10.0
    # Most of a role's instances ejected at once (%), so a burst of bad requests cannot
    # empty a role; an ejection is also refused when it would leave no healthy instance in.
    max_ejection_percent: float = 50.0
    # Deprecated (the single count before gateway/answer were split): sets both thresholds.
    failures: int | None = None

    def __post_init__(self) -> None:
        if self.failures is not None:
            if (self.gateway_failures, self.answer_failures) != (3, 5):
                raise ValueError(
                    "breaker.failures is deprecated: use gateway_failures and answer_failures"
                )
            object.__setattr__(self, "gateway_failures", self.failures)
            object.__setattr__(self, "answer_failures", self.failures)
        for name in ("gateway_failures", "answer_failures"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"breaker.{name} must be an integer >= 0: {v!r}")
        for name, lo, hi in (("open_s", 0.0, math.inf), ("max_ejection_percent", 0.0, 100.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"breaker.{name} must be a finite number: {v!r}")
            if not (lo <= v <= hi) or (name == "open_s" and v == 0):
                raise ValueError(f"breaker.{name} out of range: {v!r}")


@dataclass(frozen=True)
class ClientLimits:
    """What one client may cost the proxy (see docs/proxy.md, "Hardening")."""

    # Largest request body (413 above it; checked on Content-Length before reading).
    max_body_bytes: int = 16 * 1024 * 1024
    # Bodies larger than this are parsed and rewritten in a worker process: json.loads
    # holds the GIL, so a thread would still stall the event loop (0: always inline).
    offload_parse_bytes: int = 256 * 1024
    parse_workers: int = 1
    # A request's headers must arrive within this (from connection or first byte).
    header_timeout_s: float = 10.0
    # The whole body must arrive within this once the headers are in (408 after).
    body_timeout_s: float = 30.0
    # An idle keep-alive connection is closed after this.
    keepalive_timeout_s: float = 75.0
    # A write to the client blocked this long (the client stopped reading): the client is
    # dropped and the upstream request aborted.
    write_timeout_s: float = 30.0
    # Client connections open at once; more are answered 503 and closed.
    max_connections: int = 2048

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"limits.{f.name} must be a finite number: {v!r}")
            if v < 0 or (v == 0 and f.name not in ("offload_parse_bytes", "parse_workers")):
                raise ValueError(f"limits.{f.name} must be > 0: {v!r}")


@dataclass(frozen=True)
class ProxySettings:
    prefill: tuple[str | InstanceSpec, ...] = ()
    decode: tuple[str | InstanceSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_connections: int = 1024
    log_level: str = "info"
    # Before listening, wait up to this long for every instance's /health (0: don't wait).
    wait_backends_s: float = 0.0
    prefill_policy: str = "least_loaded"
    decode_policy: str = "least_loaded"
    # Prefix affinity: characters (or token ids) of the prompt that form the key, and the
    # load bound (an instance takes at most ceil(factor * average load)).
    prefix_chars: int = 256
    prefix_load_factor: float = 1.25
    # Extra attempts on other instances (0 = no retry).
    prefill_retries: int = 1
    decode_retries: int = 1
    # Prompts estimated shorter than this many tokens skip prefill (0: never).
    min_prefill_tokens: int = 0
    # Prompt length estimate for text (no tokenizer in the proxy): characters per token.
    chars_per_token: float = 4.0
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    backend_auth: str = "passthrough"
    backend_key: str | None = None
    health: HealthSettings = field(default_factory=HealthSettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    limits: ClientLimits = field(default_factory=ClientLimits)
    # Graceful shutdown: how long streams in flight may still run after SIGTERM.
    shutdown_grace_s: float = 30.0
    # Freeing a prefiller's held blocks when a request dies between the legs.
    release_timeout_s: float = 5.0
    # Allow starting with no instance (they come later through the admin API).
    allow_empty: bool = False

    def __post_init__(self) -> None:
        specs = {
            role: tuple(
                s if isinstance(s, InstanceSpec) else InstanceSpec(str(s))
                for s in getattr(self, role)
            )
            for role in ("prefill", "decode")
        }
        object.__setattr__(self, "prefill", specs["prefill"])
        object.__setattr__(self, "decode", specs["decode"])
        if not self.allow_empty and (not self.prefill or not self.decode):
            raise ValueError("at least one --prefill and one --decode URL are required")
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                raise ValueError(f"{name} must be one of {', '.join(POLICIES)}")
        if self.backend_auth not in BACKEND_AUTH:
            raise ValueError(f"backend_auth must be one of {', '.join(BACKEND_AUTH)}")
        if self.backend_auth == "key" and not self.backend_key:
            raise ValueError("backend_auth=key needs a backend key (PD_PROXY_BACKEND_KEY)")

    @property
    def prefill_urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.prefill)  # type: ignore[union-attr]

    @property
    def decode_urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.decode)  # type: ignore[union-attr]


def _instances(items: Any, role: str) -> tuple[InstanceSpec, ...]:
    if items is None:
        return ()
    if not isinstance(items, list):
        raise ValueError(f"config: '{role}' must be a list of URLs or tables")
    out = []
    for it in items:
        if isinstance(it, str):
            out.append(InstanceSpec(it))
        elif isinstance(it, dict):
            out.append(
                InstanceSpec(
                    str(it["url"]),
                    float(it.get("weight", 1.0)),
                    it.get("side_channel"),
                )
            )
        else:
            raise ValueError(f"config: bad {role} entry {it!r}")
    return tuple(out)


def load_config(path: str | Path) -> dict[str, Any]:
    """A config file (``.yaml``/``.yml`` or ``.toml``) as ProxySettings keyword arguments."""
    p = Path(path)
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        raw = yaml.safe_load(text) or {}
    elif p.suffix == ".toml":
        raw = tomllib.loads(text)
    else:
        raise ValueError(f"config file must be .yaml, .yml or .toml: {p}")
    if not isinstance(raw, dict):
        raise ValueError(f"config file {p} must hold a mapping")
    known = {f.name for f in fields(ProxySettings)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"config file {p}: unknown keys {sorted(unknown)}")
    out: dict[str, Any] = dict(raw)
    out["prefill"] = _instances(raw.get("prefill"), "prefill")
    out["decode"] = _instances(raw.get("decode"), "decode")
    for key, cls in (("timeouts", Timeouts), ("health", HealthSettings), ("limits", ClientLimits)):
        if key in raw:
            out[key] = cls(**raw[key])
    if "breaker" in raw:
        out["breaker"] = BreakerSettings(**raw["breaker"])
    if "api_keys" in raw:
        out["api_keys"] = tuple(raw["api_keys"])
    return out


def parse_args(argv: list[str] | None = None) -> ProxySettings:
    ap = argparse.ArgumentParser(
        prog="python -m proxy",
        description="OpenAI-compatible proxy for disaggregated prefill/decode vLLM instances.",
    )
    ap.add_argument("--config", metavar="FILE", help="YAML or TOML settings (see configs/)")
    ap.add_argument(
        "--prefill",
        action="append",
        metavar="URL[,weight=W]",
        help="base URL of a prefill vLLM instance (repeatable)",
    )
    ap.add_argument(
        "--decode",
        action="append",
        metavar="URL[,weight=W]",
        help="base URL of a decode vLLM instance (repeatable)",
    )
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--connect-timeout", type=float)
    ap.add_argument("--prefill-timeout", type=float, help="whole prefill leg (300 s)")
    ap.add_argument(
        "--decode-timeout", type=float, help="decode leg to its first byte, or whole answer"
    )
    ap.add_argument("--idle-timeout", type=float, help="longest silence inside a stream")
    ap.add_argument("--max-connections", type=int, help="upstream connections per instance")
    ap.add_argument(
        "--pool-wait-timeout",
        type=float,
        help="wait for a free upstream connection, then 503 proxy overloaded (5 s)",
    )
    ap.add_argument("--max-body-bytes", type=int, help="largest request body, 413 above (16 MiB)")
    ap.add_argument(
        "--offload-parse-bytes",
        type=int,
        help="bodies above this are parsed in a worker process (256 KiB; 0: never)",
    )
    ap.add_argument("--parse-workers", type=int, help="worker processes for big bodies (1)")
    ap.add_argument("--header-timeout", type=float, help="request headers must arrive in (10 s)")
    ap.add_argument("--body-timeout", type=float, help="request body must arrive in (30 s)")
    ap.add_argument("--keepalive-timeout", type=float, help="idle client connection (75 s)")
    ap.add_argument(
        "--client-write-timeout",
        type=float,
        help="drop a client that does not drain its response for this long (30 s)",
    )
    ap.add_argument(
        "--max-client-connections", type=int, help="client connections at once, 503 above (2048)"
    )
    ap.add_argument("--log-level")
    ap.add_argument(
        "--wait-backends",
        type=float,
        metavar="SECONDS",
        help="before listening, wait until every instance answers /health; exit 1 if not",
    )
    ap.add_argument("--prefill-policy", choices=POLICIES)
    ap.add_argument("--decode-policy", choices=POLICIES)
    ap.add_argument("--prefill-retries", type=int)
    ap.add_argument("--decode-retries", type=int)
    ap.add_argument(
        "--min-prefill-tokens",
        type=int,
        help="prompts estimated shorter than this go to the decoder alone",
    )
    ap.add_argument(
        "--api-key", action="append", help="accepted client key (repeatable; or PD_PROXY_API_KEYS)"
    )
    ap.add_argument("--backend-auth", choices=BACKEND_AUTH)
    ap.add_argument("--health-interval", type=float)
    ap.add_argument(
        "--breaker-gateway-failures",
        type=int,
        help="consecutive connect errors/resets/timeouts that eject an instance (3; 0: never)",
    )
    ap.add_argument(
        "--breaker-answer-failures",
        type=int,
        help="consecutive 5xx answers that eject an instance (5; 0: never)",
    )
    ap.add_argument(
        "--breaker-open-time", type=float, help="seconds an ejected instance stays out (10)"
    )
    ap.add_argument(
        "--max-ejection-percent",
        type=float,
        help="most of a role's instances ejected at once, %% (50; one always stays in)",
    )
    ap.add_argument("--shutdown-grace", type=float)
    ap.add_argument("--allow-empty", action="store_true", default=None)
    a = ap.parse_args(argv)
    try:
        kw: dict[str, Any] = load_config(a.config) if a.config else {}
        if a.prefill:
            kw["prefill"] = tuple(_cli_instance(s) for s in a.prefill)
        if a.decode:
            kw["decode"] = tuple(_cli_instance(s) for s in a.decode)
        simple = {
            "host": a.host,
            "port": a.port,
            "max_connections": a.max_connections,
            "log_level": a.log_level,
            "wait_backends_s": a.wait_backends,
            "prefill_policy": a.prefill_policy,
            "decode_policy": a.decode_policy,
            "prefill_retries": a.prefill_retries,
            "decode_retries": a.decode_retries,
            "min_prefill_tokens": a.min_prefill_tokens,
            "backend_auth": a.backend_auth,
            "shutdown_grace_s": a.shutdown_grace,
            "allow_empty": a.allow_empty,
        }
        kw.update({k: v for k, v in simple.items() if v is not None})
        t = kw.get("timeouts", Timeouts())
        t_over = {
            "connect_s": a.connect_timeout,
            "prefill_s": a.prefill_timeout,
            "decode_s": a.decode_timeout,
            "idle_s": a.idle_timeout,
            "pool_wait_s": a.pool_wait_timeout,
        }
        kw["timeouts"] = replace(t, **{k: v for k, v in t_over.items() if v is not None})
        lim = kw.get("limits", ClientLimits())
        l_over = {
            "max_body_bytes": a.max_body_bytes,
            "offload_parse_bytes": a.offload_parse_bytes,
            "parse_workers": a.parse_workers,
            "header_timeout_s": a.header_timeout,
            "body_timeout_s": a.body_timeout,
            "keepalive_timeout_s": a.keepalive_timeout,
            "write_timeout_s": a.client_write_timeout,
            "max_connections": a.max_client_connections,
        }
        kw["limits"] = replace(lim, **{k: v for k, v in l_over.items() if v is not None})
        br = kw.get("breaker", BreakerSettings())
        b_over = {
            "gateway_failures": a.breaker_gateway_failures,
            "answer_failures": a.breaker_answer_failures,
            "open_s": a.breaker_open_time,
            "max_ejection_percent": a.max_ejection_percent,
        }
        b_over = {k: v for k, v in b_over.items() if v is not None}
        if b_over:
            # Flags name the new thresholds: a deprecated ``failures`` from a file yields.
            fixed = {"gateway_failures": br.gateway_failures, "answer_failures": br.answer_failures}
            kw["breaker"] = replace(br, failures=None, **{**fixed, **b_over})
        if a.health_interval is not None:
            kw["health"] = replace(kw.get("health", HealthSettings()), interval_s=a.health_interval)
        env_keys = [k for k in os.environ.get("PD_PROXY_API_KEYS", "").split(",") if k.strip()]
        keys = [*kw.get("api_keys", ()), *(a.api_key or ()), *env_keys]
        kw["api_keys"] = tuple(k.strip() for k in keys)
        if os.environ.get("PD_PROXY_ADMIN_KEY"):
            kw["admin_key"] = os.environ["PD_PROXY_ADMIN_KEY"]
        if os.environ.get("PD_PROXY_BACKEND_KEY"):
            kw["backend_key"] = os.environ["PD_PROXY_BACKEND_KEY"]
        return ProxySettings(**kw)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        ap.error(str(exc))
        raise  # unreachable: ap.error exits


def _cli_instance(text: str) -> InstanceSpec:
    """``URL`` or ``URL,weight=2,side_channel=host:port``."""
    url, *opts = text.split(",")
    kw: dict[str, Any] = {}
    for o in opts:
        k, _, v = o.partition("=")
        if k == "weight":
            kw["weight"] = float(v)
        elif k == "side_channel":
            kw["side_channel"] = v
        else:
            raise ValueError(f"unknown instance option {k!r} in {text!r}")
    return InstanceSpec(url, **kw)
