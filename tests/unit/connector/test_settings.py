import pytest

from connector.settings import ConnectorSettings


def test_defaults():
    s = ConnectorSettings.load({}, env={})
    assert s.protocol == "rdma"
    assert s.expiry_s == 120.0
    assert s.max_segments_per_batch <= 1024


def test_extra_config_beats_env_beats_default():
    env = {"PD_KV_EXPIRY_S": "7", "PD_KV_PROTOCOL": "tcp"}
    s = ConnectorSettings.load({"expiry_s": 3}, env=env)
    assert s.expiry_s == 3.0
    assert s.protocol == "tcp"


def test_types_are_coerced_and_validated():
    s = ConnectorSettings.load({"side_channel_port": "17200", "sender_threads": "1"}, env={})
    assert s.side_channel_port == 17200 and s.sender_threads == 1
    with pytest.raises(ValueError, match="expiry_s"):
        ConnectorSettings.load({"expiry_s": "soon"}, env={})
    with pytest.raises(ValueError, match="must be positive"):
        ConnectorSettings.load({}, env={"PD_KV_EXPIRY_S": "0"})
    with pytest.raises(ValueError, match="max_segments_per_batch"):
        ConnectorSettings.load({"max_segments_per_batch": 5000}, env={})


def test_explicit_host_is_used():
    s = ConnectorSettings.load({"host": "10.1.2.3"}, env={})
    assert s.advertised_host() == "10.1.2.3"
    assert s.side_channel_bind_host() == "10.1.2.3"
    s = ConnectorSettings.load({"host": "10.1.2.3", "bind_host": "0.0.0.0"}, env={})
    assert s.side_channel_bind_host() == "0.0.0.0"


def test_booleans_parse_strictly():
    """bool("false") is True: a naive cast would turn the digest check on by accident."""
    assert ConnectorSettings.load({}, env={"PD_KV_VERIFY_DIGEST": "false"}).verify_digest is False
    assert ConnectorSettings.load({"verify_digest": "on"}, env={}).verify_digest is True
    assert ConnectorSettings.load({"verify_digest": True}, env={}).verify_digest is True
    with pytest.raises(ValueError, match="boolean"):
        ConnectorSettings.load({"verify_digest": "maybe"}, env={})


def test_pull_budget_keeps_the_transfer_timeout_in_reserve():
    s = ConnectorSettings.load({}, env={})
    assert s.pull_budget_s() == 30 - (5 + 1)
    short = ConnectorSettings.load({"pull_timeout_s": 3}, env={})
    assert short.pull_budget_s() == pytest.approx(2.4)


def test_an_environment_value_the_config_overrides_is_warned_about(caplog):
    s = ConnectorSettings.load({"expiry_s": 120}, env={"PD_KV_EXPIRY_S": "30"})
    assert s.expiry_s == 120
    assert "PD_KV_EXPIRY_S=30 is ignored" in caplog.text
    caplog.clear()
    ConnectorSettings.load({"expiry_s": 30}, env={"PD_KV_EXPIRY_S": "30"})
    assert "ignored" not in caplog.text


def test_shipped_lab_configs_pin_no_defaults():
    """A default restated in a config file silently wins over PD_KV_* (issue 11)."""
    import json
    from dataclasses import fields
    from pathlib import Path

    defaults = {f.name: f.default for f in fields(ConnectorSettings)}
    for path in Path(__file__).resolve().parents[3].glob("configs/kv-*.json"):
        extra = json.loads(path.read_text()).get("kv_connector_extra_config", {})
        pinned = [k for k, v in extra.items() if k in defaults and v == defaults[k]]
        assert not pinned, f"{path.name} restates defaults {pinned}"


def test_each_dp_engine_gets_its_own_rank_ports():
    s = ConnectorSettings.load({"side_channel_port": 17100}, env={})
    # DP 2 x TP 4: engine 0 on 17100-17103, engine 1 on 17104-17107; a rank adds tp_rank.
    assert [s.engine_base_port(dp, 4) for dp in range(2)] == [17100, 17104]
    with pytest.raises(ValueError, match="no room"):
        ConnectorSettings.load({"side_channel_port": 65530}, env={}).engine_base_port(1, 8)
