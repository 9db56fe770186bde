"""Collective weight sync from the trainer to vLLM engines: vLLM's weight-transfer engines, with a
gloo backend for CPU.

The large-model path. The trainer's rank 0 and every worker of every vLLM engine form one process
group. Every transfer:
1. Each trainer rank gathers one full tensor at a time (`runtime.rollout.HFWeightSource`).
2. Rank 0 broadcasts it.
3. Each vLLM worker feeds it to the model's own `load_weights` inside a layerwise reload; each
   tensor-parallel worker keeps its shard.
No copy of the whole model is made anywhere: not in host memory, not in the Ray object store, not
in vLLM's RPC messages. The object-store path (`VLLMEngine.update_weights`) makes all three.

vLLM 0.32 (`vllm/distributed/weight_transfer/`) provides the lifecycle:
- the worker side: `init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
  `finish_weight_update` on `vllm.v1.worker.gpu_worker.Worker`, which the CPU worker inherits;
- the trainer side: `TrainerWeightTransferEngine.send_weights`, which runs the workers'
  `update_weights` RPC on a thread while it broadcasts;
- the "nccl" backend (CUDA only: `PyNcclCommunicator`).
This module adds:
- "gloo", the same protocol over a `torch.distributed.ProcessGroupGloo`. It lets the lifecycle
  run, and be tested, on CPU. It subclasses the NCCL engines and changes only the transport.
- `EngineWeightSyncClient`, vLLM's `VLLMWeightSyncClient` protocol over our `VLLMEngine` Ray
  actors. Each engine gets its own ranks (rank_offset), and the loaded policy version is recorded.

Importing this module imports vllm, and registers "gloo" with vLLM's engine factories.
`runtime.rollout_vllm` imports it when vllm is installed, so vLLM's workers (which import the
worker extension from there) know the backend before they build their transfer engine.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.nccl_common import worker_init_payload
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

__all__ = [
    "EngineWeightSyncClient",
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "start_weight_transfer",
]

_GROUP_TIMEOUT_S = 1800.0  # a worker waits this long for the trainer's next tensor


def gloo_group(
    master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroupGloo:
    """A gloo process group outside torch.distributed's default group (the trainer already has
    one). Rank 0 hosts the TCPStore rendezvous at master_address:master_port.

    Raises:
        RuntimeError (torch's DistStoreError): the other ranks did not join within timeout_s.
    """
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(
        dist.PrefixStore("scaffold_weights", store), rank, world_size, timeout
    )


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """Worker side of the "gloo" backend: vLLM's dense NCCL engine with a gloo transport.

    Its layerwise reload (start/finish) is the NCCL engine's. Init info and update info are the
    NCCL engine's too (`NCCLWeightTransferInitInfo`, `NCCLWeightTransferUpdateInfo`). Tensors
    arrive one at a time (packed=False) on the CPU.
    """

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        if init_info.packed or init_info.master_address is None or init_info.master_port is None:
            raise ValueError(
                "the gloo weight transfer needs master_address/master_port and packed=False; "
                f"got {init_info}"
            )
        pc = self.parallel_config  # this worker's rank, as vLLM's NCCL engine numbers it
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.model_update_group = gloo_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            _GROUP_TIMEOUT_S,
        )

    def update_weights(self, update_info: dict) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises without an
        # accelerator; gloo's wait() has already finished every receive
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.model_update_group is None:
            raise RuntimeError(
                "gloo weight transfer not initialized: call init_transfer_engine first"
            )
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.model_update_group.broadcast(weight, 0).wait()
            self.model.load_weights([(name, weight)])

    def shutdown(self) -> None:
        self.model_update_group = None  # gloo groups close when garbage-collected


@dataclass
class GlooTrainerInitInfo(NCCLTrainerInitInfo):
    """Trainer side init info of the "gloo" backend: NCCL's fields, unpacked, with a timeout."""

    backend: ClassVar[str] = "gloo"
    packed: bool = False
    timeout_s: float = 300.0  # the trainer's wait for the workers to join and receive, per tensor


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """Trainer side of the "gloo" backend: vLLM's `send_weights` round trip (start, the workers'
    `update_weights` on a thread while rank 0 broadcasts, finish), broadcasting over gloo.

    Rank 0 is the sender. The other ranks only iterate the source, to take part in its gathers.
    """

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        if source is None:
            raise ValueError("the gloo weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        if not engine.is_sender:
            return engine
        worker_info = NCCLWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,  # the workers follow the sender, rank 0
            world_size=init_info.world_size,
            packed=False,
        )
        # the workers block in the rendezvous until rank 0 hosts it: join from a thread
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(
                client.init_weight_transfer_engine, worker_init_payload(worker_info)
            )
            engine.model_update_group = gloo_group(
                init_info.master_address,
                init_info.master_port,
                0,
                init_info.world_size,
                init_info.timeout_s,
            )
            joined.result()
        return engine

    def _broadcast(self, source, meta) -> None:
        if not self.is_sender:
            for _ in source:  # the gathers are collectives: every rank iterates
                pass
            return
        for _name, tensor in self._checked_iter(source, meta):
            self.model_update_group.broadcast(tensor.detach().to("cpu").contiguous(), 0).wait()

    def shutdown(self) -> None:
        self.model_update_group = None


def _register() -> None:
    for factory, engine in (
        (WeightTransferEngineFactory, GlooWeightTransferEngine),
        (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine),
    ):
        try:
            factory.register_engine("gloo", engine)
        except ValueError:  # already registered: this module was imported again
            pass


_register()


class EngineWeightSyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol (init, start, update, finish) over `VLLMEngine`
    Ray actors: every call goes to every engine and waits for all of them.

    Each engine is a separate `vllm.LLM`, so each numbers its workers from 0. The init call
    gives engine i the rank_offset after engine i-1's workers. `finish_weight_update` records
    `version` (set it before each `send_weights`) as the engines' policy version.

    Args:
        engines: `VLLMEngine` actor handles.
        workers: worker processes of each engine (its tensor_parallel_size x pipeline size).
        timeout_s: seconds each call may take per engine.
        ready_timeout_s: seconds the start call may take: it runs after the generations already
            queued on the engine.
    """

    def __init__(self, engines: list, workers: list[int], timeout_s: float, ready_timeout_s: float):
        self.engines, self.workers = engines, workers
        self.timeout_s, self.ready_timeout_s = timeout_s, ready_timeout_s
        self.version = 0

    def _call(self, what: str, method: str, args_per_engine: list[tuple], timeout_s: float = 0):
        import ray
        from ray.exceptions import GetTimeoutError

        timeout_s = timeout_s or self.timeout_s
        refs = [
            getattr(e, method).remote(*a)
            for e, a in zip(self.engines, args_per_engine, strict=True)
        ]
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref, timeout=timeout_s))
            except GetTimeoutError:
                raise TimeoutError(
                    f"weight transfer ({what}, policy version {self.version}) to engine {i} did not "
                    f"finish within {timeout_s} s (engine busy, dead or out of memory); raise "
                    "--weight_sync_timeout_s (--rollout_timeout_s while batches are still "
                    "generating) or check the engine logs"
                ) from None
        return out

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        offsets = [
            init_info["rank_offset"] + sum(self.workers[:i]) for i in range(len(self.engines))
        ]
        self._call(
            "init", "init_weight_transfer", [({**init_info, "rank_offset": o},) for o in offsets]
        )

    def start_weight_update(self) -> None:
        self._call("start", "start_weight_update", [()] * len(self.engines), self.ready_timeout_s)

    def update_weights(self, update_info: dict) -> None:
        self._call("receive", "receive_weights", [(update_info,)] * len(self.engines))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        loaded = self._call("finish", "finish_weight_update", [(self.version,)] * len(self.engines))
        wrong = {i: v for i, v in enumerate(loaded) if v != self.version}
        if wrong:
            raise RuntimeError(
                f"engines {wrong} report other policy versions after a transfer of {self.version}"
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_weight_transfer(engines: list, source, timeout_s: float, ready_timeout_s: float):
    """Open the transfer group between this process (rank 0, the sender) and every worker of
    `engines`, and return vLLM's trainer-side engine: its `send_weights()` pushes `source` again
    each time it is called.

    The backend follows the source's device: "nccl" for CUDA tensors (vLLM's
    `NCCLTrainerWeightTransferEngine`; the engines must have been started with
    `weight_transfer_config={"backend": "nccl"}`), else "gloo" (`{"backend": "gloo"}`). This
    process hosts the rendezvous on its node's IP (`ray.util.get_node_ip_address`), at a free port.

    Args:
        engines: `VLLMEngine` Ray actors, started with the matching `weight_transfer_config`.
        source: a `runtime.rollout.HFWeightSource` (its `device` picks the backend).
        timeout_s: per-call timeout of the engine RPCs (and gloo's per-tensor timeout).
        ready_timeout_s: how long to wait for the engines to answer at all: an engine still
            starting, or finishing the generations queued on it, answers only after that.

    Raises:
        TimeoutError: an engine did not answer within ready_timeout_s or timeout_s (names it).
    """
    import ray
    from ray.exceptions import GetTimeoutError

    workers = []
    for i, engine in enumerate(engines):
        try:
            workers.append(ray.get(engine.transfer_workers.remote(), timeout=ready_timeout_s))
        except GetTimeoutError:
            raise TimeoutError(
                f"weight transfer: engine {i} did not answer within {ready_timeout_s} s (it is still "
                "starting, or generating the batches queued on it); raise --rollout_timeout_s or "
                "check the engine logs"
            ) from None
    client = EngineWeightSyncClient(engines, workers, timeout_s, ready_timeout_s)
    address, port, world_size = ray.util.get_node_ip_address(), _free_port(), 1 + sum(workers)
    if source.device.type == "cuda":
        info = NCCLTrainerInitInfo(address, port, world_size, rank=0)
    else:
        info = GlooTrainerInitInfo(address, port, world_size, rank=0, timeout_s=timeout_s)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
