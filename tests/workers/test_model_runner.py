"""The model runner's decode attention: sequences of very different lengths attend in separate padded
batches, and each gets the logits it would get alone."""

import torch

from workers.model_runner import GROUP_COST_IN_BLOCKS, ModelRunner, StepInput, _group_bounds

BLOCK = 16


def test_one_long_context_gets_a_group_of_its_own():
    assert _group_bounds([1, 1, 2, 2, 2, 40]) == [(0, 5), (5, 6)]


def test_similar_lengths_share_one_group():
    assert _group_bounds([3, 4, 4, 5, 6]) == [(0, 5)]
    assert _group_bounds([]) == []


def test_a_group_is_split_only_when_padding_costs_more_than_another_call():
    short, long = 1, 1 + GROUP_COST_IN_BLOCKS // 2
    assert _group_bounds([short, short, long]) == [(0, 3)]  # padding two by 16 blocks: cheaper than a call
    assert _group_bounds([short] * 4 + [long]) == [(0, 4), (4, 5)]


def test_grouped_decode_step_gives_each_sequence_its_own_logits(tiny_model):
    runner = ModelRunner(tiny_model, num_blocks=128, block_size=BLOCK)
    lengths = [5, 9, 12, 14, 300, 7]  # the 300-token context is split off from the short ones
    tables, next_block = [], 0
    for length in lengths:
        count = length // BLOCK + 1
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    prompts = [[(7 * i + n) % 400 + 3 for i in range(length)] for n, length in enumerate(lengths)]
    for prompt, table in zip(prompts, tables):
        runner.execute([StepInput(prompt, 0, table, True)])

    decoding = [StepInput([11 + n], length, table, True) for n, (length, table) in enumerate(zip(lengths, tables))]
    together = runner.execute(decoding)
    alone = torch.cat([runner.execute([step]) for step in decoding])

    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    widths = sorted(len(table[: length // BLOCK + 1]) for length, table in zip(lengths, tables))
    assert len(_group_bounds(widths)) == 2
