"""Pure logic: API keys, backend credentials, settings from CLI and config files."""

from __future__ import annotations

import pytest

from proxy.auth import backend_headers, client_allowed
from proxy.settings import InstanceSpec, load_config, parse_args


def test_client_keys():
    assert client_allowed({}, [])  # no keys configured: open
    assert client_allowed({"authorization": "Bearer k2"}, ["k1", "k2"])
    assert not client_allowed({"authorization": "Bearer nope"}, ["k1"])
    assert not client_allowed({"authorization": "k1"}, ["k1"])  # scheme required
    assert not client_allowed({}, ["k1"])


def test_backend_credentials_modes():
    h = {"authorization": "Bearer client"}
    assert backend_headers(h, "r")["authorization"] == "Bearer client"
    assert backend_headers(h, "r", "key", "bk")["authorization"] == "Bearer bk"
    assert "authorization" not in backend_headers(h, "r", "none")
    assert backend_headers(h, "r")["x-request-id"] == "r"


def test_cli_keeps_the_old_flags_and_adds_weights():
    s = parse_args(
        [
            "--prefill",
            "http://127.0.0.1:1/",
            "--prefill",
            "http://127.0.0.1:2,weight=2,side_channel=127.0.0.1:17100",
            "--decode",
            "http://127.0.0.1:3",
            "--port",
            "9",
            "--prefill-timeout",
            "7",
            "--idle-timeout",
            "3",
        ]
    )
    assert s.prefill_urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert s.prefill[1] == InstanceSpec("http://127.0.0.1:2", 2.0, "127.0.0.1:17100")
    assert s.port == 9 and s.timeouts.prefill_s == 7 and s.timeouts.idle_s == 3


def test_cli_needs_instances():
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://127.0.0.1:1"])


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_config_files(tmp_path, suffix, monkeypatch):
    text = {
        ".yaml": """
prefill:
  - url: http://127.0.0.1:8100
    weight: 2
    side_channel: 127.0.0.1:17100
decode: [http://127.0.0.1:8200]
prefill_policy: prefix
timeouts: {connect_s: 1, prefill_s: 2, decode_s: 3, idle_s: 4}
health: {interval_s: 1, fall: 3}
""",
        ".toml": """
decode = ["http://127.0.0.1:8200"]
prefill_policy = "prefix"
[[prefill]]
url = "http://127.0.0.1:8100"
weight = 2
side_channel = "127.0.0.1:17100"
[timeouts]
connect_s = 1
prefill_s = 2
decode_s = 3
idle_s = 4
[health]
interval_s = 1
fall = 3
""",
    }[suffix]
    path = tmp_path / f"p{suffix}"
    path.write_text(text)
    monkeypatch.setenv("PD_PROXY_API_KEYS", "a,b")
    s = parse_args(["--config", str(path), "--idle-timeout", "9"])
    assert s.prefill == (InstanceSpec("http://127.0.0.1:8100", 2.0, "127.0.0.1:17100"),)
    assert s.decode_urls == ("http://127.0.0.1:8200",)
    assert s.prefill_policy == "prefix" and s.health.fall == 3
    assert (s.timeouts.connect_s, s.timeouts.prefill_s, s.timeouts.idle_s) == (1, 2, 9)
    assert s.api_keys == ("a", "b")


def test_config_rejects_unknown_keys(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("prefil: []\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_config(path)


def test_shipped_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "configs"
    found = sorted(root.glob("proxy*.yaml")) + sorted(root.glob("proxy*.toml"))
    assert found
    for p in found:
        assert load_config(p)["decode"]


def test_breaker_flags_and_the_deprecated_key(tmp_path):
    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    s = parse_args([*base, "--breaker-gateway-failures", "2", "--max-ejection-percent", "25"])
    assert (s.breaker.gateway_failures, s.breaker.answer_failures) == (2, 5)
    assert s.breaker.max_ejection_percent == 25
    old = tmp_path / "old.yaml"
    old.write_text("breaker: {failures: 4, open_s: 3}\n")
    s = parse_args(["--config", str(old), *base])
    assert (s.breaker.gateway_failures, s.breaker.answer_failures, s.breaker.open_s) == (4, 4, 3)
    # A flag names one threshold: the other keeps what the deprecated key gave it.
    s = parse_args(["--config", str(old), *base, "--breaker-answer-failures", "0"])
    assert (s.breaker.gateway_failures, s.breaker.answer_failures) == (4, 0)
    with pytest.raises(SystemExit):  # argparse's error: the message names the key
        parse_args([*base, "--max-ejection-percent", "150"])
