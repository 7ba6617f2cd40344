"""The architectures the runner serves, and the refusal of every other before its weights are read.

A family names its `transformers` class (as config.json's `architectures` lists it) and model_type, says
which of its layers see through a sliding window and how far, whether its attention normalises queries and
keys per head, and which settings of its config it cannot serve. The rest of what sets the families apart
lives in the model's own modules and weights, which the decoder calls or stacks as they are: Gemma's
embedding scaled by sqrt(hidden_size), its norms weighing by 1 + w and its gelu MLP; Qwen2's q/k/v biases.

Gemma2 and Gemma3 are refused: they soft-cap attention scores and logits, add norms around attention and
the MLP, scale queries by `query_pre_attn_scalar` and alternate window sizes (and rotary bases) by layer,
none of which this decoder does.
"""

from collections.abc import Callable
from dataclasses import dataclass

from transformers import (
    GemmaForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

from workers.models.attention import Window
from workers.models.decoder import Decoder, pre_norm_decoder


class UnsupportedModelError(ValueError):
    """A model the runner cannot serve exactly; raised at load, before its weights are read."""


# A model of a supported family, as `transformers` builds it.
ServedModel = LlamaForCausalLM | MistralForCausalLM | Qwen2ForCausalLM | Qwen3ForCausalLM | GemmaForCausalLM


def _no_window(config: PreTrainedConfig) -> list[Window]:
    return [None] * config.num_hidden_layers


def _window_on_every_layer(config: PreTrainedConfig) -> list[Window]:
    """Mistral: `sliding_window` (None: no window) on every layer."""
    return [config.sliding_window] * config.num_hidden_layers


def _window_by_layer_type(config: PreTrainedConfig) -> list[Window]:
    """Qwen2, Qwen3: `sliding_window` on the layers `layer_types` marks sliding (none unless the config sets
    `use_sliding_window`, in which case the layers from `max_window_layers` on)."""
    return [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]


def _gemma_refusal(config: PreTrainedConfig) -> str | None:
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention makes it attend to later tokens; only causal decoding is served"
    return None


def _no_refusal(_config: PreTrainedConfig) -> str | None:
    return None


@dataclass(frozen=True)
class ModelFamily:
    causal_lm: type[ServedModel]  # the class config.json's `architectures` names
    model_type: str
    windows: Callable[[PreTrainedConfig], list[Window]]  # per layer, from the config
    qk_norm: bool = False
    refusal: Callable[[PreTrainedConfig], str | None] = _no_refusal

    @property
    def architecture(self) -> str:
        return self.causal_lm.__name__

    def check(self, config: PreTrainedConfig) -> None:
        """Raises UnsupportedModelError for a config this family's decoder would not compute exactly."""
        reason = _rope_refusal(config) or self.refusal(config)
        if reason:
            raise UnsupportedModelError(f"{self.architecture} with this config is not supported: {reason}")

    def decoder(self, model: PreTrainedModel) -> Decoder:
        if not isinstance(model, self.causal_lm):  # a class of the same name from elsewhere
            raise UnsupportedModelError(
                f"{type(model).__module__}.{type(model).__qualname__} is not transformers' {self.architecture}"
            )
        return pre_norm_decoder(model, self.windows(model.config), self.qk_norm)


FAMILIES = {
    family.model_type: family
    for family in (
        ModelFamily(LlamaForCausalLM, "llama", _no_window),
        ModelFamily(MistralForCausalLM, "mistral", _window_on_every_layer),
        ModelFamily(Qwen2ForCausalLM, "qwen2", _window_by_layer_type),
        ModelFamily(Qwen3ForCausalLM, "qwen3", _window_by_layer_type, qk_norm=True),
        ModelFamily(GemmaForCausalLM, "gemma", _no_window, refusal=_gemma_refusal),
    )
}

SUPPORTED = ", ".join(f"{family.architecture} ({family.model_type})" for family in FAMILIES.values())


def family_for(model_type: str | None, architectures: list[str] | None) -> ModelFamily:
    """The family of a model_type whose architectures (if named) are all its causal-LM class; raises
    UnsupportedModelError naming what is supported otherwise."""
    family = None if model_type is None else FAMILIES.get(model_type)
    others = [name for name in architectures or [] if family is None or name != family.architecture]
    if family is None or others:
        what = f"architecture {others[0]}" if others else "a model"
        raise UnsupportedModelError(f"{what} (model_type {model_type!r}) is not supported; supported: {SUPPORTED}")
    return family


def decoder_of(model: PreTrainedModel) -> Decoder:
    """The decoder of a loaded model of a supported family; raises UnsupportedModelError otherwise."""
    family = family_for(model.config.model_type, [type(model).__name__])
    family.check(model.config)
    return family.decoder(model)


# Rotary embeddings that rescale with the longest position of the call: over a packed step that is another
# request's, so a request's logits would depend on its batch-mates.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_refusal(config: PreTrainedConfig) -> str | None:
    parameters = getattr(config, "rope_parameters", None) or {}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if isinstance(rope_type, str) and any(kind in rope_type for kind in _LENGTH_DEPENDENT_ROPE):
        return f"rope_type {rope_type!r} rescales positions by the longest sequence in a batch"
    return None
