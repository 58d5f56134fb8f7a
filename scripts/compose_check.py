"""Check the two-node lab's compose files without Docker: schema, interpolation, our rules.

    python -m scripts.compose_check [--env .env] [-f docker-compose.yml -f docker-compose.cpu.yml]

Validates the merged files against the Compose Specification's JSON schema (fetched by
scripts/setup.sh), after interpolating variables the way Compose does, then applies the
lab's own rules: every service has a healthcheck, the proxy waits for healthy instances,
every port a peer dials is published 1:1, the KV path keeps to its own network and address
(the Mooncake engine has no authentication and listens on every interface of its
container), and no secret is written into a file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / ".cache" / "compose-spec" / "compose_spec.json"
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD)", re.I)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class Reset:
    """Compose's ``!reset`` tag: the override removes the base value."""


class ComposeError(ValueError):
    pass


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: Reset())
_Loader.add_constructor(
    "!override",
    lambda loader, node: loader.construct_object(node.__class__(node.tag[1:], node.value)),  # type: ignore[call-arg]
)


def load(path: Path) -> dict[str, Any]:
    doc = yaml.load(path.read_text(), Loader=_Loader)  # a SafeLoader with two Compose tags
    if not isinstance(doc, dict):
        raise ComposeError(f"{path}: not a mapping")
    return doc


def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ComposeError(f"{path}: not KEY=VALUE: {raw!r}")
        env[key.strip()] = value.strip()
    return env


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}, $VAR, $$.

    Defaults may nest (``${A:-${B:-x}}``), so braces are matched, not pattern-searched.
    """
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    out: list[str] = []
    i = 0
    while i < len(value):
        c = value[i]
        if c != "$":
            out.append(c)
            i += 1
            continue
        nxt = value[i + 1 : i + 2]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            depth, j = 1, i + 2
            while j < len(value) and depth:
                depth += {"{": 1, "}": -1}.get(value[j], 0)
                j += 1
            if depth:
                raise ComposeError(f"unclosed ${{ in {value!r}")
            out.append(_substitute(value[i + 2 : j - 1], env))
            i = j
        else:
            m = _NAME.match(value, i + 1)
            if m:
                out.append(env.get(m.group(0), ""))
                i = m.end()
            else:
                out.append("$")
                i += 1
    return "".join(out)


def _substitute(expr: str, env: Mapping[str, str]) -> str:
    m = _NAME.match(expr)
    if not m:
        raise ComposeError(f"bad variable expression ${{{expr}}}")
    name, rest = m.group(0), expr[m.end() :]
    present, val = name in env, env.get(name, "")
    for op in (":-", "-", ":?", "?"):
        if rest.startswith(op):
            arg = rest[len(op) :]
            if op == ":-":
                return val if val else interpolate(arg, env)
            if op == "-":
                return val if present else interpolate(arg, env)
            if not present or (op == ":?" and not val):
                raise ComposeError(f"required variable {name} is missing: {arg}")
            return val
    if rest:
        raise ComposeError(f"bad variable expression ${{{expr}}}")
    return val


def merge(base: Any, over: Any) -> Any:
    """Compose's merge of an override file: mappings merge, sequences and scalars replace."""
    if isinstance(over, Reset):
        return None
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            merged = merge(base.get(k), v)
            if merged is None and isinstance(v, Reset):
                out.pop(k, None)
            else:
                out[k] = merged
        return out
    return over


def strip_extensions(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if not k.startswith("x-")}


def validate_schema(doc: dict[str, Any], schema_path: Path = SCHEMA) -> list[str]:
    from jsonschema import Draft201909Validator

    if not schema_path.exists():
        raise ComposeError(f"no Compose schema at {schema_path}: run scripts/setup.sh")
    schema = json.loads(schema_path.read_text())
    validator = Draft201909Validator(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=str)
    ]


KV_NETWORK = "kv"
# Ports on the KV path, by purpose (see listen_ports): published only on the KV address.
KV_PURPOSES = ("side channel", "mooncake rpc range")


def _port_ranges(spec: str) -> tuple[str, range, range]:
    """(host IP or "" for all interfaces, host ports, container ports) of a short port spec."""
    rest, _, container = spec.rpartition(":")
    ip, _, host = rest.rpartition(":")
    ip = ip.strip("[]")

    def rng(s: str) -> range:
        lo, _, hi = s.split("/")[0].partition("-")
        return range(int(lo), int(hi or lo) + 1)

    return ip, rng(host), rng(container)


def published(service: dict[str, Any]) -> set[int]:
    """Container ports published on the same host port (on any host IP)."""
    out: set[int] = set()
    for spec in service.get("ports") or []:
        _, host, container = _port_ranges(str(spec))
        if host == container:
            out.update(container)
    return out


def service_networks(svc: dict[str, Any]) -> set[str]:
    nets = svc.get("networks")
    if nets is None:
        return {"default"}
    return set(nets)


def _arg(command: list[str], flag: str) -> str | None:
    for i, word in enumerate(command):
        if word == flag and i + 1 < len(command):
            return command[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def listen_ports(name: str, svc: dict[str, Any]) -> dict[str, set[int]]:
    """The ports peers dial on this service, by purpose."""
    cmd = [str(c) for c in svc.get("command") or []]
    env = svc.get("environment") or {}
    need: dict[str, set[int]] = {}
    if name in ("prefill", "decode"):
        need["http"] = {int(cmd[2])}
    if name == "decode":
        # Only the receiver's engine is dialled (the prefiller pushes into it).
        lo, hi = int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"])
        need["mooncake rpc range"] = set(range(lo, hi + 1))
    if name == "prefill":
        need["side channel"] = {int(env["PD_KV_SIDE_CHANNEL_PORT"])}
    if name == "proxy":
        need["http"] = {int(_arg(cmd, "--port") or 0)}
    return need


def check_rules(doc: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    services = doc.get("services") or {}
    for want in ("prefill", "decode", "proxy"):
        if want not in services:
            problems.append(f"service {want} is missing")
    for name, svc in services.items():
        test = (svc.get("healthcheck") or {}).get("test")
        if not test or svc["healthcheck"].get("disable"):
            problems.append(f"{name}: no healthcheck")
        if svc.get("network_mode") != "host":
            have = published(svc)
            for purpose, ports in listen_ports(name, svc).items():
                if not ports <= have:
                    problems.append(
                        f"{name}: {purpose} port(s) {sorted(ports - have)} not published 1:1"
                    )
        for key, value in (svc.get("environment") or {}).items():
            if SECRET_NAME.search(key) and value not in ("", None):
                problems.append(f"{name}: secret {key} has a value written in the file")
    problems += check_kv_boundary(doc)
    deps = (services.get("proxy") or {}).get("depends_on") or {}
    if isinstance(deps, list):  # the short form only waits for the container to start
        deps = {d: {"condition": "service_started"} for d in deps}
    for inst in ("prefill", "decode"):
        if (deps.get(inst) or {}).get("condition") != "service_healthy":
            problems.append(f"proxy: does not wait for {inst} to be healthy")
    return problems


def engine_ports(svc: dict[str, Any]) -> set[int]:
    env = svc.get("environment") or {}
    try:
        return set(range(int(env["MC_MIN_RPC_PORT"]), int(env["MC_MAX_RPC_PORT"]) + 1))
    except (KeyError, ValueError):
        return set()


def check_kv_boundary(doc: dict[str, Any]) -> list[str]:
    """The KV path's trust boundary.

    The Mooncake engine serves reads and writes of the KV cache to anyone who connects and
    listens on every interface of its container, so: prefill and decode share a "kv"
    network the proxy is not on, and every KV-path port (side channel, engine ports) is
    published only on the instance's KV address (PD_KV_HOST), never on all interfaces.
    Host networking (the RDMA override) leaves this to the host firewall.
    """
    problems: list[str] = []
    services = doc.get("services") or {}
    host_net = {n for n, s in services.items() if s.get("network_mode") == "host"}
    for name in host_net:
        if services[name].get("networks"):
            problems.append(f"{name}: network_mode host cannot be combined with networks")
    bridged = [n for n in ("prefill", "decode") if n in services and n not in host_net]
    if bridged and KV_NETWORK not in (doc.get("networks") or {}):
        problems.append(f'no "{KV_NETWORK}" network declared for the KV path')
    for name in bridged:
        if KV_NETWORK not in service_networks(services[name]):
            problems.append(f'{name}: not on the "{KV_NETWORK}" network')
    proxy = services.get("proxy")
    if proxy is not None and "proxy" not in host_net and KV_NETWORK in service_networks(proxy):
        problems.append(f'proxy: must not join the "{KV_NETWORK}" network')
    for name in bridged:
        svc = services[name]
        kv_host = str((svc.get("environment") or {}).get("PD_KV_HOST", ""))
        kv_ports = set(engine_ports(svc))
        for purpose, ports in listen_ports(name, svc).items():
            if purpose in KV_PURPOSES:
                kv_ports |= ports
        wrong: set[int] = set()
        where: set[str] = set()
        for spec in svc.get("ports") or []:
            ip, _, container = _port_ranges(str(spec))
            if kv_ports & set(container) and ip != kv_host:
                wrong.update(container)  # the whole published range, e.g. every TP rank
                where.add(ip or "all interfaces")
        if wrong:
            problems.append(
                f"{name}: KV-path port(s) {_ranges(sorted(wrong))} published on "
                f"{', '.join(sorted(where))}, not only on its KV address "
                f"{kv_host or '(PD_KV_HOST unset)'}"
            )
    return problems


def _ranges(ports: list[int]) -> str:
    """[15100, 15101, 15102, 17100] -> '15100-15102,17100'."""
    runs: list[list[int]] = []
    for p in sorted(ports):
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def secrets_in_raw(raw: dict[str, Any]) -> list[str]:
    """Secret-named variables must come from the environment, never a literal or default."""
    problems: list[str] = []
    for name, svc in (raw.get("services") or {}).items():
        env = svc.get("environment") or {}
        for key, value in env.items():
            if SECRET_NAME.search(key) and value not in (None, ""):
                m = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:?-)?\}", str(value))
                if not m:
                    problems.append(f"{name}: secret {key} is not a plain ${{VAR}} reference")
    return problems


def secrets_in_env_file(env: Mapping[str, str]) -> list[str]:
    return [
        f".env: secret {k} is assigned a value"
        for k, v in env.items()
        if SECRET_NAME.search(k) and v
    ]


def check_docs(
    raws: list[dict[str, Any]], env: Mapping[str, str], schema_path: Path = SCHEMA
) -> list[str]:
    """All problems of these compose documents (base first, then overrides) with this env."""
    problems: list[str] = []
    for i, raw in enumerate(raws):
        problems += [f"file {i + 1}: {p}" for p in secrets_in_raw(raw)]
    merged: Any = {}
    for raw in raws:
        merged = merge(merged, raw)
    doc = interpolate(strip_extensions(merged), env)
    problems += validate_schema(doc, schema_path)
    problems += check_rules(doc)
    problems += secrets_in_env_file(env)
    return problems


def check(files: list[Path], env: Mapping[str, str], schema_path: Path = SCHEMA) -> list[str]:
    return check_docs([load(f) for f in files], env, schema_path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-f", "--file", action="append", type=Path, dest="files")
    ap.add_argument("--env", type=Path, default=ROOT / ".env.example")
    args = ap.parse_args(argv)
    files = args.files or [ROOT / "docker-compose.yml"]
    try:
        problems = check(files, read_env_file(args.env))
    except ComposeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s) in {', '.join(f.name for f in files)} with {args.env.name}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
