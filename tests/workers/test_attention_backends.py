"""The attention backends agree: the flash-varlen plan (one call per layer over the pool in place) gives what
the gather plan gives for any mix of prompt chunks and decoding tokens, windows included. On the CPU its
kernel call goes to a reference written from the kernel's contract (cu_seqlens, seqused_k, block tables,
a causal window aligned to the end of the keys); on CUDA, to the kernel itself."""

import pytest
import torch
import torch.nn.functional as F

import workers.models.flash_varlen as flash_varlen_module
from tests.workers.conftest import prefilled
from workers.model_runner import ModelRunner, StepInput
from workers.models.attention import AttentionPlan, GatherBuffers
from workers.models.backends import AttentionBackendUnavailable, choose_backend
from workers.models.flash_varlen import FlashVarlenPlan, unavailable_reason

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def reference_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa, seqused_k, block_table
):
    """The kernel's contract, one sequence at a time: its keys are its pages' first seqused_k tokens; its
    last query sits at the last key; a query sees keys up to its own, and at most window_size[0] before."""
    out = torch.empty_like(query)
    for i in range(len(seqused_k)):
        rows = slice(int(cu_seq_q[i]), int(cu_seq_q[i + 1]))
        count = int(seqused_k[i])
        assert int(cu_seq_k[i + 1] - cu_seq_k[i]) == count and int(cu_seq_q[i + 1] - cu_seq_q[i]) <= max_q
        keys = key[block_table[i].long()].flatten(0, 1)[:count]
        values = value[block_table[i].long()].flatten(0, 1)[:count]
        positions = torch.arange(count - (rows.stop - rows.start), count)[:, None]
        seen = torch.arange(count)[None, :] <= positions
        if window_size[0] >= 0:
            seen &= torch.arange(count)[None, :] >= positions - window_size[0]
        attended = F.scaled_dot_product_attention(
            query[rows].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=seen,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        out[rows] = attended.transpose(0, 1)
    return out


@pytest.fixture
def reference_kernel(monkeypatch):
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", reference_varlen_attn)


def mixed_step() -> list[StepInput]:
    """Two decoding inputs of different lengths, a prompt starting, a prompt chunk continuing, over
    blocks scattered through the pool."""
    return [
        StepInput([7], 13, [9, 2, 30, 5], True),
        StepInput([8], 2, [11], True),
        StepInput([1, 2, 3, 4, 5, 6], 0, [20, 21], True),
        StepInput([4, 4, 4, 4, 4], 10, [3, 17, 8, 25], False),
    ]


@pytest.mark.parametrize("window", [None, 5])
def test_flash_varlen_attends_as_gather_does_over_a_mixed_step(reference_kernel, window):
    generator = torch.Generator().manual_seed(7)
    layer_kv = torch.randn(2, 32, BLOCK, KV_HEADS, DIM, generator=generator)
    inputs = mixed_step()
    tokens = sum(len(step.token_ids) for step in inputs)
    query = torch.randn(tokens, HEADS, DIM, generator=generator)
    key, value = torch.randn(2, tokens, KV_HEADS, DIM, generator=generator)
    row = 0
    for step in inputs:  # the step's own keys and values go into the pool first, as the runner writes them
        for offset in range(len(step.token_ids)):
            position = step.start + offset
            layer_kv[0, step.block_ids[position // BLOCK], position % BLOCK] = key[row]
            layer_kv[1, step.block_ids[position // BLOCK], position % BLOCK] = value[row]
            row += 1
    gather = AttentionPlan(
        inputs,
        BLOCK,
        torch.device("cpu"),
        GatherBuffers((BLOCK, KV_HEADS, DIM), torch.float32, torch.device("cpu")),
        32,
        (window,),
    )
    flash = FlashVarlenPlan(inputs, BLOCK, torch.device("cpu"))
    expected = gather.attend(query, key, value, layer_kv, 0.3, window)
    torch.testing.assert_close(flash.attend(query, key, value, layer_kv, 0.3, window), expected)
    assert flash.sample_rows == gather.sample_rows == [0, 1, 7]
    assert flash.cu_seqlens_q.tolist() == [0, 1, 2, 8, 13] and flash.seqused_k.tolist() == [14, 3, 6, 15]


def test_a_runner_on_flash_varlen_gives_the_gather_runners_logits(tiny_model, reference_kernel):
    gather = ModelRunner(tiny_model, num_blocks=64, block_size=16, attention="gather")
    flash = ModelRunner(tiny_model, num_blocks=64, block_size=16, attention="gather")
    flash.attention_backend = "flash-varlen"  # the CPU cannot choose it: its kernel is the reference here
    for runner in (gather, flash):
        runner.kv.copy_(torch.randn(runner.kv.shape, generator=torch.Generator().manual_seed(1)))
    decoding = prefilled(gather, [5, 20, 40])
    prefilled(flash, [5, 20, 40])
    step = [*decoding, StepInput(list(range(30, 42)), 0, [60, 61], True)]
    torch.testing.assert_close(flash.execute(step), gather.execute(step), rtol=1e-4, atol=1e-4)


def test_auto_takes_gather_where_flash_varlen_cannot_run_and_naming_it_there_says_why():
    cpu = torch.device("cpu")
    assert choose_backend("auto", cpu, torch.float32, 16) == "gather"
    assert choose_backend("gather", cpu, torch.float32, 16) == "gather"
    with pytest.raises(AttentionBackendUnavailable, match="CUDA devices only"):
        choose_backend("flash-varlen", cpu, torch.bfloat16, 256)
    with pytest.raises(AttentionBackendUnavailable, match="no attention backend 'flash'"):
        choose_backend("flash", cpu, torch.float32, 16)
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert "float16 or bfloat16" in unavailable_reason(cuda, torch.float32, 256)
        assert "--block-size 256" in unavailable_reason(cuda, torch.bfloat16, 16)
    else:
        assert "has none" in unavailable_reason(torch.device("cuda"), torch.bfloat16, 256)


@pytest.mark.skipif(
    unavailable_reason(torch.device("cuda"), torch.bfloat16, 256) is not None,
    reason="needs CUDA and a torch whose FlashAttention varlen reads block tables",
)
def test_the_kernel_on_cuda_attends_as_gather_does(tiny_model):
    model = tiny_model.to("cuda", torch.bfloat16)
    gather = ModelRunner(model, num_blocks=16, block_size=256, device="cuda", attention="gather")
    flash = ModelRunner(model, num_blocks=16, block_size=256, device="cuda", attention="flash-varlen")
    assert flash.attention_backend == "flash-varlen"
    flash.kv.copy_(torch.randn_like(flash.kv))
    gather.kv.copy_(flash.kv)
    step = [
        StepInput([3], 300, [4, 9], True),
        StepInput(list(range(40)), 0, [1], True),
        StepInput([5] * 9, 256, [7, 2], True),
    ]
    torch.testing.assert_close(flash.execute(step), gather.execute(step), rtol=0.05, atol=0.05)
    assert flash_varlen_module.BLOCK_MULTIPLE == 256
