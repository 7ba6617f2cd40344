"""The decoder's linear projections as `workers.models.decoder` calls them: those that read the same
input are stacked into one matrix (queries, keys and values; the MLP's gate and up), and on CPU each
matrix is laid out once for the GEMM that is quicker for its size.

On CPU, `nn.Linear`'s GEMM re-packs the weight on every call, which costs most when few rows multiply
it, as in a decode step (`python -m bench.step_costs` compares the two on the LM head). A large matrix is
therefore reordered into oneDNN's blocked layout, small ones too.

`torch.mm` on a transposed copy (the `mm` layout) multiplies a small matrix 1.35-4.2x quicker, since oneDNN
spends 40-60 µs a call looking up its primitive, but it is not chosen: on AMD EPYC, MKL's GEMM gives a row
other bits when 4 or more rows share the product than when 1 to 3 do, so a sequence's logits would depend on
its batch (greedy parity with `generate` rests on them not doing so). oneDNN's are the same bits whatever the
row count, on the Intel and AMD machines tested. `bench.step_costs` still prints both layouts per shape.
The laid-out weights are a copy; the model's own modules keep theirs.
"""

import torch
import torch.nn.functional as F


class Projection:
    """x @ W.T + b for one or more `nn.Linear` of the same input, their outputs side by side."""

    def __init__(self, *linears: torch.nn.Linear, gemm: str | None = None) -> None:
        """`gemm`: the layout to use instead of the one `gemm_for` picks (`bench.step_costs` compares them)."""
        self.sizes = [linear.out_features for linear in linears]
        weights = [linear.weight.detach() for linear in linears]
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.bias = _stacked_bias(linears)
        self.gemm = gemm or gemm_for(weight)
        if self.gemm == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        elif self.gemm == "mm":
            self.weight = weight.t().contiguous()  # [in, out]: what torch.mm multiplies fastest
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm == "onednn":
            projected: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return projected
        if self.gemm == "mm":
            if x.dim() != 2:  # the decoder's packed tokens are 2-d; anything else is flattened around the product
                return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
            if x.shape[0] == 1:
                # BLAS sends a one-row product to gemv, which sums in another order than its GEMM: as two
                # rows, a token's result does not depend on how many tokens share its step
                return self(x.expand(2, -1))[:1]
            return torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Applies the stacked projection and returns each linear's output."""
        outputs: tuple[torch.Tensor, ...] = self(x).split(self.sizes, dim=-1)
        return outputs


def gemm_for(weight: torch.Tensor) -> str:
    """How a matrix is multiplied: `onednn` for CPU float32 where oneDNN is built in, else `linear`."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return "onednn"
    return "linear"


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
