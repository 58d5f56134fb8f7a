"""The two-node lab's compose file: parses, and the proxy waits for healthy instances."""

from pathlib import Path

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"


def test_services_have_healthchecks_and_proxy_waits_for_them():
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert set(services) == {"prefill", "decode", "proxy"}
    for name, svc in services.items():
        assert svc["healthcheck"]["test"][0] == "CMD", name
    deps = services["proxy"]["depends_on"]
    assert deps == {
        "prefill": {"condition": "service_healthy"},
        "decode": {"condition": "service_healthy"},
    }


def test_instances_load_our_connector_by_module_path():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        cmd = services[name]["command"]
        assert '"kv_connector_module_path":"connector.connector"' in cmd
        assert f'"kv_role":"{role}"' in cmd
