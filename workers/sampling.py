"""Sampling parameters and the sampler.

A seeded sequence draws each token from a generator seeded by (seed, token index), so its output
depends neither on the batch it ran in nor on which worker produced which token.

The sampler never fails on numbers: a temperature too small to divide by (or not a number) samples
greedily, NaN logits are never picked, infinite ones share the whole probability, and every pick is a
token of the vocabulary. Whether a row of logits is fit to sample at all is the engine's call
(`finite_rows`): a sequence whose logits are not finite fails alone.
"""

import math
from dataclasses import dataclass

import torch

_SEED_MIX = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1

# Below this temperature sampling is greedy: logits divided by it would overflow float32, and the
# distribution is already a point mass on the argmax (vLLM draws the same line).
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    tokens_already_generated: int = 0  # produced before this call (decode migration): seeded draws continue

    @property
    def greedy(self) -> bool:
        # `not >=` so that a NaN temperature is greedy too
        return not self.temperature >= MIN_SAMPLING_TEMPERATURE


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Per row of logits [batch, vocab]: whether every value is finite."""
    return torch.isfinite(logits).all(dim=-1).tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]) -> list[int]:
    """Picks one token per row of logits [batch, vocab]; token_indices[i] is the index of the token
    being sampled in row i's output (0 for the first)."""
    greedy_ids = _argmax(logits).tolist()
    return [
        greedy_ids[row] if p.greedy else _sample_row(logits[row], p, token_indices[row]) for row, p in enumerate(params)
    ]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax that never picks a NaN (torch's treats NaN as the largest value)."""
    return torch.nan_to_num(logits, nan=-math.inf).argmax(dim=-1)


def _sample_row(logits: torch.Tensor, params: SamplingParams, token_index: int) -> int:
    logits = _sanitized(logits / params.temperature)
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        outside = before >= params.top_p
        outside[0] = False  # the most likely token is always kept, whatever top_p is
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(((params.seed * _SEED_MIX) + token_index) & _MASK63)
    return int(torch.multinomial(probs, 1, generator=generator))


def _sanitized(logits: torch.Tensor) -> torch.Tensor:
    """Scaled logits that softmax turns into a distribution: NaN never drawn; if any value is +inf, the
    +inf values alone, equally likely; if none is left, every token equally likely."""
    positive_infinite = torch.isposinf(logits)
    if positive_infinite.any():
        return torch.zeros_like(logits).masked_fill(~positive_infinite, -math.inf)
    logits = torch.nan_to_num(logits, nan=-math.inf, neginf=-math.inf)
    if torch.isneginf(logits).all():
        return torch.zeros_like(logits)
    return logits


@dataclass(frozen=True)
class StopCriteria:
    eos_token_ids: frozenset[int]
    context_length: int

    def check(
        self, token_id: int, num_output_tokens: int, prompt_length: int, params: SamplingParams
    ) -> tuple[bool, bool]:
        """(finished, finished_by_eos) after `token_id` became output token number `num_output_tokens`."""
        by_eos = token_id in self.eos_token_ids and not params.ignore_eos
        finished = (
            by_eos or num_output_tokens >= params.max_tokens or prompt_length + num_output_tokens >= self.context_length
        )
        return finished, by_eos
