"""The decoder's projections compute what the model's own linear layers compute."""

import pytest
import torch

from workers.models.families import decoder_of
from workers.projections import Projection


def _linear(inputs: int, outputs: int, bias: bool, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inputs, outputs, bias=bias).eval()


@pytest.mark.parametrize("rows", [1, 7, 130])
@torch.inference_mode()
def test_stacked_projection_matches_each_linear(rows):
    q, k, v = _linear(64, 64, False, 1), _linear(64, 32, False, 2), _linear(64, 32, False, 3)
    x = torch.randn(1, rows, 64)
    outputs = Projection(q, k, v).split(x)
    assert [o.shape[-1] for o in outputs] == [64, 32, 32]
    for out, linear in zip(outputs, (q, k, v), strict=True):
        torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_biases_are_stacked_with_zeros_where_a_linear_has_none():
    with_bias, without = _linear(16, 8, True, 4), _linear(16, 8, False, 5)
    x = torch.randn(3, 16)
    first, second = Projection(with_bias, without).split(x)
    torch.testing.assert_close(first, with_bias(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second, without(x), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_decoder_layer_mlp_matches_the_model_mlp(tiny_model):
    x = torch.randn(5, tiny_model.config.hidden_size)
    expected = tiny_model.model.layers[0].mlp(x)
    # float32 GEMMs that sum in another order: agreement to a few units in the 6th digit of the largest value
    got = decoder_of(tiny_model).layers[0].mlp(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


@torch.inference_mode()
def test_weights_outside_onednn_stay_plain_and_stacked():
    """bfloat16 (as on a GPU) goes through F.linear on the stacked weight."""
    gate, up = _linear(32, 48, False, 6).to(torch.bfloat16), _linear(32, 48, False, 7).to(torch.bfloat16)
    projection = Projection(gate, up)
    assert projection.weight.dtype == torch.bfloat16 and projection.weight.shape == (96, 32)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    first, second = projection.split(x)
    torch.testing.assert_close(first, gate(x))
    torch.testing.assert_close(second, up(x))
