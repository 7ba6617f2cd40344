"""The decoder's linear projections as `workers.models.decoder` calls them: those that read the same
input are stacked into one matrix (queries, keys and values; the MLP's gate and up), and on CPU every
matrix is reordered once into oneDNN's blocked layout.

On CPU, `nn.Linear`'s GEMM re-packs the weight on every call, which costs most when few rows multiply
it, as in a decode step (`python -m bench.step_costs` compares the two on the LM head). The reordered
weights are a copy; the model's own modules keep theirs.
"""

import torch
import torch.nn.functional as F


class Projection:
    """x @ W.T + b for one or more `nn.Linear` of the same input, their outputs side by side."""

    def __init__(self, *linears: torch.nn.Linear) -> None:
        self.sizes = [linear.out_features for linear in linears]
        weights = [linear.weight.detach() for linear in linears]
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.bias = _stacked_bias(linears)
        self._onednn = _onednn_applies(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if self._onednn else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Applies the stacked projection and returns each linear's output."""
        return self(x).split(self.sizes, dim=-1)


def _stacked_bias(linears: tuple[torch.nn.Linear, ...]) -> torch.Tensor | None:
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat(
        [
            linear.bias.detach()
            if linear.bias is not None
            else torch.zeros(linear.out_features, dtype=linear.weight.dtype, device=linear.weight.device)
            for linear in linears
        ]
    )


def _onednn_applies(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
