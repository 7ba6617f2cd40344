import torch

from workers.engine.sampling import SamplingParams, StopCriteria, finite_rows, sample, seeded_fraction


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
    params = [SamplingParams(temperature=1.0)] * 3 + [seeded] + [SamplingParams()] * 4
    in_batch = sample(values, params, [0, 1, 2, 5, 0, 0, 0, 0])
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


def test_temperatures_too_small_to_divide_by_or_not_numbers_sample_greedily():
    values = logits()
    expected = values.argmax(-1).tolist()
    for temperature in (1e-40, 1e-6, -0.5, float("nan")):
        assert sample(values, [SamplingParams(temperature=temperature, seed=3)] * 4, [0] * 4) == expected


def test_nan_logits_are_never_picked_greedily_or_drawn():
    values = logits(rows=2, vocab=64)
    best = values.argmax(-1)
    values[:, (best[0] + 1) % 64] = float("nan")
    assert sample(values, [SamplingParams(temperature=0.0)] * 2, [0, 0]) == best.tolist()
    values[1, :32] = float("nan")
    draws = {sample(values[1:], [SamplingParams(temperature=5.0, seed=s)], [0])[0] for s in range(200)}
    assert draws and all(32 <= token < 64 for token in draws)


def test_infinite_logits_take_the_whole_probability():
    values = logits(rows=1, vocab=64)
    values[0, 9] = values[0, 50] = float("inf")
    values[0, 3] = float("-inf")
    draws = {sample(values, [SamplingParams(temperature=1.0, seed=s, top_p=0.9, top_k=5)], [0])[0] for s in range(50)}
    assert draws == {9, 50}


def test_a_row_without_one_finite_logit_still_gives_a_token_of_the_vocabulary():
    for fill in (float("nan"), float("-inf")):
        values = torch.full((1, 64), fill)
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5, top_k=3, seed=1)):
            assert 0 <= sample(values, [params], [0])[0] < 64


def test_degenerate_top_p_and_top_k_keep_the_most_likely_token():
    values = logits()
    expected = values.argmax(-1).tolist()
    assert sample(values, [SamplingParams(temperature=1.0, top_p=0.0, seed=2)] * 4, [0] * 4) == expected
    assert sample(values, [SamplingParams(temperature=1.0, top_p=-1.0, top_k=1)] * 4, [0] * 4) == expected
    draws = sample(values, [SamplingParams(temperature=1.0, top_k=-3, seed=2)] * 4, [0] * 4)
    assert all(0 <= token < values.shape[1] for token in draws)


def test_finite_rows_names_the_rows_holding_nan_or_infinity():
    values = logits(rows=4)
    values[1, 0] = float("nan")
    values[3, 5] = float("-inf")
    assert finite_rows(values).tolist() == [True, False, True, False]


def test_unseeded_draws_follow_the_distribution_after_top_k_and_top_p():
    values = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]] * 3))
    params = [SamplingParams(), SamplingParams(top_k=2), SamplingParams(top_p=0.7)]
    counts = torch.zeros(3, 5)
    torch.manual_seed(0)
    for _ in range(4000):
        counts[torch.arange(3), torch.tensor(sample(values, params, [0, 0, 0]))] += 1
    observed = counts / counts.sum(dim=1, keepdim=True)
    assert torch.allclose(observed[0], torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0]), atol=0.03)
    assert torch.allclose(observed[1], torch.tensor([0.625, 0.375, 0.0, 0.0, 0.0]), atol=0.03)
    assert torch.allclose(observed[2], torch.tensor([0.625, 0.375, 0.0, 0.0, 0.0]), atol=0.03)
    assert counts[:, 4].sum() == 0 and counts[1:, 2:].sum() == 0  # no mass, never drawn


def test_rows_draw_together_whatever_mix_of_greedy_seeded_and_unseeded():
    values = logits(rows=6, vocab=32)
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=4), SamplingParams(top_k=1)] * 2
    picks = sample(values, params, [0, 1, 2, 3, 4, 5])
    greedy = values.argmax(-1).tolist()
    assert picks[0] == greedy[0] and picks[3] == greedy[3] and picks[2] == greedy[2] and picks[5] == greedy[5]
    assert picks[1] == sample(values[1:2], [params[1]], [1])[0] and picks[4] == sample(values[4:5], [params[4]], [4])[0]


def test_unseeded_rows_with_nan_or_infinite_logits_draw_as_seeded_ones_do():
    values = logits(rows=3, vocab=64)
    values[0, :32] = float("nan")
    values[1, 9] = values[1, 50] = float("inf")
    values[2] = float("-inf")
    params = [SamplingParams(temperature=2.0, top_k=40), SamplingParams(top_p=0.9), SamplingParams()]
    draws = [sample(values, params, [0, 0, 0]) for _ in range(100)]
    assert all(32 <= first < 64 and second in (9, 50) and 0 <= third < 64 for first, second, third in draws)
    assert {second for _, second, _ in draws} == {9, 50} and len({third for *_, third in draws}) > 10


def test_seeded_rows_drawn_together_each_draw_what_they_draw_alone():
    values = logits(rows=12, vocab=256, seed=5)
    params = [
        SamplingParams(temperature=0.7 + 0.1 * row, seed=100 + row, top_k=row * 10, top_p=0.95) for row in range(12)
    ]
    indices = [3 * row for row in range(12)]
    together = sample(values, params, indices)
    assert together == [sample(values[row : row + 1], [params[row]], [indices[row]])[0] for row in range(12)]
    # ... and among greedy and unseeded rows
    mixed = [*params[:6], SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), *params[6:10]]
    picks = sample(torch.cat([values[:6], values[:2], values[6:10]]), mixed, [*indices[:6], 0, 0, *indices[6:10]])
    assert picks[:6] + picks[8:] == together[:10]


def test_seeded_draws_follow_the_distribution_over_token_indices():
    values = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]]))
    picks = sample(values.expand(4000, 5), [SamplingParams(seed=17)] * 4000, list(range(4000)))
    counts = torch.bincount(torch.tensor(picks), minlength=5).float()
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0]), atol=0.03)
    assert counts[4] == 0


def test_a_seeded_fraction_depends_on_the_seed_and_the_index_alone():
    fractions = [seeded_fraction(seed, index) for seed in range(50) for index in range(50)]
    assert all(0.0 <= f < 1.0 for f in fractions) and len(set(fractions)) == len(fractions)
    assert seeded_fraction(7, 3) == seeded_fraction(7, 3) and seeded_fraction(-1, 0) != seeded_fraction(1, 0)
