"""CPU shim for vLLM's built-in MooncakeConnector: benchmark use only, never the product.

Loaded by vLLM through the kv-transfer config:
    {"kv_connector": "CpuShimMooncakeConnector",
     "kv_connector_module_path": "scripts.bench.mooncake_cpu_shim", ...}

What it changes, and only when no accelerator is present:
  1. torch.accelerator.current_device_index() raises "Cannot access accelerator device
     when none is available" on CPU; MooncakeConnectorWorker.__init__ calls it once to
     remember a CUDA device. Here it returns 0 (current_platform.set_device(0) on the CPU
     platform is torch.cpu.set_device, a documented no-op).
  2. The prefiller's bootstrap server binds 0.0.0.0; here it binds 127.0.0.1 (the lab's
     network rule: loopback only). Its address is still taken from
     VLLM_MOONCAKE_BOOTSTRAP_PORT and the data-parallel master IP (127.0.0.1).
  3. Instrumentation: every batch_transfer_sync_write the sender issues is logged at INFO
     as "pdbench send: <bytes> bytes <n> descs <ms> ms to <session>" (vLLM logs it only
     at DEBUG, without bytes), so the benchmark can compute bytes/s.
The class name differs from the built-in one so vLLM's registry does not pick the original.
"""

from __future__ import annotations

import time

import torch

if not torch.accelerator.is_available():
    _orig_index = torch.accelerator.current_device_index

    def _cpu_device_index() -> int:
        return 0

    torch.accelerator.current_device_index = _cpu_device_index  # type: ignore[assignment]

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (
    mooncake_connector as _mc,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
    MooncakeBootstrapServer,
)
from vllm.logger import init_logger

logger = init_logger("vllm.pdbench_shim")


class LoopbackBootstrapServer(MooncakeBootstrapServer):
    def __init__(self, host: str, port: int):
        super().__init__("127.0.0.1", port)


_mc.MooncakeBootstrapServer = LoopbackBootstrapServer  # type: ignore[misc]

_orig_send_blocks = _mc.MooncakeConnectorWorker._send_blocks


def _send_blocks_logged(self, remote_session, src_ptrs, dst_ptrs, lengths):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    ret = _orig_send_blocks(self, remote_session, src_ptrs, dst_ptrs, lengths)
    logger.info(
        "pdbench send: %d bytes %d descs %.3f ms to %s ret %d",
        sum(lengths),
        len(src_ptrs),
        (time.perf_counter() - t0) * 1e3,
        remote_session,
        ret,
    )
    return ret


_mc.MooncakeConnectorWorker._send_blocks = _send_blocks_logged  # type: ignore[method-assign]


class CpuShimMooncakeConnector(_mc.MooncakeConnector):
    """vLLM's MooncakeConnector, unchanged apart from the patches above."""
