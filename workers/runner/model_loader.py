"""Loads a model for serving: a built-in model from its config and seed, or a local Hugging Face directory
of a supported family (`workers.models.families`; any other is refused before its weights are read)."""

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedConfig

from diptych_common.builtin import BuiltinModel, builtin_model_for
from workers.models.families import ModelFamily, ServedModel, UnsupportedModelError, family_for

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    model: ServedModel
    tokenizer: object
    eos_token_ids: frozenset[int]
    context_length: int


def build_builtin_model(builtin: BuiltinModel, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    config = LlamaConfig(**builtin.llama_config)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(builtin.seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    # PreTrainedModel.to is functools.wraps(nn.Module.to), which typeshed types as a callable that binds no self.
    moved: LlamaForCausalLM = model.to(dtype)  # type: ignore[arg-type]
    return moved


def load_model(name: str, source: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    started = time.monotonic()
    log.info("loading model %s from %s", name, source)
    builtin = builtin_model_for(source)
    model: ServedModel
    if builtin is not None:
        model = build_builtin_model(builtin, dtype)
        tokenizer = AutoTokenizer.from_pretrained(builtin.tokenizer_dir)
    else:
        path = Path(source)
        family, config = _supported_family(path)
        model = family.causal_lm.from_pretrained(path, config=config, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval()  # type: ignore[no-untyped-call, unused-ignore]  # the model classes type eval as unannotated
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = frozenset(eos if isinstance(eos, list) else [eos]) if eos is not None else frozenset()
    parameters = sum(p.numel() for p in model.parameters())
    log.info(
        "loaded %s: %.1f M parameters, %s, in %.1f s",
        name,
        parameters / 1e6,
        dtype,
        time.monotonic() - started,
    )
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=eos_ids,
        context_length=model.config.max_position_embeddings,
    )


def _supported_family(path: Path) -> tuple[ModelFamily, PreTrainedConfig]:
    """The family and config of a model directory whose family the runner serves; raises
    UnsupportedModelError (naming what is supported) for any other, having read nothing but config.json."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        declared = json.loads(config_file.read_text())
        if not isinstance(declared, dict):
            raise ValueError("config.json holds no JSON object")
        family = family_for(declared.get("model_type"), declared.get("architectures"))
        config = AutoConfig.from_pretrained(path)
        family.check(config)
    except UnsupportedModelError as error:
        raise UnsupportedModelError(f"cannot serve {path}: {error}") from None
    except ValueError as error:  # JSON or transformers refusing the config
        raise ValueError(f"cannot serve {path}: its config.json does not load: {error}") from None
    return family, config


def save_builtin_model(name: str, directory: Path) -> None:
    """Writes a built-in model as a standard Hugging Face model directory."""
    builtin = builtin_model_for(f"builtin:{name}")
    assert builtin is not None  # a builtin: source names a built-in model or raises
    model = build_builtin_model(builtin)
    model.generation_config.do_sample = False
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(builtin.tokenizer_dir).save_pretrained(directory)
