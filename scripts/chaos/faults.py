"""Applying one planned fault to the lab and recording what really happened.

Every fault has a window [start, settle_end]: start is when it was applied, ``back`` when
the process answered again / was thawed / the partition lifted / the instance was re-added,
``end`` = back (or the last intended request's end), ``settle_end`` = end + settle. Signals
go to process groups by PID (our own children only); partitions are nftables tables inside
the lab's namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from typing import Any

import aiohttp

from scripts.chaos import schedule as S
from scripts.chaos.cases import long_case, poison_400
from scripts.chaos.lab import ADMIN_KEY, MC_MAX, MC_MIN, Instance, SoakLab
from scripts.chaos.load import Client, Hangup
from scripts.chaos.monitor import Monitor

Record = dict[str, Any]
# The one body known to make vLLM 0.32 answer 500 (sent to an instance directly: its
# frontend fails on a non-dict kv_transfer_params in vllm_xargs); the proxy strips it.
POISON_500_BODY = {
    "prompt": [5, 6, 7, 8],
    "max_tokens": 4,
    "temperature": 0,
    "vllm_xargs": {"kv_transfer_params": "not-a-dict"},
}


class FaultRunner:
    def __init__(
        self,
        lab: SoakLab,
        client: Client,
        monitor: Monitor,
        clock: Callable[[], float],
        *,
        vocab: int,
        settle_s: float,
        restart_timeout_s: float = 240.0,
        log: Callable[[str], None] = print,
    ) -> None:
        self.lab = lab
        self.client = client
        self.monitor = monitor
        self.clock = clock
        self.vocab = vocab
        self.settle_s = settle_s
        self.restart_timeout_s = restart_timeout_s
        self.log = log
        self.current: str = "-"

    def target(self, f: S.PlannedFault) -> Instance | None:
        if f.role not in ("prefill", "decode"):
            return None
        return self.lab.by_role(f.role)[f.target]

    async def apply(self, f: S.PlannedFault) -> Record:
        inst = self.target(f)
        rec: Record = {
            "type": "fault",
            **f.to_dict(),
            "name": inst.name if inst else None,
            "url": inst.url if inst else None,
            "start": round(self.clock(), 4),
            "back": None,
            "end": None,
            "notes": [],
        }
        self.current = f"{f.kind}" + (f" {inst.name}" if inst else "")
        self.log(f"fault {f.index} {self.current}: start")
        try:
            handler = getattr(self, f"_{f.kind}")
            await handler(f, inst, rec)
        except Exception as exc:  # record it; the invariants will show the consequences
            rec["notes"].append(f"fault runner error: {type(exc).__name__}: {exc}")
            self.log(f"fault {f.index} {self.current}: runner error {exc!r}")
        if rec["end"] is None:
            rec["end"] = round(self.clock(), 4)
        rec["settle_end"] = round(rec["end"] + self.settle_s, 4)
        self.log(
            f"fault {f.index} {self.current}: end after {rec['end'] - rec['start']:.1f}s"
            + (f" ({'; '.join(rec['notes'])})" if rec["notes"] else "")
        )
        self.current = f"{self.current} (settling)"
        return rec

    # -- process faults ------------------------------------------------------------------

    async def _wait_streams(self, timeout_s: float) -> bool:
        """Wait until some stream is mid-way, so a killed decoder breaks one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.client.active_streams < 1 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self.client.active_streams >= 1

    async def _kill(self, inst: Instance, rec: Record, *, mid_stream: bool) -> None:
        if mid_stream:
            streams = await self._wait_streams(10.0)
            rec["notes"].append(f"streams in flight at the kill: {self.client.active_streams}")
            if not streams:
                rec["notes"].append("no stream was mid-way within 10 s")
        rec["start"] = round(self.clock(), 4)
        pid = inst.child.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        proc = inst.child.proc
        assert proc is not None
        await asyncio.to_thread(proc.wait, 30)
        rec["notes"].append(f"SIGKILL pid {pid}")
        await asyncio.sleep(2.0)  # let the proxy and the peers see it gone
        inst.restart()
        rec["notes"].append(f"restarted as pid {inst.child.pid}")
        back = await self._wait_health(inst, self.restart_timeout_s)
        if back is None:
            rec["notes"].append(f"not healthy within {self.restart_timeout_s:g}s")
        rec["back"] = back
        rec["end"] = back

    async def _wait_health(self, inst: Instance, timeout_s: float) -> float | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with aiohttp.ClientSession() as s:
            while loop.time() < deadline:
                if not inst.child.alive():
                    return None
                try:
                    async with asyncio.timeout(2.0), s.get(inst.url + "/health") as r:
                        if r.status == 200:
                            return round(self.clock(), 4)
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass
                await asyncio.sleep(0.25)
        return None

    async def _kill_prefill(self, f: S.PlannedFault, inst: Instance | None, rec: Record) -> None:
        assert inst is not None
        await self._kill(inst, rec, mid_stream=False)

    async def _kill_decode(self, f: S.PlannedFault, inst: Instance | None, rec: Record) -> None:
        assert inst is not None
        await self._kill(inst, rec, mid_stream=True)

    async def _stop(self, f: S.PlannedFault, inst: Instance | None, rec: Record) -> None:
        assert inst is not None
        pid = inst.child.pid
        os.killpg(pid, signal.SIGSTOP)
        rec["start"] = round(self.clock(), 4)
        try:
            await asyncio.sleep(f.hold_s)
        finally:
            os.killpg(pid, signal.SIGCONT)
        rec["back"] = rec["end"] = round(self.clock(), 4)
        rec["notes"].append(f"SIGSTOP/SIGCONT pid {pid} for {f.hold_s:g}s")

    _stop_prefill = _stop
    _stop_decode = _stop

    # -- partitions ----------------------------------------------------------------------

    async def _partition(self, f: S.PlannedFault, rec: Record, ns: str, lo: int, hi: int) -> None:
        net = self.lab.netns
        if net is None:
            rec["notes"].append("skipped: no network namespaces here")
            rec["skipped"] = True
            return
        await asyncio.to_thread(net.block_tcp_ports, ns, lo, hi)
        rec["start"] = round(self.clock(), 4)
        try:
            await asyncio.sleep(f.hold_s)
        finally:
            await asyncio.to_thread(net.unblock, ns)
        rec["back"] = rec["end"] = round(self.clock(), 4)
        rec["notes"].append(f"TCP {lo}-{hi} reset in {ns} for {f.hold_s:g}s")

    async def _block_side_channel(
        self, f: S.PlannedFault, inst: Instance | None, rec: Record
    ) -> None:
        sides = [i.side_channel for i in self.lab.by_role("prefill")]
        ns = self.lab.netns.a if self.lab.netns else ""
        await self._partition(f, rec, ns, min(sides), max(sides))

    async def _block_mooncake(self, f: S.PlannedFault, inst: Instance | None, rec: Record) -> None:
        ns = self.lab.netns.b if self.lab.netns else ""
        await self._partition(f, rec, ns, MC_MIN, MC_MAX)

    # -- client-side faults ----------------------------------------------------------------

    def _disconnects(self) -> dict[str, float]:
        st = self.monitor.proxy or {"counters": {}}
        return {
            k: v for k, v in st["counters"].items() if k.startswith("pd_proxy_client_disconnects")
        }

    async def _hangups(
        self, f: S.PlannedFault, rec: Record, specs: list[tuple[Any, bool, Hangup]]
    ) -> None:
        before = self._disconnects()
        rec["start"] = round(self.clock(), 4)
        tasks = []
        for case, stream, hang in specs:
            body = case.request(self.client.model, stream)
            tasks.append(
                asyncio.create_task(
                    self.client.send(
                        case.path, body, case=case.name, expected=f.kind, hangup=hang, tag=f.kind
                    )
                )
            )
            await asyncio.sleep(0.5)
        done = await asyncio.gather(*tasks)
        rec["end"] = rec["back"] = round(self.clock(), 4)
        await asyncio.sleep(2.5)  # two monitor scrapes
        after = self._disconnects()
        delta = {
            k.split("phase=")[-1].rstrip("}"): v - before.get(k, 0.0)
            for k, v in after.items()
            if v > before.get(k, 0.0)
        }
        rec["phases"] = delta
        rec["notes"].append(
            f"outcomes {[r['outcome'] for r in done]}; proxy saw hang-ups in phases {delta}"
        )

    async def _hangup_before_prefill(self, f: S.PlannedFault, inst: Any, rec: Record) -> None:
        # A new prompt each time: a prefix-cache hit would finish the prefill at once.
        cases = [long_case(self.vocab, 700, 8, seed=1000 * f.index + i) for i in range(3)]
        await self._hangups(f, rec, [(c, False, Hangup(after_s=0.03)) for c in cases])

    async def _hangup_between_legs(self, f: S.PlannedFault, inst: Any, rec: Record) -> None:
        hang = [Hangup(after_s=s) for s in (0.6, 1.0, 1.6)]
        cases = [long_case(self.vocab, 600, 300, seed=1000 * f.index + i) for i in range(3)]
        await self._hangups(f, rec, list(zip(cases, [False] * 3, hang, strict=True)))

    async def _hangup_mid_stream(self, f: S.PlannedFault, inst: Any, rec: Record) -> None:
        case = long_case(self.vocab, 100, 200)
        await self._hangups(f, rec, [(case, True, Hangup(after_chunks=3)) for _ in range(3)])

    async def _poison(self, f: S.PlannedFault, rec: Record, bodies: list[tuple[str, dict]]) -> None:
        rec["start"] = round(self.clock(), 4)
        got = []
        for name, body in bodies:
            r = await self.client.send(
                "/v1/completions",
                {"model": self.client.model, **body},
                case=f"poison:{name}",
                expected=f.kind,
                tag=f.kind,
            )
            got.append(f"{name}: HTTP {r['status']} {r['outcome']}")
        rec["end"] = rec["back"] = round(self.clock(), 4)
        rec["notes"].append("; ".join(got))

    async def _poison_400(self, f: S.PlannedFault, inst: Any, rec: Record) -> None:
        await self._poison(f, rec, [poison_400(self.vocab, v) for v in range(2)] * 2)

    async def _poison_500(self, f: S.PlannedFault, inst: Any, rec: Record) -> None:
        await self._poison(f, rec, [("vllm_xargs_kv_params_string", POISON_500_BODY)] * 3)

    # -- admin -----------------------------------------------------------------------------

    async def _admin_remove_add(
        self, f: S.PlannedFault, inst: Instance | None, rec: Record
    ) -> None:
        assert inst is not None
        url = self.lab.proxy_url + "/admin/instances"
        hdr = {"Authorization": f"Bearer {ADMIN_KEY}"}
        body = {"role": inst.role, "url": inst.url}
        async with aiohttp.ClientSession() as s:
            async with asyncio.timeout(10), s.delete(url, json=body, headers=hdr) as r:
                rec["notes"].append(f"DELETE {r.status}")
            rec["start"] = round(self.clock(), 4)
            await asyncio.sleep(f.hold_s)
            async with (
                asyncio.timeout(10),
                s.post(url, json={**body, "weight": 1}, headers=hdr) as r,
            ):
                rec["notes"].append(f"POST {r.status}")
        rec["back"] = rec["end"] = round(self.clock(), 4)
