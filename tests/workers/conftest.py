"""The built-in model, its reference greedy outputs, engines built on it, and a prefill and a decode worker
served over gRPC."""

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from diptych_common.builtin import DIPTYCH_TINY
from tests.workers.serving import Worker
from workers.engine.core import Engine, EngineConfig
from workers.engine.sampling import StopCriteria
from workers.kv_connector.interfaces import LOOPBACK
from workers.kv_connector.nixl import RegisteredStaging, nixl_staging
from workers.models.step import StepInput
from workers.runner.model_loader import build_builtin_model
from workers.runner.model_runner import ModelRunner
from workers.serving.server import Role


@pytest.fixture(scope="session")
def tiny_model():
    return build_builtin_model(DIPTYCH_TINY).eval()


@pytest.fixture(scope="session")
def reference(tiny_model):
    """Greedy tokens of `transformers` generate, one prompt at a time, cached per (prompt, count)."""
    cache: dict[tuple, list[int]] = {}

    def generate(prompt: list[int], count: int) -> list[int]:
        key = (tuple(prompt), count)
        if key not in cache:
            ids = torch.tensor([prompt])
            out = tiny_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, min_new_tokens=count, do_sample=False
            )
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return generate


@pytest.fixture
def executor():
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool


@pytest.fixture(scope="session")
def nixl_agents() -> dict[Role, RegisteredStaging | None]:
    """A NIXL agent for each side of a hand-off (UCX on loopback), shared by the tests."""
    return {role: nixl_staging("on", role.value, LOOPBACK) for role in (Role.PREFILL, Role.DECODE)}


@pytest.fixture(params=["tcp", "shm", "nixl"])
async def workers(request, tiny_model, executor, nixl_agents):
    """A prefill and a decode worker of the tiny model, the KV moving over TCP, shared memory or NIXL."""
    shm, nixl = request.param == "shm", request.param == "nixl"
    prefill = Worker(Role.PREFILL, tiny_model, executor, shm, nixl=nixl_agents[Role.PREFILL] if nixl else None)
    decode = Worker(Role.DECODE, tiny_model, executor, shm, nixl=nixl_agents[Role.DECODE] if nixl else None)
    await prefill.start()
    await decode.start()
    yield prefill, decode
    await prefill.stop()
    await decode.stop()


@pytest.fixture
def make_engine(tiny_model, executor):
    """Starts engines on the built-in model; every engine is stopped after the test."""
    tasks = []

    def make(**options) -> Engine:
        config = EngineConfig(**{"num_kv_blocks": 256, "block_size": 16, **options})
        runner = ModelRunner(tiny_model, config.num_kv_blocks, config.block_size)
        engine = Engine(runner, config, StopCriteria(frozenset(), 1024), executor)
        tasks.append(asyncio.get_running_loop().create_task(engine.run()))
        return engine

    yield make
    for task in tasks:
        task.cancel()


async def wait_until(condition: Callable[[], bool], timeout: float = 2.0) -> bool:
    """Whether `condition` holds within `timeout` seconds (checked every 5 ms, the event loop running)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


def all_blocks_free(engine) -> bool:
    stats = engine.stats()
    return stats.kv_blocks_free == stats.kv_blocks_total and not stats.running and not stats.waiting


def prompts(lengths, salt: int = 0) -> list[list[int]]:
    """Token ids 3..502 (no special tokens) in a pattern that varies with the length and the salt."""
    return [[(7 * n + 13 * salt + i * i) % 500 + 3 for i in range(n)] for n in lengths]


def prefilled(runner, lengths: list[int]) -> list[StepInput]:
    """Prefills one prompt per length, each on blocks of its own; returns each sequence's next decode input."""
    size = runner.layout.block_size
    tables, first = [], 0
    for length in lengths:
        tables.append(list(range(first, first + length // size + 1)))
        first += length // size + 1
    for salt, (length, table) in enumerate(zip(lengths, tables, strict=True)):
        runner.execute([StepInput(prompts([length], salt)[0], 0, table, True)])
    pairs = enumerate(zip(lengths, tables, strict=True))
    return [StepInput([11 + n], length, table, True) for n, (length, table) in pairs]
