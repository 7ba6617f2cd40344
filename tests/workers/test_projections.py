"""The decoder's projections and norms compute what the model's own modules compute."""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from workers.models.decoder import fused_norm
from workers.models.families import decoder_of
from workers.models.projections import Projection, gemm_for


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


@pytest.mark.parametrize("rows", [1, 9, 300])
@torch.inference_mode()
def test_each_cpu_gemm_computes_the_linear(rows):
    """The runner's layout (oneDNN's packed one, small matrices too) and the `mm` layout the benchmark compares
    it with both compute what the module does, with its bias."""
    small, large = _linear(256, 512, True, 8), _linear(1024, 600, True, 9)
    assert gemm_for(small.weight) == gemm_for(large.weight) == "onednn"
    for linear, gemm in ((small, None), (large, None), (small, "mm")):
        x = torch.randn(rows, linear.in_features)
        got = Projection(linear, gemm=gemm)(x)
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(Projection(linear, gemm=gemm)(x[None])[0], got)


@pytest.mark.parametrize("norm_class", [LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm])
@pytest.mark.parametrize("width", [64, 256, 768])
@torch.inference_mode()
def test_a_llama_style_norm_fuses_to_exactly_what_the_module_computes(norm_class, width):
    norm = norm_class(width, eps=1e-6)
    torch.manual_seed(width)
    norm.weight.data = torch.randn(width)
    x = torch.randn(37, width) * 3
    fused = fused_norm(norm)
    assert fused is not norm
    assert torch.equal(fused(x), norm(x))  # bit for bit: greedy parity with `generate` rests on it


def test_other_norms_stay_the_model_modules():
    gemma = GemmaRMSNorm(64)  # weighs by 1 + w
    half = LlamaRMSNorm(64).to(torch.bfloat16)
    assert fused_norm(gemma) is gemma and fused_norm(half) is half


@pytest.mark.parametrize("inputs", [256, 1024])
@torch.inference_mode()
def test_a_row_gets_the_same_bits_whatever_shares_its_step(inputs):
    """A token's projection does not depend on how many tokens its step packs (one included), so a
    sequence's logits do not depend on its batch."""
    projection = Projection(_linear(inputs, 600 if inputs == 1024 else 512, True, 10))
    x = torch.randn(40, inputs)
    together = projection(x)
    for rows in (1, 2, 3, 17):
        assert torch.equal(projection(x[:rows]), together[:rows])
