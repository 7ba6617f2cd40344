"""The sampler: called once a step, on the forward thread, with the step's logits and one `SamplingRow` per
row; returns each row's token and, where asked for, its logprobs.

Per row, in order (docs/engine.md, "Sampling controls"):

1. Whether the model's logits are finite (before any change: a grammar's mask is -inf by design).
2. logit_bias is added and the presence and frequency penalties taken off, for all rows together. The
   penalties read a count of each token in the request's output kept on the logits' device
   (`OutputCounts`): made once from the output the request came with, then counted on from each of its
   picks on the device, so no history crosses per step and nothing waits for the device.
3. A grammar masks what it forbids (row by row: llguidance makes the mask on the host).
4. Greedy argmax, or temperature, top-k, top-p and the draw (`workers.engine.sampling.draw`, the seeded
   rows with the rest).

The picks, each row's finite flag and the logprobs asked for cross to the host in one copy: the step's one
wait for the device. A row that is not finite, or whose changes or draw raise, fails its request alone (a
batched call that raises is retried row by row to find the rows that do); rows that are not changed are
sampled from the model's logits as they are, with no copy.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.engine.request import RequestFailed
from workers.engine.sampling import SamplingParams, TokenLogprobs, draw, finite_rows, logprob_table, logprobs_of
from workers.models.device_values import on_device
from workers.structured.masks import apply_grammar_mask
from workers.structured.state import GrammarState

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class SamplingRow:
    """One row of a step's logits as the sampler takes it: made on the event loop when the step is, read on
    the forward thread (so it holds no view of the request's changing state)."""

    request_id: str
    params: SamplingParams
    token_index: int  # the index, in the whole request, of the token it samples (seeded draws go by it)
    # penalties: the request's output so far (`EngineRequest.generated_token_ids`), given with its first row
    # only; from then on the sampler counts its picks itself
    history: tuple[int, ...] | None = None
    constraint: GrammarState | None = None  # structured outputs: its grammar, where it follows one

    @property
    def controlled(self) -> bool:
        """Whether its logits change before sampling (logit_bias, penalties, a grammar's mask)."""
        return self.params.adjusts_logits or self.constraint is not None


@dataclass(frozen=True)
class SampledRow:
    token_id: int | RequestFailed
    logprobs: TokenLogprobs | None = None  # when its request asked for them


class OutputCounts:
    """How often each token occurs in each penalized request's output: one row of a table on the logits'
    device per request, by request id (`forget` gives it back when the request leaves)."""

    def __init__(self) -> None:
        self._table: torch.Tensor | None = None  # [slots, vocab] float32: counts below 2**24 are exact
        self._slots: dict[str, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, row: SamplingRow, like: torch.Tensor) -> int:
        """The row's request's slot (taken on its first row); a row that comes with the request's history
        (re)starts the count from it."""
        slot = self._slots.get(row.request_id)
        if slot is None:
            slot = self._slots[row.request_id] = self._take(like)
        if row.history is not None:
            self._start(slot, row.history)
        return slot

    def of(self, slots: list[int], device: torch.device) -> torch.Tensor:
        """The counts of the slots' requests [len(slots), vocab]."""
        assert self._table is not None
        return self._table[on_device(slots, device)]

    def add(self, slots: list[int], token_ids: torch.Tensor) -> None:
        """Counts one more of each slot's token (`token_ids` on the device: the picks), without waiting."""
        assert self._table is not None
        where = (on_device(slots, token_ids.device), token_ids)
        self._table.index_put_(where, torch.ones_like(token_ids, dtype=self._table.dtype), accumulate=True)

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                self._free.append(slot)

    def _take(self, like: torch.Tensor) -> int:
        if not self._free:
            held = 0 if self._table is None else self._table.shape[0]
            grown = torch.zeros(max(8, 2 * held), like.shape[-1], dtype=torch.float32, device=like.device)
            if self._table is not None:
                grown[:held] = self._table
            self._table = grown
            self._free = list(range(grown.shape[0] - 1, held - 1, -1))
        return self._free.pop()

    def _start(self, slot: int, history: tuple[int, ...]) -> None:
        assert self._table is not None
        row = self._table[slot]
        row.zero_()
        if history:
            ones = torch.ones(len(history), dtype=row.dtype, device=row.device)
            row.index_put_((on_device(list(history), row.device),), ones, accumulate=True)


class Sampler:
    def __init__(self) -> None:
        self.counts = OutputCounts()

    def forget(self, request_ids: list[str]) -> None:
        """The requests left: their output counts go."""
        self.counts.forget(request_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledRow]:
        """Samples row i of `logits` [rows, vocab] (float32, on the step's device) for `rows[i]`."""
        finite = finite_rows(logits)
        slot_of = {index: self.counts.slot(row, logits) for index, row in enumerate(rows) if row.params.penalizes}
        logits, failed = self._controlled(logits, rows, slot_of)
        picks = self._draw(logits, rows, failed)
        if slot_of:  # the output each penalty counts now holds this step's pick
            self.counts.add(list(slot_of.values()), picks[on_device(list(slot_of), logits.device)])
        return self._to_host(logits, rows, picks, finite, failed)

    def _controlled(
        self, logits: torch.Tensor, rows: list[SamplingRow], slot_of: dict[int, int]
    ) -> tuple[torch.Tensor, dict[int, RequestFailed]]:
        """The logits with every controlled row changed, on a copy (the same tensor when no row is), and the
        rows whose change raised: biases and penalties in one go (row by row if that raises), then masks."""
        changed = [index for index, row in enumerate(rows) if row.controlled]
        if not changed:
            return logits, {}
        adjusted = logits.clone()
        failed: dict[int, RequestFailed] = {}
        try:
            _adjust(adjusted, rows, changed, slot_of, self.counts)
        except Exception:
            adjusted = logits.clone()
            for index in changed:
                if failure := _alone(rows, index, lambda i=index: _adjust(adjusted, rows, [i], slot_of, self.counts)):
                    failed[index] = failure
        for index in changed:
            constraint = rows[index].constraint
            if constraint is None or index in failed:
                continue
            if failure := _alone(rows, index, lambda i=index, c=constraint: apply_grammar_mask(adjusted[i], c)):
                failed[index] = failure
        return adjusted, failed

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], failed: dict[int, RequestFailed]) -> torch.Tensor:
        """The picks of all rows, on the logits' device (a row that failed already draws greedily). One batched
        call; if it raises, row by row, so that only the rows that raise fail (they pick token 0)."""
        params = [_GREEDY if index in failed else row.params for index, row in enumerate(rows)]
        indices = [row.token_index for row in rows]
        try:
            return draw(logits, params, indices)
        except Exception:
            picks = []
            for index in range(len(rows)):
                try:
                    picks.append(draw(logits[index : index + 1], params[index : index + 1], indices[index : index + 1]))
                except Exception as error:
                    log.exception("sampling request %s raised", rows[index].request_id)
                    failed[index] = RequestFailed(f"sampling its output token {indices[index]} raised {error!r}")
                    picks.append(torch.zeros(1, dtype=torch.long, device=logits.device))
            return torch.cat(picks)

    def _to_host(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        picks: torch.Tensor,
        finite: torch.Tensor,
        failed: dict[int, RequestFailed],
    ) -> list[SampledRow]:
        """The picks, the finite flags and the logprobs asked for, brought to the host in one copy (as float32:
        token ids below 2**24 are exact)."""
        wanting = [index for index, row in enumerate(rows) if row.params.logprobs and index not in failed]
        parts = [picks.to(torch.float32), finite.to(torch.float32)]
        widest = 0
        if wanting:
            widest = min(max(rows[index].params.top_logprobs for index in wanting), logits.shape[-1])
            wanted = on_device(wanting, logits.device)
            parts.append(logprob_table(logits[wanted], picks[wanted], widest).flatten())
        host = torch.cat(parts).tolist()
        count, width = len(rows), 1 + 2 * widest
        tables = {index: host[2 * count + n * width : 2 * count + (n + 1) * width] for n, index in enumerate(wanting)}
        sampled = []
        for index, row in enumerate(rows):
            if index in failed:
                sampled.append(SampledRow(failed[index]))
            elif not host[count + index]:
                reason = f"the model's logits for its output token {row.token_index} hold NaN or infinite values"
                sampled.append(SampledRow(RequestFailed(reason)))
            else:
                table = tables.get(index)
                logprobs = logprobs_of(table, row.params.top_logprobs) if table is not None else None
                sampled.append(SampledRow(int(host[index]), logprobs))
        return sampled


def _adjust(
    logits: torch.Tensor, rows: list[SamplingRow], which: list[int], slot_of: dict[int, int], counts: OutputCounts
) -> None:
    """In place, on the rows `which`: logit_bias added, then the penalties taken off as OpenAI defines them,
    `frequency_penalty * count + presence_penalty * (count > 0)`, counted over the request's output so far
    (never its prompt); each one operation over all its rows."""
    device, dtype = logits.device, logits.dtype
    biases = [(index, token_id, value) for index in which for token_id, value in rows[index].params.logit_bias]
    if biases:
        row_ids = on_device([index for index, _, _ in biases], device)
        token_ids = on_device([token_id for _, token_id, _ in biases], device)
        values = on_device([value for *_, value in biases], device, dtype)
        logits.index_put_((row_ids, token_ids), values, accumulate=True)
    penalized = [index for index in which if index in slot_of]
    if penalized:
        output_counts = counts.of([slot_of[index] for index in penalized], device)
        frequency = on_device([rows[index].params.frequency_penalty for index in penalized], device, dtype)
        presence = on_device([rows[index].params.presence_penalty for index in penalized], device, dtype)
        penalty = frequency[:, None] * output_counts + presence[:, None] * (output_counts > 0)
        penalized_rows = on_device(penalized, device)
        logits[penalized_rows] = logits[penalized_rows] - penalty


def _alone(rows: list[SamplingRow], index: int, change: Callable[..., object]) -> RequestFailed | None:
    """Runs one row's change; when it raises, that row's request fails alone (logged)."""
    try:
        change()
    except Exception as error:
        log.exception("adjusting the logits of request %s raised", rows[index].request_id)
        return RequestFailed(f"adjusting its logits for output token {rows[index].token_index} raised {error!r}")
    return None
