"""Sampling parameters, stop criteria and the batched draw (the engine's `Sampler`, `workers.engine.sampler`,
calls it once a step with every row).

A seeded sequence draws each token by a fraction hashed from (seed, token index) (`seeded_fraction`), so
its output depends neither on the batch it ran in nor on which worker produced which token.

The sampler never fails on numbers: a temperature too small to divide by (or not a number) samples
greedily, NaN logits are never picked, infinite ones share the whole probability, and every pick is a
token of the vocabulary. Whether a row of logits is fit to sample at all is the engine's call
(`finite_rows`): a sequence whose logits are not finite fails alone.

Before sampling, a request's own controls change its row (the sampler's: logit_bias, then the presence
and frequency penalties over its output so far); its logprobs are taken from that row, before
temperature, top-k and top-p (`logprob_table`).

All of it runs on the logits' device, the rows together, seeded ones among them: only the picks and the
logprobs asked for cross to the host, once a step.
"""

import math
from dataclasses import dataclass

import torch

from workers.models.device_values import on_device

_SEED_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1

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
        return bool(self.logit_bias) or self.penalizes

    @property
    def penalizes(self) -> bool:
        """Whether a presence or frequency penalty counts the output's tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's logprob and the most likely tokens' (most likely first), under the distribution
    after logit_bias and penalties, before temperature, top-k and top-p."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)


# The lowest logprob reported: a token ruled out (-inf) is reported at it, as JSON holds no infinity.
MIN_LOGPROB = -9999.0


def logprob_table(logits: torch.Tensor, token_ids: torch.Tensor, widest: int) -> torch.Tensor:
    """On the logits' device, float32 [rows, 1 + 2 * widest]: per row, its token's logprob, the `widest` highest
    logprobs, then their token ids (below 2**24: exact in float32). `logprobs_of` reads a row of it."""
    logprobs = torch.log_softmax(torch.nan_to_num(logits.float(), nan=-math.inf), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=MIN_LOGPROB).clamp(min=MIN_LOGPROB)  # NaN: a row ruled out whole
    picked = logprobs.gather(1, token_ids.view(-1, 1))
    if widest == 0:
        return picked
    values, ids = torch.topk(logprobs, widest)
    return torch.cat([picked, values, ids.to(values.dtype)], dim=1)


def logprobs_of(row: list[float], top: int) -> TokenLogprobs:
    """A row of `logprob_table`, on the host, as its token's logprobs with the `top` most likely tokens'."""
    widest = (len(row) - 1) // 2
    top = min(top, widest)
    ids = map(int, row[1 + widest : 1 + widest + top])
    return TokenLogprobs(row[0], tuple(zip(ids, row[1 : 1 + top], strict=True)))


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Per row of logits [batch, vocab], on their device: whether every value is finite."""
    return torch.isfinite(logits).all(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]) -> list[int]:
    """Picks one token per row of logits [batch, vocab]; token_indices[i] is the index of the token
    being sampled in row i's output (0 for the first)."""
    return draw(logits, params, token_indices).tolist()


def draw(logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]) -> torch.Tensor:
    """As `sample`, on the logits' device: the picks [batch] stay there, nothing waits for them. The rows
    that draw are handled together: scaled, cut to their top-k and top-p, then each draws from its
    distribution by one fraction against its cumulative sum (one number a row, not one a token): a uniform
    number for an unseeded row, the fraction hashed from its seed and token index for a seeded one."""
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
    picks[drawing_rows] = _inverse_cdf_draws(probs, _fractions(chosen, [token_indices[row] for row in drawing], probs))
    return picks


def _fractions(params: list[SamplingParams], token_indices: list[int], probs: torch.Tensor) -> torch.Tensor:
    """One fraction in [0, 1) per drawing row [rows, 1]: uniform for an unseeded row, `seeded_fraction` for a
    seeded one (computed on the host, sent with the step's other per-row values)."""
    seeded = [(row, p.seed) for row, p in enumerate(params) if p.seed is not None]
    if not seeded:
        return torch.rand(len(params), 1, dtype=probs.dtype, device=probs.device)
    fractions = [seeded_fraction(seed, token_indices[row]) for row, seed in seeded]
    seeded_fractions = on_device(fractions, probs.device, probs.dtype)[:, None]
    if len(seeded) == len(params):
        return seeded_fractions
    uniform = torch.rand(len(params), 1, dtype=probs.dtype, device=probs.device)
    uniform[on_device([row for row, _ in seeded], probs.device)] = seeded_fractions
    return uniform


def seeded_fraction(seed: int, token_index: int) -> float:
    """The fraction in [0, 1) by which a seeded sequence draws its token `token_index`: splitmix64's finalizer
    over (seed, token index), its top 53 bits. Pure integer arithmetic on the host: the same on every worker
    and device, whatever else runs in the batch."""
    mixed = (seed * _SEED_MIX + token_index + _SEED_MIX) & _MASK64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK64
    mixed ^= mixed >> 31
    return (mixed >> 11) * 2.0**-53


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


def _inverse_cdf_draws(probs: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """One draw per row of unnormalized probabilities: the first token whose cumulative mass exceeds the
    row's fraction [rows, 1] of its total. A token of zero mass adds nothing to the sum, so it is never the
    first to exceed it; the target is kept below the total so that some token always does."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(fractions * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).view(-1)


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
