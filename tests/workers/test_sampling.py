import torch

from workers.sampling import SamplingParams, StopCriteria, sample


def logits(rows: int = 4, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_picks_the_argmax():
    values = logits()
    assert sample(values, [SamplingParams(temperature=0.0)] * 4, [0] * 4) == values.argmax(-1).tolist()


def test_top_k_of_one_and_a_tiny_top_p_are_greedy():
    values = logits()
    expected = values.argmax(-1).tolist()
    assert sample(values, [SamplingParams(temperature=1.0, top_k=1)] * 4, [0] * 4) == expected
    assert sample(values, [SamplingParams(temperature=1.0, top_p=1e-6)] * 4, [0] * 4) == expected


def test_a_seeded_draw_does_not_depend_on_the_batch_it_runs_in():
    values = logits(rows=8)
    seeded = SamplingParams(temperature=1.0, seed=99)
    alone = sample(values[3:4], [seeded], [5])
    in_batch = sample(values, [SamplingParams(temperature=1.0)] * 3 + [seeded] + [SamplingParams()] * 4, [0, 1, 2, 5, 0, 0, 0, 0])
    assert in_batch[3] == alone[0]


def test_seeded_draws_vary_with_the_token_index_and_the_seed():
    row = logits(rows=1, vocab=512)
    draws = {sample(row, [SamplingParams(temperature=1.5, seed=1)], [i])[0] for i in range(30)}
    assert len(draws) > 5
    by_seed = {sample(row, [SamplingParams(temperature=1.5, seed=s)], [0])[0] for s in range(30)}
    assert len(by_seed) > 5


def test_stop_criteria():
    stop = StopCriteria(eos_token_ids=frozenset({1}), context_length=10)
    params = SamplingParams(max_tokens=3)
    assert stop.check(1, 1, 2, params) == (True, True)
    assert stop.check(1, 1, 2, SamplingParams(max_tokens=3, ignore_eos=True)) == (False, False)
    assert stop.check(5, 3, 2, params) == (True, False)
    assert stop.check(5, 2, 2, params) == (False, False)
    assert stop.check(5, 2, 8, SamplingParams(max_tokens=50)) == (True, False)
