"""The two-node lab's compose files against the Compose schema and our rules (no Docker)."""

from __future__ import annotations

import copy

import pytest

from scripts.compose_check import (
    ROOT,
    ComposeError,
    Reset,
    check,
    check_docs,
    interpolate,
    load,
    merge,
    read_env_file,
)

ENV = read_env_file(ROOT / ".env.example")
BASE = load(ROOT / "docker-compose.yml")


@pytest.mark.parametrize(
    "overrides",
    [[], ["docker-compose.cpu.yml"], ["docker-compose.rdma.yml"]],
    ids=["gpu", "cpu", "rdma"],
)
def test_lab_files_are_valid(overrides):
    files = [ROOT / "docker-compose.yml", *(ROOT / o for o in overrides)]
    assert check(files, ENV) == []


def problems_after(mutate) -> list[str]:
    doc = copy.deepcopy(BASE)
    mutate(doc)
    return check_docs([doc], ENV)


def test_schema_catches_a_misspelt_key():
    def mutate(doc):
        doc["services"]["proxy"]["healthchek"] = doc["services"]["proxy"].pop("healthcheck")

    problems = problems_after(mutate)
    assert any("healthchek" in p for p in problems)  # from the schema
    assert "proxy: no healthcheck" in problems  # from our rule


def test_schema_catches_a_wrong_type():
    problems = problems_after(lambda d: d["services"]["decode"].update(shm_size=["big"]))
    assert any(p.startswith("services/decode/shm_size") for p in problems)


def test_unpublished_side_channel_is_flagged():
    def mutate(doc):
        doc["services"]["prefill"]["ports"] = doc["services"]["prefill"]["ports"][:1]
        doc["services"]["decode"]["ports"] = doc["services"]["decode"]["ports"][:1]

    problems = problems_after(mutate)
    assert any("prefill: side channel port(s) [17100] not published" in p for p in problems)
    assert any("decode: mooncake rpc range" in p for p in problems)
    # Nothing dials the pushing side's engine: the prefiller need not publish it.
    assert not any("prefill: mooncake rpc range" in p for p in problems)


def test_kv_network_joins_prefill_and_decode_only():
    def mutate(doc):
        doc["services"]["proxy"]["networks"] = ["front", "kv"]
        doc["services"]["decode"]["networks"] = ["front"]

    problems = problems_after(mutate)
    assert 'proxy: must not join the "kv" network' in problems
    assert 'decode: not on the "kv" network' in problems
    no_net = copy.deepcopy(BASE)
    del no_net["networks"]["kv"]
    assert 'no "kv" network declared for the KV path' in check_docs([no_net], ENV)


@pytest.mark.parametrize(
    ("service", "index", "spec", "flagged"),
    [
        # The engine's range on all interfaces: the front network reaches the KV cache.
        ("decode", 1, "15100-15131:15100-15131", "15100-15131 published on all interfaces"),
        # On an address that is not the KV address (here the front address).
        ("decode", 1, "192.0.2.20:15100-15131:15100-15131", "published on 192.0.2.20"),
        # The whole side-channel range counts, not only its first port.
        ("prefill", 1, "17100-17107:17100-17107", "17100-17107 published on all interfaces"),
        # Publishing the prefiller's engine ports at all must be on its KV address.
        ("prefill", None, "15100-15131:15100-15131", "prefill: KV-path port(s) 15100-15131"),
    ],
)
def test_kv_path_ports_are_published_only_on_the_kv_address(service, index, spec, flagged):
    def mutate(doc):
        ports = doc["services"][service]["ports"]
        if index is None:
            ports.append(spec)
        else:
            ports[index] = spec

    problems = problems_after(mutate)
    assert any(p.startswith(f"{service}: KV-path port(s)") and flagged in p for p in problems), (
        problems
    )


def test_kv_rule_passes_on_the_kv_address_and_leaves_host_networking_to_the_firewall():
    assert check_docs([BASE], ENV) == []
    rdma = load(ROOT / "docker-compose.rdma.yml")
    assert check_docs([BASE, rdma], ENV) == []
    # Host networking with compose networks left in place is an error Compose would raise.
    rdma_kept = copy.deepcopy(rdma)
    del rdma_kept["services"]["decode"]["networks"]
    problems = check_docs([BASE, rdma_kept], ENV)
    assert "decode: network_mode host cannot be combined with networks" in problems


def test_remapped_port_is_not_enough():
    # Peers dial the advertised host on the same port: 18100->8100 would not be reachable.
    problems = problems_after(
        lambda d: d["services"]["decode"]["ports"].__setitem__(0, "18200:8200")
    )
    assert any("decode: http port(s) [8200] not published" in p for p in problems)


def test_proxy_must_wait_for_healthy_instances():
    problems = problems_after(
        lambda d: d["services"]["proxy"].__setitem__("depends_on", ["prefill", "decode"])
    )
    assert "proxy: does not wait for prefill to be healthy" in problems


@pytest.mark.parametrize("value", ["sk-123", "${VLLM_API_KEY:-sk-123}"])
def test_secret_written_in_the_file_is_flagged(value):
    problems = problems_after(
        lambda d: d["services"]["prefill"]["environment"].__setitem__("VLLM_API_KEY", value)
    )
    assert any("secret VLLM_API_KEY" in p for p in problems)


def test_secret_in_env_file_is_flagged():
    assert any("HF_TOKEN" in p for p in check_docs([BASE], {**ENV, "HF_TOKEN": "hf_abc"}))


def test_required_address_must_be_set():
    env = {k: v for k, v in ENV.items() if k != "DECODE_HOST"}
    with pytest.raises(ComposeError, match="DECODE_HOST"):
        check_docs([BASE], env)


@pytest.mark.parametrize(
    ("text", "env", "want"),
    [
        ("${A}", {"A": "1"}, "1"),
        ("${A:-d}", {"A": ""}, "d"),
        ("${A-d}", {"A": ""}, ""),
        ("${A-d}", {}, "d"),
        ("$A/$$B", {"A": "x"}, "x/$B"),
        ("${A:-${B:-z}}", {}, "z"),
        ("${A:-${B:-z}}", {"B": "b"}, "b"),
        ("x${A:?need A}", {"A": "a"}, "xa"),
    ],
)
def test_interpolation(text, env, want):
    assert interpolate(text, env) == want


def test_reset_removes_base_value():
    merged = merge({"s": {"ports": ["1:1"], "image": "a"}}, {"s": {"ports": Reset(), "image": "b"}})
    assert merged == {"s": {"image": "b"}}
