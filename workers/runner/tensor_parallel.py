"""Tensor parallelism inside one worker: one model split over several devices (ranks), for models larger
than one device.

Rank 0 is the worker process: its engine drives a `TensorParallelRunner`, which is a `ModelRunner` over
rank 0's shard that first tells every other rank what to run. Ranks 1.. are follower processes the worker
starts (`launch`); each loads the model, keeps its shard (`workers.models.sharding`) and runs `follow`: it
receives each runner operation from rank 0 and runs it in lockstep. The operations are plain data
broadcast as JSON over a gloo group (a step's inputs as lists of ints; a block read or write as block
ids); tensors (the all-reduce after o and down, the KV blocks a read gathers or a write scatters) travel
over gloo on CPU and NCCL on CUDA, where rank r runs on device cuda:(n + r) for a worker on cuda:n.

The KV pool of each rank holds its own kv heads. What the connectors see is the whole KV, every kv head:
`read_blocks` gathers the heads from every rank and `write_blocks` scatters them, so the layout on the
wire does not depend on the degree and a prefill worker of one degree hands off to a decode worker of
another. Blocks cannot be seen in place across processes (`supports_block_views` is false), so the TCP
data path copies them out.

Followers die with the worker (PR_SET_PDEATHSIG, `diptych_common.supervision`), and the worker learns at
once when a follower dies (`Followers.watch`): `workers.main` then stops the worker rather than let a
step wait on a rank that is gone.
"""

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from transformers import PreTrainedModel
from typing_extensions import override

from diptych_common.supervision import stop_with_supervisor, supervisor_env
from workers.models.sharding import Shard, check_shardable, shard_model
from workers.models.step import StepInput
from workers.runner.kv_pool import BlocksRead
from workers.runner.model_loader import load_model
from workers.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Collectives wait this long: a follower waits for rank 0's next operation for as long as the worker idles.
# A rank that dies is noticed at once (its connections close, and `Followers.watch` sees it).
COLLECTIVE_TIMEOUT = timedelta(days=365)
READY_KEY = "ready/{rank}"
# An operation's message: its JSON's length, then the JSON (a decode step of a few dozen sequences fits).
OPERATION_BYTES, LENGTH_BYTES = 16 << 10, 8
T = TypeVar("T")
# ProcessGroupGloo and ProcessGroupNCCL: torch's stubs leave out their collectives (allreduce, broadcast, ...)
_Backend = Any


class TensorParallelError(RuntimeError):
    """The tensor-parallel group cannot start or has lost a rank."""


@dataclass(frozen=True)
class TensorParallelSpec:
    """What every rank builds: the model, its dtype and device, the KV pool."""

    degree: int
    model_name: str
    model_source: str  # as `workers.runner.model_loader.load_model` takes it
    dtype: str  # a torch dtype's name: "float32", "bfloat16"
    device: str  # "cpu", or "cuda[:n]": rank r then runs on cuda:(n + r)
    num_blocks: int
    block_size: int
    threads: int = 1  # torch CPU threads of each follower
    start_timeout_s: float = 600.0  # for the followers to load the model and join

    def device_of(self, rank: int) -> torch.device:
        device = torch.device(self.device)
        if device.type == "cpu":
            return device
        if device.type != "cuda":
            raise TensorParallelError(f"tensor parallelism runs on cpu or cuda, not on {self.device}")
        return torch.device("cuda", (device.index or 0) + rank)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise TensorParallelError(f"{self.dtype!r} is not a torch dtype")
        return dtype


class Group:
    """The ranks' collectives. Operations go as JSON over gloo; tensors over gloo on CPU, NCCL on CUDA."""

    def __init__(self, store: dist.Store, rank: int, degree: int, device: torch.device) -> None:
        self.rank, self.degree, self.device = rank, degree, device
        self._control: _Backend = dist.ProcessGroupGloo(
            dist.PrefixStore("control", store), rank, degree, COLLECTIVE_TIMEOUT
        )
        self._data: _Backend = self._control
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self._data = _nccl_group(dist.PrefixStore("data", store), rank, degree)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._data.allreduce([tensor]).wait()
        return tensor

    def broadcast_operation(self, operation: list[Any] | None = None) -> list[Any]:
        """Rank 0 sends `operation` (JSON data); every rank returns it. One broadcast of a fixed-size
        message (the JSON's length, then the JSON) carries most operations; a longer JSON is sent again
        whole in a second broadcast."""
        message, payload = bytearray(OPERATION_BYTES), b""
        if self.rank == 0:
            payload = json.dumps(operation).encode()
            message[:LENGTH_BYTES] = len(payload).to_bytes(LENGTH_BYTES, "little")
            inline = payload[: OPERATION_BYTES - LENGTH_BYTES]
            message[LENGTH_BYTES : LENGTH_BYTES + len(inline)] = inline
        self._broadcast_bytes(message)
        length = int.from_bytes(message[:LENGTH_BYTES], "little")
        if length <= OPERATION_BYTES - LENGTH_BYTES:
            inline_operation: list[Any] = json.loads(message[LENGTH_BYTES : LENGTH_BYTES + length])
            return inline_operation
        whole = bytearray(payload) if self.rank == 0 else bytearray(length)
        self._broadcast_bytes(whole)
        whole_operation: list[Any] = json.loads(whole)
        return whole_operation

    def _broadcast_bytes(self, data: bytearray) -> None:
        """Rank 0's bytes into every rank's `data` (in place: the tensor shares its memory)."""
        self._control.broadcast(torch.frombuffer(data, dtype=torch.uint8), 0).wait()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor`, in rank order, on rank 0 (elsewhere: an empty list)."""
        options = dist.GatherOptions()
        options.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self.degree)]] if self.rank == 0 else []
        self._data.gather(outputs, [tensor], options).wait()
        return outputs[0] if outputs else []

    def scatter(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> None:
        """Rank r receives rank 0's parts[r] into `out`."""
        options = dist.ScatterOptions()
        options.rootRank = 0
        self._data.scatter([out], [parts] if self.rank == 0 else [], options).wait()


def _nccl_group(store: dist.Store, rank: int, degree: int) -> _Backend:
    if not dist.is_nccl_available():
        raise TensorParallelError("this torch build has no NCCL: tensor parallelism on CUDA needs it")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = COLLECTIVE_TIMEOUT
    return dist.ProcessGroupNCCL(store, rank, degree, options)


class Followers:
    """Rank 0's view of the follower processes: whether they live, and stopping them."""

    def __init__(self, processes: dict[int, subprocess.Popen[bytes]]) -> None:
        self.processes = processes  # by rank
        self._stopping = False
        self._watchers: list[threading.Thread] = []

    def died(self) -> str | None:
        """Why the group lost a rank, or None while every follower runs."""
        for rank, process in self.processes.items():
            if process.poll() is not None:
                return f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.returncode}"
        return None

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Calls on_death(why), on a thread of its own, as soon as a follower exits unasked."""
        for rank, process in self.processes.items():
            watcher = threading.Thread(
                target=self._wait, args=(rank, process, on_death), name=f"tp-rank-{rank}", daemon=True
            )
            watcher.start()
            self._watchers.append(watcher)

    def _wait(self, rank: int, process: subprocess.Popen[bytes], on_death: Callable[[str], None]) -> None:
        code = process.wait()
        if not self._stopping:
            on_death(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {code}")

    def expect_exit(self) -> None:
        """From now on a follower that exits was asked to: `watch` no longer reports it."""
        self._stopping = True

    def stop(self, timeout: float = 10.0) -> None:
        """Waits for followers told to stop; kills those still running after `timeout` seconds."""
        self.expect_exit()
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for watcher in self._watchers:
            watcher.join()


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: each operation is sent to the followers, then run here on rank 0's shard."""

    def __init__(self, model: PreTrainedModel, spec: TensorParallelSpec, group: Group, followers: Followers) -> None:
        shard = Shard(0, spec.degree, group.all_reduce)
        super().__init__(model, spec.num_blocks, spec.block_size, str(spec.device_of(0)), shard=shard)
        self.group = group
        self.followers = followers
        self.on_group_lost: Callable[[str], None] | None = None  # called once an operation fails here
        self._broken: str | None = None

    @torch.inference_mode()
    def execute(self, inputs: list[StepInput]) -> torch.Tensor:
        self._send(["execute", [asdict(step) for step in inputs]])
        return self._checked(lambda: super(TensorParallelRunner, self).execute(inputs))

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Copies blocks, every kv head, into `out` [layers, 2, len(block_ids), block_size, kv_heads, head_dim]."""
        self._send(["read", block_ids])
        parts = self._checked(lambda: self.group.gather(shard_blocks(self, block_ids)))
        heads = self.kv_heads
        for rank, part in enumerate(parts):
            out[..., rank * heads : (rank + 1) * heads, :].copy_(part, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def start_reading_blocks(self, block_ids: list[int], out: torch.Tensor) -> BlocksRead:
        """As read_blocks (the group's ranks answer in turn: nothing is left under way)."""
        self.read_blocks(block_ids, out)
        return BlocksRead()

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Writes blocks of every kv head (as `read_blocks` gives them); each rank keeps its own heads."""
        self._send(["write", block_ids])
        data, heads = data.to(self.device, non_blocking=True), self.kv_heads
        parts = [data[..., rank * heads : (rank + 1) * heads, :].contiguous() for rank in range(self.group.degree)]
        own = torch.empty_like(parts[0])
        self._checked(lambda: self.group.scatter(parts, own))
        super().write_blocks(block_ids, own)

    @override
    def block_views(self, block_ids: list[int]) -> list[memoryview]:
        raise TensorParallelError(
            "a tensor-parallel runner's blocks are spread over processes: read_blocks copies them"
        )

    def pool_memory(self) -> torch.Tensor:
        raise TensorParallelError("a tensor-parallel runner's pool is spread over processes: read_blocks copies it")

    def close(self) -> None:
        """Stops the followers (each leaves its loop) and waits for them to exit; kills them at once when
        the group was lost (they may wait in a collective that rank 0 never joins)."""
        self.followers.expect_exit()
        if self._broken is not None or self.followers.died() is not None:
            self.followers.stop(timeout=0)
            return
        self._broken = "the runner was closed"
        try:
            self.group.broadcast_operation(["stop"])
        except RuntimeError as error:
            log.warning("could not tell the tensor-parallel followers to stop: %s", error)
        self.followers.stop()

    def _send(self, operation: list[Any]) -> None:
        if self._broken is None:
            self._broken = self.followers.died()
        if self._broken is not None:
            raise TensorParallelError(f"the tensor-parallel group cannot run: {self._broken}")
        self._checked(lambda: self.group.broadcast_operation(operation))

    def _checked(self, run: Callable[[], T]) -> T:
        """Runs a collective part of an operation; the group is out of step for good if it fails."""
        try:
            return run()
        except Exception as error:
            self._broken = self.followers.died() or f"an operation failed on rank 0: {error}"
            if self.on_group_lost is not None:
                self.on_group_lost(self._broken)
            raise TensorParallelError(f"the tensor-parallel group failed: {self._broken}") from error


def shard_blocks(runner: ModelRunner, block_ids: list[int]) -> torch.Tensor:
    """The blocks of this rank's pool, on its device [layers, 2, len(block_ids), block_size, own kv heads, dim]."""
    return torch.index_select(runner.kv, 2, torch.tensor(block_ids, dtype=torch.long, device=runner.device))


def follow(group: Group, runner: ModelRunner) -> None:
    """A follower's loop: runs rank 0's operations on this rank's shard until told to stop."""
    while True:
        operation = group.broadcast_operation()
        kind = operation[0]
        if kind == "stop":
            return
        if kind == "execute":
            runner.execute([StepInput(**fields) for fields in operation[1]])
        elif kind == "read":
            group.gather(shard_blocks(runner, operation[1]))
        elif kind == "write":
            block_ids = operation[1]
            own = runner.kv.new_empty((runner.kv.shape[0], 2, len(block_ids), *runner.kv.shape[3:]))
            group.scatter(None, own)
            runner.write_blocks(block_ids, own)
        else:
            raise TensorParallelError(f"rank 0 sent an unknown operation {kind!r}")


def launch(
    model: PreTrainedModel, spec: TensorParallelSpec, on_group_lost: Callable[[str], None] | None = None
) -> TensorParallelRunner:
    """Starts ranks 1.. as follower processes and returns rank 0's runner over `model` (loaded on the host
    as the followers load it; it is sharded here, then moved to rank 0's device). Call from the main
    thread: a follower is tied to the thread that started it. `on_group_lost(why)` is called, once the
    group runs, when a follower exits unasked or an operation fails on rank 0 (the ranks are then out of
    step for good)."""
    check_shardable(model.config, spec.degree)
    if spec.degree < 2:
        raise TensorParallelError(f"a tensor-parallel group has 2 ranks or more, not {spec.degree}")
    store = dist.TCPStore(
        LOOPBACK,
        0,
        spec.degree,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=spec.start_timeout_s),
    )
    followers = Followers({rank: _start_follower(spec, rank, store.port) for rank in range(1, spec.degree)})
    try:
        shard_model(model, 0, spec.degree)
        model.to(spec.device_of(0))  # type: ignore[arg-type]  # typeshed: functools.wraps binds no self
        _wait_ready(store, followers, spec.start_timeout_s)
        runner = TensorParallelRunner(model, spec, Group(store, 0, spec.degree, spec.device_of(0)), followers)
    except BaseException:
        followers.stop(timeout=0)
        raise
    if on_group_lost is not None:
        followers.watch(on_group_lost)
        runner.on_group_lost = on_group_lost
    return runner


def _start_follower(spec: TensorParallelSpec, rank: int, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, **supervisor_env(), "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)}
    command = [
        sys.executable,
        "-m",
        "workers.runner.tensor_parallel",
        "--rank",
        str(rank),
        "--spec",
        json.dumps(asdict(spec)),
    ]
    return subprocess.Popen(command, env=env)


def _wait_ready(store: dist.Store, followers: Followers, timeout: float) -> None:
    """Waits for every follower to have loaded its shard, failing as soon as one exits."""
    deadline = time.monotonic() + timeout
    pending = set(followers.processes)
    while pending:
        if why := followers.died():
            raise TensorParallelError(f"the tensor-parallel group did not start: {why} (see its log)")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks {sorted(pending)} were not ready in {timeout:.0f} s")
        pending = {rank for rank in pending if not store.check([READY_KEY.format(rank=rank)])}
        time.sleep(0.05)


def run_follower(spec: TensorParallelSpec, rank: int, master_addr: str, master_port: int) -> None:
    """A follower process's life: load, shard, join the group, follow rank 0 until it says stop."""
    torch.set_num_threads(spec.threads)
    device = spec.device_of(rank)
    model = load_model(spec.model_name, spec.model_source, dtype=spec.torch_dtype).model
    shard_model(model, rank, spec.degree)
    model.to(device)  # type: ignore[arg-type]  # typeshed: functools.wraps binds no self
    store = dist.TCPStore(
        master_addr, master_port, spec.degree, is_master=False, timeout=timedelta(seconds=spec.start_timeout_s)
    )
    store.set(READY_KEY.format(rank=rank), "1")
    group = Group(store, rank, spec.degree, device)
    runner = ModelRunner(
        model, spec.num_blocks, spec.block_size, str(device), shard=Shard(rank, spec.degree, group.all_reduce)
    )
    log.info("tensor-parallel rank %d of %d runs on %s", rank, spec.degree, device)
    follow(group, runner)


def main(argv: list[str] | None = None) -> None:
    stop_with_supervisor()  # first: the follower stops when the worker that started it dies
    parser = argparse.ArgumentParser(description="a tensor-parallel follower rank (started by a worker)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--spec", required=True, help="TensorParallelSpec as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {args.rank} %(name)s: %(message)s")
    spec = TensorParallelSpec(**json.loads(args.spec))
    run_follower(spec, args.rank, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))


if __name__ == "__main__":
    main()
