"""The README's "Serving a local Hugging Face model directory", step by step: a directory written by
`diptych model save`, put in the catalog by `diptych model register`, served by a prefill and a decode
worker started with `--model-source DIR`, and a request through the SDK whose tokens equal `transformers`
`generate` on that directory.

The saved weights are then replaced by another tiny Llama (its own shape, seed and context length), as a
user's own model would be: only that directory's weights give its tokens, and only its config its context.
Its own platform, with no worker of the built-in model.
"""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import diptych
from diptych_server.stack import Stack, free_port
from tests.e2e.conftest import own_database
from tests.e2e.test_generation import generate_reference
from tests.e2e.waiting import wait_for

MODEL = "my-llama"
OWN_CONTEXT_LENGTH = 512  # diptych-tiny's is 1024
PROMPT = "A model directory on local disk serves like any other: catalog entry, two workers, and a request."


def diptych_command(stack: Stack, *args: str) -> str:
    """Runs `diptych ARGS` in the platform's environment (its database, as on the control plane's host)."""
    result = subprocess.run(
        [sys.executable, "-m", "diptych_server.cli", *args], env=stack.env(), capture_output=True, text=True
    )
    assert result.returncode == 0, f"diptych {' '.join(args)} failed:\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    with own_database(tmp_path_factory.mktemp("local-model-db")) as database_url:
        stack = Stack(tmp_path_factory.mktemp("local-model"), control_plane_port=free_port(), database_url=database_url)
        try:
            credentials = stack.prepare_control_plane(demo=True)
            stack.start_control_plane()
            gateway_port = free_port()
            stack.start_gateway("gateway", gateway_port, free_port(), "split", http_port=free_port())
            yield stack, credentials.api_key, f"grpc://127.0.0.1:{gateway_port}"
        finally:
            stack.stop()


def test_a_saved_model_directory_registered_and_served_matches_generate(platform, tmp_path):
    stack, api_key, gateway = platform
    directory = tmp_path / MODEL
    diptych_command(stack, "model", "save", "diptych-tiny", str(directory))
    replace_weights_with_another_model(directory)
    registered = json.loads(diptych_command(stack, "model", "register", MODEL, str(directory), "--json"))
    assert registered["source"] == str(directory.resolve())

    for role in ("prefill", "decode"):
        stack.start_worker(
            f"{MODEL}-{role}",
            role,
            registered["fleet_tokens"][role],
            free_port(),
            "--model",
            MODEL,
            "--model-source",
            str(directory),
        )
    prefill, decode = stack.wait_for_workers([f"{MODEL}-prefill", f"{MODEL}-decode"])

    with diptych.Client(api_key=api_key, base_url=gateway) as client:
        assert wait_for(lambda: MODEL in {model.id for model in client.models.list()}), "the gateway never listed it"
        (listed,) = [model for model in client.models.list() if model.id == MODEL]
        completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert listed.context_length == OWN_CONTEXT_LENGTH

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    prompt_ids = AutoTokenizer.from_pretrained(directory)(PROMPT)["input_ids"]
    assert len(prompt_ids) > 32, "long enough to run split (the gateway's --skip-split-below)"
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.token_ids == generate_reference(model, prompt_ids, 24)
    assert (completion.usage.prefill.worker_id, completion.usage.decode.worker_id) == (prefill["id"], decode["id"])
    assert completion.usage.prefill.kv_bytes > 0


def replace_weights_with_another_model(directory: Path) -> None:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=OWN_CONTEXT_LENGTH,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(directory)


def test_registering_a_directory_without_a_config_is_refused_and_changes_nothing(platform, tmp_path):
    stack, api_key, _gateway = platform
    result = subprocess.run(
        [sys.executable, "-m", "diptych_server.cli", "model", "register", "empty", str(tmp_path)],
        env=stack.env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert f"{tmp_path} is not a Hugging Face model directory (no config.json)" in result.stderr
    catalog = httpx.get(f"{stack.control_plane_url}/api/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    assert catalog.status_code == 200
    assert "empty" not in {model["name"] for model in catalog.json()["data"]}
