"""Every supported model family, built tiny with seeded random weights and saved as a Hugging Face directory,
loads through the worker's loader and serves the greedy tokens of `transformers` generate, token for token:
split (prefill worker → decode worker, the KV on the data path), colocated, and through the padded decode
steps that CUDA graphs capture (run eagerly here). Prompts span several KV blocks and a prompt-chunk
boundary; outputs run past the sliding windows. Other architectures are refused at load, by name."""

import asyncio
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    GemmaConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from diptych_common.builtin import DIPTYCH_TINY
from diptych_common.proto.v1 import worker_pb2
from tests.workers.conftest import prompts
from tests.workers.serving import Worker, sampling, split
from tests.workers.test_engine import run_all
from workers.engine.core import Engine, EngineConfig
from workers.engine.sampling import StopCriteria
from workers.models.families import UnsupportedModelError, decoder_of
from workers.runner.decode_graphs import DecodeGraphSpec
from workers.runner.model_loader import load_model
from workers.runner.model_runner import ModelRunner
from workers.serving.server import Role

WINDOW = 24  # below every prompt + output here, and below the longest prompt
PROMPT_LENGTHS = [20, 45, 90]  # 90: six blocks of 16, and two chunks under the workers' budget of 64 tokens
OUTPUT_TOKENS = 40
COMMON = dict(
    vocab_size=512,  # the built-in tokenizer's, saved with each model
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    initializer_range=0.2,  # far above the usual 0.02: greedy text that varies, so that equality means something
    bos_token_id=0,
    eos_token_id=None,  # generate then makes exactly the tokens asked for, as the workers do with ignore_eos
    pad_token_id=2,
    tie_word_embeddings=False,
)
# family → (config class, its settings beyond COMMON, the window transformers gives each layer)
FAMILIES = {
    "llama": (LlamaConfig, {}, [None, None]),
    "mistral": (MistralConfig, {"sliding_window": WINDOW}, [WINDOW, WINDOW]),
    # Qwen2 ignores sliding_window unless use_sliding_window, and then only from layer max_window_layers on.
    "qwen2": (Qwen2Config, {"sliding_window": WINDOW, "use_sliding_window": False}, [None, None]),
    "qwen2-windowed": (
        Qwen2Config,
        {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1},
        [None, WINDOW],
    ),
    "qwen3": (Qwen3Config, {}, [None, None]),
    # Untied (unlike Gemma checkpoints): tied, these random weights write near-constant text.
    "gemma": (GemmaConfig, {"num_key_value_heads": 1}, [None, None]),
}


@dataclass
class Family:
    model: torch.nn.Module
    windows: list
    references: dict  # prompt → generate's greedy tokens

    def reference(self, prompt: list[int]) -> list[int]:
        return self.references[tuple(prompt)]


def _generate(model, prompt: list[int], count: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _save_random_model(config, directory) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norm weights and biases start constant: make them matter too
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.2)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(DIPTYCH_TINY.tokenizer_dir).save_pretrained(directory)


BATCH = prompts(PROMPT_LENGTHS, salt=5)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    config_class, settings, windows = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    _save_random_model(config_class(**{**COMMON, **settings}), directory)
    model = load_model(request.param, str(directory)).model
    references = {tuple(p): _generate(model, p, OUTPUT_TOKENS) for p in BATCH}
    for output in references.values():
        assert len(set(output)) > OUTPUT_TOKENS // 4, f"{request.param}: greedy text too repetitive to compare"
    return Family(model, windows, references)


def test_each_layer_sees_as_far_back_as_transformers_lets_it(family):
    assert [layer.window for layer in decoder_of(family.model).layers] == family.windows
    if any(family.windows):  # the window changes generate's tokens here, so serving must honour it
        with _windows_off(family.model.config):
            unwindowed = [_generate(family.model, p, OUTPUT_TOKENS) for p in BATCH]
        assert unwindowed != [family.reference(p) for p in BATCH]


@contextmanager
def _windows_off(config):
    """Every layer of generate's model attends to all earlier keys, for the duration."""
    name = "layer_types" if hasattr(config, "layer_types") else "sliding_window"
    saved = getattr(config, name)
    setattr(config, name, ["full_attention"] * len(saved) if name == "layer_types" else None)
    try:
        yield
    finally:
        setattr(config, name, saved)


async def test_split_serving_matches_generate(family, executor):
    prefill = Worker(Role.PREFILL, family.model, executor, allow_shm=False)
    decode = Worker(Role.DECODE, family.model, executor, allow_shm=False)
    await prefill.start()
    await decode.start()
    try:
        calls = (split(prefill, decode, f"r{i}", p, OUTPUT_TOKENS) for i, p in enumerate(BATCH))
        results = await asyncio.gather(*calls)
    finally:
        await prefill.stop()
        await decode.stop()
    for prompt, (prefill_events, rest) in zip(BATCH, results, strict=True):
        assert prefill_events[1].kv_delivered.kv_bytes > 0  # the KV went over the data path
        assert [prefill_events[0].first_token.token_id] + [e.token_id for e in rest] == family.reference(prompt)


async def test_colocated_serving_matches_generate(family, executor):
    worker = Worker(Role.COLOCATED, family.model, executor, allow_shm=False)
    await worker.start()

    async def generate(request_id: str, prompt: list[int]) -> list[int]:
        work = worker_pb2.GenerateWork(request_id=request_id, prompt_token_ids=prompt, sampling=sampling(OUTPUT_TOKENS))
        return [e.token_id async for e in worker.stub.Generate(work)]

    try:
        outputs = await asyncio.gather(*(generate(f"g{i}", p) for i, p in enumerate(BATCH)))
    finally:
        await worker.stop()
    assert outputs == [family.reference(p) for p in BATCH]


async def test_padded_decode_steps_match_generate(family, executor):
    """The fixed-shape decode step that CUDA graphs capture: windows masked on the device from positions."""
    spec = DecodeGraphSpec(max_batch=4, max_blocks=16, capture=False)
    runner = ModelRunner(family.model, num_blocks=128, block_size=16, decode_graphs=spec)
    padded_steps = []
    run = runner.decode_graphs.run
    runner.decode_graphs.run = lambda inputs: padded_steps.append(len(inputs)) or run(inputs)
    engine = Engine(runner, EngineConfig(num_kv_blocks=128, token_budget=64), StopCriteria(frozenset(), 1024), executor)
    task = asyncio.get_running_loop().create_task(engine.run())
    try:
        outputs, _ = await run_all(engine, BATCH, [OUTPUT_TOKENS] * len(BATCH))
    finally:
        task.cancel()
    assert outputs == [family.reference(p) for p in BATCH]
    assert sum(padded_steps) > OUTPUT_TOKENS


def _gpt2(directory) -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=32, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(directory)


REFUSED = {
    "gpt2": (
        _gpt2,
        r"architecture GPT2LMHeadModel \(model_type 'gpt2'\) is not supported; supported: LlamaForCausalLM",
    ),
    "gemma2": (
        lambda d: Gemma2Config(**COMMON, architectures=["Gemma2ForCausalLM"]).save_pretrained(d),
        r"architecture Gemma2ForCausalLM \(model_type 'gemma2'\) is not supported; supported: .*GemmaForCausalLM",
    ),
    "llama-dynamic-rope": (
        lambda d: LlamaConfig(
            **COMMON, architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "dynamic", "factor": 2.0}
        ).save_pretrained(d),
        r"LlamaForCausalLM with this config is not supported: rope_type 'dynamic' rescales",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_other_architectures_are_refused_at_load_before_their_weights_are_read(name, tmp_path):
    save, message = REFUSED[name]
    save(tmp_path)
    AutoTokenizer.from_pretrained(DIPTYCH_TINY.tokenizer_dir).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights: a loader that reads them fails otherwise")
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(name, str(tmp_path))


def test_a_runner_refuses_a_model_of_another_family_by_name():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match=r"architecture GPT2LMHeadModel .* is not supported"):
        ModelRunner(model, num_blocks=4, block_size=16)
