"""The model runner's attention: sequences of very different lengths attend in separate padded batches,
and each gets the logits it would get alone; a sliding window's keys are those transformers gives it."""

import torch

from tests.workers.conftest import prefilled
from workers.models.attention import GROUP_COST_IN_BLOCKS, first_visible_block, group_bounds, visible
from workers.runner.model_runner import ModelRunner

BLOCK = 16


def test_one_long_context_gets_a_group_of_its_own():
    assert group_bounds([1, 1, 2, 2, 2, 40]) == [(0, 5), (5, 6)]


def test_similar_lengths_share_one_group():
    assert group_bounds([3, 4, 4, 5, 6]) == [(0, 5)]
    assert group_bounds([]) == []


def test_a_group_is_split_only_when_padding_costs_more_than_another_call():
    short, long = 1, 1 + GROUP_COST_IN_BLOCKS // 2
    assert group_bounds([short, short, long]) == [(0, 3)]  # padding two by 16 blocks: cheaper than a call
    assert group_bounds([short] * 4 + [long]) == [(0, 4), (4, 5)]


def test_grouped_decode_step_gives_each_sequence_its_own_logits(tiny_model):
    runner = ModelRunner(tiny_model, num_blocks=128, block_size=BLOCK)
    lengths = [5, 9, 12, 14, 300, 7]  # the 300-token context is split off from the short ones
    decoding = prefilled(runner, lengths)
    together = runner.execute(decoding)
    alone = torch.cat([runner.execute([step]) for step in decoding])

    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    widths = sorted(len(step.block_ids) for step in decoding)
    assert len(group_bounds(widths)) == 2


def test_a_query_at_p_sees_the_window_of_keys_ending_at_p():
    keys = torch.arange(8)[None]
    assert visible(torch.tensor([[5]]), keys, 3)[0].nonzero().flatten().tolist() == [3, 4, 5]
    assert visible(torch.tensor([[5]]), keys, None)[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert first_visible_block(39, 24, BLOCK) == 1  # keys 16..39: blocks 1 and 2
    assert first_visible_block(38, 24, BLOCK) == 0  # keys 15..38: key 15 is in block 0
    assert first_visible_block(40, None, BLOCK) == 0
