"""Tensor parallelism's split of a decoder's weights over the ranks of a group (Megatron style).

Each rank keeps a slice of every attention and MLP projection: the rows of queries, keys and values of
its own heads (query heads and kv heads both split evenly, so each rank's queries read only its own kv
heads), the input columns of o that those heads produce, the rows of gate and up of its share of the
MLP's intermediate units, and the matching input columns of down. o and down then yield partial sums on
every rank, which the decoder adds up with an all-reduce (`DecoderLayer.all_reduce`). Embedding, norms,
rotary embedding and LM head stay whole on every rank: they are small next to the layers, and every rank
then holds the same hidden states between layers.

The slicing is done on the loaded model's own linear layers, on the host, before the decoder is built
from them and before the model moves to its device: no rank ever holds (or stacks, or reorders) another
rank's part, so a model larger than one device fits on several.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from workers.models.decoder import Decoder, PreNormCausalLM


class ShardingError(ValueError):
    """The model cannot be split over that many ranks."""


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group."""

    rank: int
    degree: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the group, in place, and returns it


def head_counts(config: PreTrainedConfig) -> tuple[int, int, int]:
    """The model's query heads, kv heads and head size."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def check_shardable(config: PreTrainedConfig, degree: int) -> None:
    """Raises ShardingError unless the heads, kv heads and MLP units split evenly over `degree` ranks."""
    if degree < 1:
        raise ShardingError(f"the tensor-parallel degree must be 1 or more, not {degree}")
    heads, kv_heads, _ = head_counts(config)
    if degree > kv_heads:
        raise ShardingError(
            f"a tensor-parallel degree of {degree} exceeds the model's {kv_heads} kv heads (each rank needs "
            f"kv heads of its own; replicating them is not supported): use a degree that divides {kv_heads}"
        )
    for what, count in (
        ("attention heads", heads),
        ("kv heads", kv_heads),
        ("MLP intermediate units", config.intermediate_size),
    ):
        if count % degree:
            raise ShardingError(
                f"the model's {count} {what} do not split evenly over a tensor-parallel degree of {degree}: "
                f"use a degree that divides the {heads} attention heads and {kv_heads} kv heads"
            )


def shard_model(model: PreTrainedModel, rank: int, degree: int) -> None:
    """Keeps, in place, only rank `rank`'s slice of every attention and MLP projection of a Llama-shaped
    causal LM (the families of `workers.models.families`). The model is no longer a whole model afterwards:
    only `workers.models.decoder` runs it, with an all-reduce after o and down."""
    config = model.config
    check_shardable(config, degree)
    if not 0 <= rank < degree:
        raise ShardingError(f"rank {rank} is not a rank of a tensor-parallel group of {degree}")
    heads, kv_heads, head_dim = head_counts(config)
    query_rows = _part(heads * head_dim, rank, degree)
    kv_rows = _part(kv_heads * head_dim, rank, degree)
    units = _part(config.intermediate_size, rank, degree)
    for layer in cast(PreNormCausalLM, model).model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep_rows(attn.q_proj, query_rows)
        _keep_rows(attn.k_proj, kv_rows)
        _keep_rows(attn.v_proj, kv_rows)
        _keep_columns(attn.o_proj, query_rows, keep_bias=rank == 0)
        _keep_rows(mlp.gate_proj, units)
        _keep_rows(mlp.up_proj, units)
        _keep_columns(mlp.down_proj, units, keep_bias=rank == 0)


def check_sharded(decoder: Decoder, config: PreTrainedConfig, degree: int) -> None:
    """Raises ShardingError unless the decoder was built from a model sharded for `degree` ranks."""
    heads, kv_heads, head_dim = head_counts(config)
    expected = [heads // degree * head_dim, kv_heads // degree * head_dim, kv_heads // degree * head_dim]
    found = decoder.layers[0].qkv.sizes
    if found != expected:
        raise ShardingError(
            f"the model's query, key and value projections have {found} rows, not the {expected} of one rank "
            f"of {degree}: shard it with workers.models.sharding.shard_model before building its runner"
        )


def with_all_reduce(decoder: Decoder, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> Decoder:
    """The decoder whose layers sum their o and down outputs over the group."""
    return replace(decoder, layers=[replace(layer, all_reduce=all_reduce) for layer in decoder.layers])


def _part(size: int, rank: int, degree: int) -> slice:
    step = size // degree
    return slice(rank * step, (rank + 1) * step)


def _keep_rows(linear: nn.Linear, rows: slice) -> None:
    linear.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    linear.out_features = rows.stop - rows.start


def _keep_columns(linear: nn.Linear, columns: slice, keep_bias: bool) -> None:
    """Input columns: the output is a partial sum, so the bias is added by one rank only."""
    linear.weight = nn.Parameter(linear.weight.detach()[:, columns].clone(), requires_grad=False)
    if linear.bias is not None and not keep_bias:
        linear.register_parameter("bias", None)
    linear.in_features = columns.stop - columns.start
