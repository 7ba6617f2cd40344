"""The decoder a step runs: the model's pieces in the order a pre-norm transformer decoder applies them, each
taken once from the loaded `transformers` model (its embedding, norms, rotary embedding and activation are
its own modules, so each family's conventions hold as-is) and its linear layers stacked by
`workers.models.projections`.

`Decoder` works on packed tokens with no batch dimension: hidden [tokens, hidden_size], queries
[tokens, heads, head_dim] (under tensor parallelism, the rank's own heads: `workers.models.sharding`).
It knows nothing of the KV pool: a layer hands its rotated queries and its keys and values to the
`attention` callable the runner passes, which stores them and attends.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from workers.models.attention import Window
from workers.models.projections import Projection

# (layer, query, key, value) → attended [tokens, heads * head_dim]
Attention = Callable[["DecoderLayer", torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(eq=False)
class DecoderLayer:
    index: int
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    qkv: Projection  # queries, keys and values stacked, with their biases if any
    qk_norms: (
        tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None
    )  # per-head norms of queries and keys, before the rotary embedding
    head_dim: int
    scale: float  # of the attention scores
    window: Window  # how many keys back this layer's queries see
    o: Projection
    post_attention_norm: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Projection  # the MLP's gate and up projections stacked
    down: Projection
    act_fn: Callable[[torch.Tensor], torch.Tensor]
    # tensor parallel (`workers.models.sharding`): sums o's and down's partial outputs over the group
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        query, key, value = self._rotated_qkv(self.input_norm(hidden), cos, sin)
        hidden = hidden + self._summed(self.o(attention(self, query, key, value)))
        return hidden + self.mlp(self.post_attention_norm(hidden))

    def _rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries and keys rotated, and values, [tokens, heads, head_dim] each. Without per-head norms the
        queries and keys sit side by side in the projection's output and rotate in one pass."""
        tokens, (query_size, key_size, _) = x.shape[0], self.qkv.sizes
        stacked = self.qkv(x)
        value = stacked[:, query_size + key_size :].view(tokens, -1, self.head_dim)
        if self.qk_norms is None:
            rotated = _rotate(stacked[:, : query_size + key_size].view(tokens, -1, self.head_dim), cos, sin)
            query, key = rotated.split([query_size // self.head_dim, key_size // self.head_dim], dim=1)
            return query, key, value
        query = self.qk_norms[0](stacked[:, :query_size].view(tokens, -1, self.head_dim))
        key = self.qk_norms[1](stacked[:, query_size : query_size + key_size].view(tokens, -1, self.head_dim))
        return _rotate(query, cos, sin), _rotate(key, cos, sin), value

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.split(x)
        return self._summed(self.down(self.act_fn(gate) * up))

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.all_reduce is None else self.all_reduce(partial)


@dataclass(eq=False)
class Decoder:
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids [tokens] → hidden [tokens, hidden_size]
    rotary_embedding: Callable[
        [torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
    ]  # the model's: (hidden [1, tokens, ...], positions [1, tokens]) → cos, sin
    layers: list[DecoderLayer]
    norm: Callable[[torch.Tensor], torch.Tensor]
    lm_head: Projection

    @cached_property
    def windows(self) -> tuple[Window, ...]:
        """The distinct windows of the layers: what a step's attention plan is built for."""
        return tuple(dict.fromkeys(layer.window for layer in self.layers))

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, 1, head_dim], broadcast over the heads."""
        cos, sin = self.rotary_embedding(hidden[None], positions[None])
        return cos[0, :, None], sin[0, :, None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()


# Norms whose forward is Llama's: in float32, what `F.rms_norm` computes in one operator instead of eight
_LLAMA_RMS_NORMS = (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm)


def fused_norm(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A Llama-style RMS norm of float32 weights on the CPU as one `F.rms_norm` call (the same operations, the
    same rounding); any other norm (Gemma's 1 + w, half precision, a GPU's fused kernel) as the module itself."""
    # exactly these classes, since a subclass may compute otherwise (isinstance only narrows the type)
    if type(norm) not in _LLAMA_RMS_NORMS or not isinstance(norm, _LLAMA_RMS_NORMS):
        return norm
    weight: torch.Tensor = norm.weight
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return norm
    return partial(F.rms_norm, normalized_shape=tuple(weight.shape), weight=weight, eps=float(norm.variance_epsilon))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding over halves of the head dimension (as `transformers` applies it: same operations,
    same rounding)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Attention(Protocol):
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: nn.Module  # q_norm and k_norm: only in the families whose qk_norm is set (read only there)
    k_norm: nn.Module
    head_dim: int
    scaling: float


class _Mlp(Protocol):
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    act_fn: nn.Module


class _Layer(Protocol):
    input_layernorm: nn.Module
    self_attn: _Attention
    post_attention_layernorm: nn.Module
    mlp: _Mlp


class _Base(Protocol):
    embed_tokens: nn.Embedding
    rotary_emb: nn.Module
    layers: Sequence[_Layer]
    norm: nn.Module


class PreNormCausalLM(Protocol):
    """The modules of a Llama-shaped `transformers` causal LM that `pre_norm_decoder` takes."""

    model: _Base
    lm_head: nn.Linear


def pre_norm_decoder(model: PreNormCausalLM, windows: list[Window], qk_norm: bool) -> Decoder:
    """The decoder of a Llama-shaped causal LM, one window per layer."""
    base = model.model
    layers = []
    for index, (layer, window) in enumerate(zip(base.layers, windows, strict=True)):
        attn, mlp = layer.self_attn, layer.mlp
        layers.append(
            DecoderLayer(
                index=index,
                input_norm=fused_norm(layer.input_layernorm),
                qkv=Projection(attn.q_proj, attn.k_proj, attn.v_proj),
                qk_norms=(fused_norm(attn.q_norm), fused_norm(attn.k_norm)) if qk_norm else None,
                head_dim=attn.head_dim,
                scale=attn.scaling,
                window=window,
                o=Projection(attn.o_proj),
                post_attention_norm=fused_norm(layer.post_attention_layernorm),
                gate_up=Projection(mlp.gate_proj, mlp.up_proj),
                down=Projection(mlp.down_proj),
                act_fn=mlp.act_fn,
            )
        )
    return Decoder(
        embed=base.embed_tokens,
        rotary_embedding=base.rotary_emb,
        layers=layers,
        norm=fused_norm(base.norm),
        lm_head=Projection(model.lm_head),
    )
