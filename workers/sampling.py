"""Sampling parameters and the sampler.

A seeded sequence draws each token from a generator seeded by (seed, token index), so its output
depends neither on the batch it ran in nor on which worker produced which token.

The sampler never fails on numbers: a temperature too small to divide by (or not a number) samples
greedily, NaN logits are never picked, infinite ones share the whole probability, and every pick is a
token of the vocabulary. Whether a row of logits is fit to sample at all is the engine's call
(`finite_rows`): a sequence whose logits are not finite fails alone.

Before sampling, a request's own controls change its row (`adjust_logits`: logit_bias, then the
presence and frequency penalties over its output so far); its logprobs are taken from that row, before
temperature, top-k and top-p (`token_logprobs`).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: bool = False  # each token comes with its logprob
    top_logprobs: int = 0  # ... and this many of the most likely tokens

    @property
    def greedy(self) -> bool:
        # `not >=` so that a NaN temperature is greedy too
        return not self.temperature >= MIN_SAMPLING_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether logit_bias or a penalty changes the logits before sampling."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's logprob and the most likely tokens' (most likely first), under the distribution
    after logit_bias and penalties, before temperature, top-k and top-p."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)


# The lowest logprob reported: a token ruled out (-inf) is reported at it, as JSON holds no infinity.
MIN_LOGPROB = -9999.0


def adjust_logits(row: torch.Tensor, output_token_ids: list[int], params: SamplingParams) -> None:
    """In place, on one row of logits [vocab]: adds logit_bias, then takes off the penalties as OpenAI
    defines them, `frequency_penalty * count + presence_penalty * (count > 0)`, where count is how often
    the token occurs in `output_token_ids` (the request's output so far, never its prompt)."""
    if params.logit_bias:
        ids = torch.tensor([token_id for token_id, _ in params.logit_bias], device=row.device)
        bias = torch.tensor([value for _, value in params.logit_bias], dtype=row.dtype, device=row.device)
        row.index_add_(0, ids, bias)
    if output_token_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        ids, counts = torch.tensor(output_token_ids, device=row.device).unique(return_counts=True)
        penalty = params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty
        row.index_add_(0, ids, -penalty)


def token_logprobs(row: torch.Tensor, token_id: int, top: int) -> TokenLogprobs:
    """`token_id`'s logprob under the softmax of one row of logits [vocab], and the `top` most likely."""
    logprobs = torch.log_softmax(torch.nan_to_num(row.float(), nan=-math.inf), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=MIN_LOGPROB).clamp(min=MIN_LOGPROB)  # NaN: a row ruled out whole
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(float(logprobs[token_id]), best)


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
