"""Prompt-lookup drafting: when a request's last n tokens occurred before in its tokens, propose the
tokens that followed that earlier occurrence. It costs no model and helps wherever the output copies its
input (code edits, quoting, repeated blocks)."""

from workers.spec_decode.proposer import DraftRequest


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"the n-gram sizes must satisfy 1 <= min <= max, not {ngram_min} and {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [self.propose_one(request.token_ids, request.max_drafts) for request in requests]

    def propose_one(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens following the latest earlier occurrence of the longest run of last tokens
        (ngram_min to ngram_max of them) that recurs; none when no run of ngram_min recurs."""
        if count < 1 or len(tokens) <= self.ngram_min:
            return []
        source = self._latest_match(tokens)
        if source is None:
            return []
        drafts: list[int] = []
        for offset in range(count):
            # A match close to the end runs into the drafts themselves: a periodic run continues its period.
            index = source + offset
            drafts.append(tokens[index] if index < len(tokens) else drafts[index - len(tokens)])
        return drafts

    def _latest_match(self, tokens: list[int]) -> int | None:
        """The position right after the latest earlier run that equals the longest matching suffix."""
        last = len(tokens) - 1
        best_length, best_end = 0, -1
        for end in range(last - 1, -1, -1):  # `end`: the earlier run's last position
            if tokens[end] != tokens[last]:
                continue
            length = 1
            while length < self.ngram_max and length <= end and tokens[end - length] == tokens[last - length]:
                length += 1
            if length > best_length:
                best_length, best_end = length, end
                if length == self.ngram_max:
                    break
        return best_end + 1 if best_length >= self.ngram_min else None
