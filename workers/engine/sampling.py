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

All of it runs on the logits' device, the rows together: only the picks and the logprobs asked for cross
to the host, once a step.
"""

import math
from dataclasses import dataclass

import torch

from workers.models.device_values import on_device

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
        ids = on_device([token_id for token_id, _ in params.logit_bias], row.device)
        bias = on_device([value for _, value in params.logit_bias], row.device, row.dtype)
        row.index_add_(0, ids, bias)
    if output_token_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        ids, counts = on_device(output_token_ids, row.device).unique(return_counts=True)
        penalty = params.frequency_penalty * counts.to(row.dtype) + params.presence_penalty
        row.index_add_(0, ids, -penalty)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, tops: list[int]) -> list[TokenLogprobs]:
    """Per row of logits [rows, vocab]: the logprob of its token (`token_ids` [rows], on the logits' device)
    under the row's softmax, and its `tops[row]` most likely tokens'. One copy to the host for all rows."""
    logprobs = torch.log_softmax(torch.nan_to_num(logits.float(), nan=-math.inf), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=MIN_LOGPROB).clamp(min=MIN_LOGPROB)  # NaN: a row ruled out whole
    picked = logprobs.gather(1, token_ids.view(-1, 1))
    widest = min(max(tops, default=0), logprobs.shape[-1])
    if widest > 0:
        values, ids = torch.topk(logprobs, widest)
        host = torch.cat([picked, values, ids.to(values.dtype)], dim=1).tolist()  # ids < 2**24: exact in float32
    else:
        host = picked.tolist()
    return [
        TokenLogprobs(row[0], tuple(zip(map(int, row[1 + widest : 1 + widest + top]), row[1 : 1 + top], strict=True)))
        for row, top in zip(host, tops, strict=True)
    ]


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Per row of logits [batch, vocab], on their device: whether every value is finite."""
    return torch.isfinite(logits).all(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]) -> list[int]:
    """Picks one token per row of logits [batch, vocab]; token_indices[i] is the index of the token
    being sampled in row i's output (0 for the first)."""
    return draw(logits, params, token_indices).tolist()


def draw(logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]) -> torch.Tensor:
    """As `sample`, on the logits' device: the picks [batch] stay there, nothing waits for them. The rows
    that draw are handled together: scaled, cut to their top-k and top-p, then each unseeded row draws
    from its distribution by one uniform number against its cumulative sum (one number a row, not one a
    token); a seeded row draws from a generator of its own (`_seeded_draw`)."""
    greedy = [row for row, p in enumerate(params) if p.greedy]
    if len(greedy) == len(params):
        return _argmax(logits)
    picks = torch.empty(len(params), dtype=torch.long, device=logits.device)
    if greedy:
        rows = on_device(greedy, logits.device)
        picks[rows] = _argmax(logits[rows])
    drawing = [row for row, p in enumerate(params) if not p.greedy]
    if not drawing:
        return picks
    chosen = [params[row] for row in drawing]
    drawing_rows = on_device(drawing, logits.device)
    probs = _distributions(logits if len(drawing) == len(params) else logits[drawing_rows], chosen)
    seeded = [(row, p.seed) for row, p in enumerate(chosen) if p.seed is not None]
    unseeded = [row for row, p in enumerate(chosen) if p.seed is None]
    drawn = torch.empty(len(drawing), dtype=torch.long, device=logits.device)
    if unseeded:
        unseeded_rows = on_device(unseeded, logits.device)
        drawn[unseeded_rows] = _inverse_cdf_draws(probs if not seeded else probs[unseeded_rows])
    for row, seed in seeded:
        drawn[row] = _seeded_draw(probs[row], seed, token_indices[drawing[row]])
    picks[drawing_rows] = drawn
    return picks


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax that never picks a NaN (torch's treats NaN as the largest value)."""
    return torch.nan_to_num(logits, nan=-math.inf).argmax(dim=-1)


def _distributions(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows of logits, each with its sampling parameters → unnormalized probabilities after temperature,
    top-k and top-p (a row's mass outside its top-p is zero; the draws normalize)."""
    temperature = on_device([p.temperature for p in params], logits.device, logits.dtype)
    scaled = logits / temperature[:, None]
    top_ks = [p.top_k for p in params]
    probs = _softmax_top_k(scaled, top_ks)
    # A row holding NaN or +inf, or nothing above -inf, is NaN throughout after softmax. Such rows are
    # made over from sanitized logits: on the host only when there is one (the check is free there); on a
    # device always, as asking would wait for the step.
    broken = probs[:, :1].isnan()
    if probs.device.type != "cpu" or bool(broken.any()):
        probs = torch.where(broken, _softmax_top_k(_sanitized(scaled), top_ks), probs)
    cut = [row for row, p in enumerate(params) if p.top_p < 1.0]
    if cut:
        cut_rows = on_device(cut, probs.device)
        probs[cut_rows] = _top_p(probs[cut_rows], [params[row].top_p for row in cut])
    return probs


def _softmax_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    if any(k > 0 for k in top_ks):
        logits = _top_k(logits, top_ks)
    return torch.softmax(logits, dim=-1)


def _top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Each row keeps the logits at least its k-th largest (k = 0: all of them)."""
    vocab = logits.shape[-1]
    clipped = [min(k, vocab) for k in top_ks]
    ks = on_device(clipped, logits.device)
    largest = torch.topk(logits, max(clipped)).values
    kth = largest.gather(1, (ks - 1).clamp(min=0)[:, None])
    return logits.masked_fill((logits < kth) & (ks > 0)[:, None], -math.inf)


def _top_p(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Each row keeps its most likely tokens until their mass before the next reaches its top_p; the most
    likely token is always kept, whatever top_p is."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside = before >= on_device(top_ps, probs.device, probs.dtype)[:, None]
    outside[:, 0] = False
    sorted_probs[outside] = 0.0
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _inverse_cdf_draws(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of unnormalized probabilities: the first token whose cumulative mass exceeds a
    uniform fraction of the row's total. A token of zero mass adds nothing to the sum, so it is never the
    first to exceed it; the fraction is kept below the total so that some token always does."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device) * total
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).view(-1)


def _seeded_draw(probs: torch.Tensor, seed: int, token_index: int) -> torch.Tensor:
    """A seeded row's draw from a generator seeded by (seed, token index), on the row's device."""
    generator = torch.Generator(device=probs.device).manual_seed(((seed * _SEED_MIX) + token_index) & _MASK63)
    return torch.multinomial(probs, 1, generator=generator)[0]


def _sanitized(logits: torch.Tensor) -> torch.Tensor:
    """Rows of scaled logits that softmax turns into distributions: NaN never drawn; in a row holding a
    +inf, the +inf values alone, equally likely; in a row with no value left, every token equally likely."""
    positive_infinite = torch.isposinf(logits)
    has_positive_infinite = positive_infinite.any(dim=-1, keepdim=True)
    logits = torch.nan_to_num(logits, nan=-math.inf, neginf=-math.inf, posinf=0.0)
    logits = torch.where(has_positive_infinite, torch.where(positive_infinite, 0.0, -math.inf), logits)
    return torch.where(torch.isneginf(logits).all(dim=-1, keepdim=True), 0.0, logits)


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
