"""Tensor parallelism inside a worker, on CPU: 2 ranks over gloo on loopback, rank 0 in this process
(its engine drives a `TensorParallelRunner`) and rank 1 a follower process it starts. Greedy tokens equal
`transformers` generate's on the built-in Llama and on a Qwen3 (q/k norms, grouped kv heads); KV hands
off over the real data path between workers of different degrees (TP=2 prefill → TP=1 decode and TP=1
prefill → TP=2 decode) with the tokens of a TP=1 engine; a degree that does not divide the heads is
refused; a follower's death fails the worker rather than hanging it, and followers die with it."""

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from diptych_common.builtin import DIPTYCH_TINY
from tests.workers.conftest import prompts
from tests.workers.serving import Worker, split
from tests.workers.test_engine import run_all
from tests.workers.test_model_families import COMMON, _generate, _save_random_model
from workers.engine.core import Engine, EngineConfig
from workers.engine.sampling import StopCriteria
from workers.models.sharding import ShardingError, check_shardable
from workers.models.step import StepInput
from workers.runner.model_loader import build_builtin_model, load_model
from workers.runner.model_runner import ModelRunner
from workers.runner.tensor_parallel import OPERATION_BYTES, TensorParallelError, TensorParallelSpec, launch
from workers.serving.server import Role

pytestmark = pytest.mark.timeout(240)  # a follower loads torch and the model in a process of its own

BLOCKS, BLOCK_SIZE = 128, 16  # the serving harness's pool
TINY_SOURCE = "builtin:diptych-tiny"
BATCH = prompts([3, 20, 45, 90, 130], salt=7)  # up to 9 blocks; 90 and 130 take several chunks of 64
COUNTS = [24, 30, 18, 30, 12]


def tiny_spec(**overrides) -> TensorParallelSpec:
    settings = dict(
        degree=2,
        model_name="diptych-tiny",
        model_source=TINY_SOURCE,
        dtype="float32",
        device="cpu",
        num_blocks=BLOCKS,
        block_size=BLOCK_SIZE,
        start_timeout_s=120.0,
    )
    return TensorParallelSpec(**{**settings, **overrides})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_tp():
    """A TP=2 runner over the built-in model (a model of its own: sharding cuts it down in place). Closed,
    its follower leaves its loop and exits cleanly, which is no death."""
    deaths: list[str] = []
    runner = launch(build_builtin_model(DIPTYCH_TINY).eval(), tiny_spec(), on_group_lost=deaths.append)
    yield runner
    runner.close()
    assert runner.followers.processes[1].returncode == 0
    assert deaths == []  # close() joins the thread that watched the follower


def engine_on(runner: ModelRunner, executor) -> Engine:
    return Engine(
        runner, EngineConfig(num_kv_blocks=BLOCKS, token_budget=64), StopCriteria(frozenset(), 1024), executor
    )


async def run_engine(runner: ModelRunner, executor, batch, counts) -> list[list[int]]:
    engine = engine_on(runner, executor)
    task = asyncio.get_running_loop().create_task(engine.run())
    try:
        outputs, _ = await run_all(engine, batch, counts)
    finally:
        task.cancel()
    return outputs


# ---- refusals -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("degree", "message"),
    [
        (3, "a tensor-parallel degree of 3 exceeds the model's 2 kv heads"),
        (4, "a tensor-parallel degree of 4 exceeds the model's 2 kv heads"),
        (0, "the tensor-parallel degree must be 1 or more, not 0"),
    ],
)
def test_a_degree_the_kv_heads_cannot_split_over_is_refused(degree, message):
    with pytest.raises(ShardingError, match=message):
        check_shardable(build_builtin_model(DIPTYCH_TINY).config, degree)


def test_a_degree_that_does_not_divide_the_attention_heads_is_refused_before_any_follower_starts():
    config = Qwen3Config(**{**COMMON, "num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 8})
    with pytest.raises(ShardingError, match=r"the model's 6 attention heads do not split evenly over .* degree of 4"):
        check_shardable(config, 4)
    model = build_builtin_model(DIPTYCH_TINY)
    started = time.monotonic()
    with pytest.raises(ShardingError, match="exceeds the model's 2 kv heads"):
        launch(model, tiny_spec(degree=4))
    assert time.monotonic() - started < 1.0  # refused before starting a process
    assert model.model.layers[0].self_attn.q_proj.out_features == 256  # and before cutting the model down


def test_a_runner_refuses_a_model_that_was_not_sharded_for_its_degree():
    from workers.models.sharding import Shard

    with pytest.raises(ShardingError, match=r"not the .* of one rank of 2: shard it with"):
        ModelRunner(build_builtin_model(DIPTYCH_TINY), 4, 16, shard=Shard(0, 2, lambda tensor: tensor))


# ---- one worker of degree 2 -----------------------------------------------------------------------------


def test_each_rank_holds_half_the_heads_weights_and_kv_pool(tiny_tp, tiny_model):
    whole = ModelRunner(tiny_model, BLOCKS, BLOCK_SIZE)
    assert tiny_tp.kv.shape[4] == whole.kv.shape[4] // 2 == 1
    assert tiny_tp.layout == whole.layout  # what the connectors see: every kv head
    for mine, full in zip(tiny_tp.decoder.layers, whole.decoder.layers, strict=True):
        assert mine.qkv.sizes == [size // 2 for size in full.qkv.sizes]
        assert mine.gate_up.sizes == [size // 2 for size in full.gate_up.sizes]
        assert mine.all_reduce is not None and full.all_reduce is None


def test_blocks_written_with_every_head_read_back_whole_and_each_rank_keeps_its_own(tiny_tp):
    layout = tiny_tp.layout
    block_ids = [7, 3, 40]
    data = torch.randn(layout.num_layers, 2, len(block_ids), layout.block_size, layout.kv_heads, layout.head_dim)
    tiny_tp.write_blocks(block_ids, data)
    out = torch.empty_like(data)
    tiny_tp.read_blocks(block_ids, out)
    assert torch.equal(out, data)
    assert torch.equal(tiny_tp.kv[:, :, block_ids], data[..., :1, :])  # rank 0's pool: kv head 0
    assert not tiny_tp.supports_block_views
    with pytest.raises(TensorParallelError, match="spread over processes: read_blocks copies them"):
        tiny_tp.block_views(block_ids)


def test_a_step_longer_than_one_operation_message_runs_on_every_rank(tiny_tp, tiny_model):
    """48 decoding inputs over tables of 120 blocks: their JSON passes the 16 KiB message, and follows whole."""
    whole = ModelRunner(tiny_model, BLOCKS, BLOCK_SIZE)
    layout, tables = whole.layout, list(range(120))
    data = torch.randn(layout.num_layers, 2, len(tables), layout.block_size, layout.kv_heads, layout.head_dim)
    whole.write_blocks(tables, data)
    tiny_tp.write_blocks(tables, data)
    inputs = [StepInput([3 + i], 900 + i, tables, True) for i in range(48)]
    assert len(json.dumps([dataclasses.asdict(step) for step in inputs])) > OPERATION_BYTES
    expected, logits = whole.execute(inputs), tiny_tp.execute(inputs)
    assert torch.allclose(logits, expected, atol=1e-4) and torch.equal(logits.argmax(-1), expected.argmax(-1))


async def test_greedy_tokens_of_a_degree_2_engine_equal_generate(tiny_tp, reference, executor):
    outputs = await run_engine(tiny_tp, executor, BATCH, COUNTS)
    assert outputs == [reference(p, n) for p, n in zip(BATCH, COUNTS, strict=True)]


# ---- hand-offs between workers of different degrees --------------------------------------------------------


def worker_on(runner: ModelRunner, role: Role, model, executor, allow_shm: bool) -> Worker:
    """The serving harness's worker (real gRPC and data path), its engine stepping `runner`: the harness
    builds a runner of its own from `model`, of the same layout and pool size, which this one replaces."""
    worker = Worker(role, model, executor, allow_shm=allow_shm)
    assert worker.engine.runner.layout == runner.layout and worker.engine.runner.num_blocks == runner.num_blocks
    worker.engine.runner = runner
    return worker


@pytest.mark.parametrize(
    ("prefill_degree", "decode_degree", "allow_shm"),
    [(2, 1, False), (2, 1, True), (1, 2, False)],
    ids=["tp2-prefill-tp1-decode-tcp", "tp2-prefill-tp1-decode-shm", "tp1-prefill-tp2-decode-tcp"],
)
async def test_kv_hands_off_between_degrees_with_the_tokens_of_one_rank(
    prefill_degree, decode_degree, allow_shm, tiny_tp, tiny_model, reference, executor
):
    colocated = await run_engine(ModelRunner(tiny_model, BLOCKS, BLOCK_SIZE), executor, BATCH, COUNTS)
    runners = {1: ModelRunner(tiny_model, BLOCKS, BLOCK_SIZE), 2: tiny_tp}
    prefill = worker_on(runners[prefill_degree], Role.PREFILL, tiny_model, executor, allow_shm)
    decode = worker_on(runners[decode_degree], Role.DECODE, tiny_model, executor, allow_shm)
    await prefill.start()
    await decode.start()
    try:
        calls = (split(prefill, decode, f"h{i}", p, n) for i, (p, n) in enumerate(zip(BATCH, COUNTS, strict=True)))
        results = await asyncio.gather(*calls)
    finally:
        await prefill.stop()
        await decode.stop()
    for prompt, count, tokens, (prefill_events, rest) in zip(BATCH, COUNTS, colocated, results, strict=True):
        delivered = prefill_events[1].kv_delivered
        assert delivered.kv_bytes > 0 and delivered.data_path == ("shm" if allow_shm else "tcp")
        assert [prefill_events[0].first_token.token_id] + [e.token_id for e in rest] == tokens
        assert tokens == reference(prompt, count)


# ---- other shapes: Qwen3 (per-head q/k norms), a Llama with biases on every projection (o's and down's
# added once, on rank 0), both with 2 query heads per kv head ---------------------------------------------------

FAMILIES = {
    "qwen3": Qwen3Config(**COMMON),
    "llama-biased": LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
}


@pytest.mark.parametrize("name", list(FAMILIES))
async def test_greedy_tokens_of_degree_2_on_other_shapes_equal_generate(name, tmp_path, executor):
    _save_random_model(FAMILIES[name], tmp_path)
    reference_model = load_model(name, str(tmp_path)).model
    references = [_generate(reference_model, p, n) for p, n in zip(BATCH, COUNTS, strict=True)]
    assert len({token for output in references for token in output}) > 40  # varied enough that equality tells
    spec = tiny_spec(model_name=name, model_source=str(tmp_path))
    runner = launch(load_model(name, str(tmp_path)).model, spec)
    try:
        outputs = await run_engine(runner, executor, BATCH, COUNTS)
    finally:
        runner.close()
    assert outputs == references


# ---- a follower that dies ------------------------------------------------------------------------------------


def test_a_step_after_a_follower_died_fails_at_once_rather_than_hang():
    runner = launch(build_builtin_model(DIPTYCH_TINY).eval(), tiny_spec())
    try:
        follower = runner.followers.processes[1]
        follower.kill()
        follower.wait(10)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            runner.execute([])
        assert time.monotonic() - started < 5.0
    finally:
        runner.close()


def test_a_step_that_fails_on_rank_0_alone_loses_the_group_at_once():
    """Rank 0 fails inside a step (as on running out of memory) while its follower waits in the step's
    first all-reduce: the ranks are out of step for good, so the group is reported lost at once and no
    further operation runs; closing it kills the stuck follower."""
    lost: list[str] = []
    runner = launch(build_builtin_model(DIPTYCH_TINY).eval(), tiny_spec(), on_group_lost=lost.append)
    try:

        def embed_fails(token_ids):
            raise RuntimeError("rank 0 ran out of memory")

        runner.decoder.embed = embed_fails
        with pytest.raises(TensorParallelError, match="an operation failed on rank 0: rank 0 ran out of memory"):
            runner.execute([StepInput([5], 0, [0], True)])
        assert lost == ["an operation failed on rank 0: rank 0 ran out of memory"]
        assert runner.followers.died() is None  # the follower is stuck, not dead
        with pytest.raises(TensorParallelError, match="the tensor-parallel group cannot run: an operation failed"):
            runner.read_blocks([0], torch.empty(0))
    finally:
        runner.close()
    assert runner.followers.processes[1].returncode == -signal.SIGKILL


# A worker process as workers.main builds its engine: it prints its followers' pids, then waits.
WORKER = """
import sys, time, torch
from concurrent.futures import ThreadPoolExecutor
from workers.engine.core import EngineConfig
from workers.main import TensorParallelLaunch, build_engine, stop_on_group_lost
from workers.runner.model_loader import load_model
torch.set_num_threads(1)
launch = TensorParallelLaunch(2, "builtin:diptych-tiny", stop_on_group_lost)
config = EngineConfig(num_kv_blocks=32, token_budget=64)
engine = build_engine(load_model("diptych-tiny", "builtin:diptych-tiny"), config, ThreadPoolExecutor(1), launch)
print(*(process.pid for process in engine.runner.followers.processes.values()), flush=True)
time.sleep(120)
"""


# A worker that has just started its follower (still loading the model), and waits.
LOADING_WORKER = """
import time
from datetime import timedelta
import torch.distributed as dist
from tests.workers.test_tensor_parallel import tiny_spec
from workers.runner.tensor_parallel import LOOPBACK, _start_follower
store = dist.TCPStore(LOOPBACK, 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
print(_start_follower(tiny_spec(), 1, store.port).pid, flush=True)
time.sleep(120)
"""


def start_worker(script: str = WORKER) -> tuple[subprocess.Popen, int]:
    worker = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert worker.stdout is not None
    line = worker.stdout.readline()
    if not line:
        worker.kill()
        pytest.fail(f"the worker did not start: {worker.communicate(timeout=10)[1][-2000:]}")
    return worker, int(line)


def test_a_follower_that_dies_stops_its_worker():
    from workers.main import FOLLOWER_DIED_EXIT_CODE

    worker, follower = start_worker()
    try:
        os.kill(follower, signal.SIGKILL)
        _, errors = worker.communicate(timeout=20)  # the worker's sleep would last 120 s
        assert worker.returncode == FOLLOWER_DIED_EXIT_CODE
        assert f"tensor-parallel rank 1 (pid {follower}) exited with code -9; this worker stops" in errors
    finally:
        worker.kill()


@pytest.mark.parametrize("script", [WORKER, LOADING_WORKER], ids=["following", "still-loading"])
def test_followers_die_with_their_worker(script):
    """Following, a rank leaves when its connection to rank 0 closes; still loading, it has none yet, and
    only the signal it asked for on its parent's death (PR_SET_PDEATHSIG) stops it before its timeout."""
    worker, follower = start_worker(script)
    worker.kill()
    worker.wait(10)
    deadline = time.monotonic() + 20
    try:
        while _alive(follower):
            assert time.monotonic() < deadline, f"follower {follower} outlived its worker"
            time.sleep(0.05)
    finally:
        if _alive(follower):
            os.kill(follower, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]  # a zombie waits only for reaping
    return state != "Z"
