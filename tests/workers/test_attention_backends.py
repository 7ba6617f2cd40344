"""The attention backends agree: the flash-varlen plan (one call per layer over the pool in place) and the
paged-cpu plan (decoding rows in one C++ operator call per layer over the pool in place) give what the
gather plan gives for any mix of prompt chunks and decoding tokens, windows included. On the CPU the
flash-varlen kernel call goes to a reference written from the kernel's contract (cu_seqlens, seqused_k,
block tables, a causal window aligned to the end of the keys); on CUDA, to the kernel itself."""

import subprocess

import pytest
import torch
import torch.nn.functional as F

import workers.models.flash_varlen as flash_varlen_module
import workers.models.paged_cpu as paged_cpu_module
from tests.workers.conftest import prefilled
from workers.models.attention import AttentionPlan, GatherBuffers
from workers.models.backends import AttentionBackendUnavailable, choose_backend
from workers.models.flash_varlen import FlashVarlenPlan, unavailable_reason
from workers.models.paged_cpu import PagedCpuPlan
from workers.models.step import StepInput
from workers.runner.model_runner import ModelRunner

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


def step_tensors(inputs, block=BLOCK, heads=HEADS, kv_heads=KV_HEADS, dim=DIM, blocks=32, seed=7):
    """A layer's pool, and a step's queries, keys and values, its keys and values written into the pool first
    as the runner writes them."""
    generator = torch.Generator().manual_seed(seed)
    layer_kv = torch.randn(2, blocks, block, kv_heads, dim, generator=generator)
    tokens = sum(len(step.token_ids) for step in inputs)
    query = torch.randn(tokens, heads, dim, generator=generator)
    key, value = torch.randn(2, tokens, kv_heads, dim, generator=generator)
    row = 0
    for step in inputs:
        for offset in range(len(step.token_ids)):
            position = step.start + offset
            layer_kv[0, step.block_ids[position // block], position % block] = key[row]
            layer_kv[1, step.block_ids[position // block], position % block] = value[row]
            row += 1
    return layer_kv, query, key, value


def gather_plan(inputs, window, block=BLOCK, kv_heads=KV_HEADS, dim=DIM):
    buffers = GatherBuffers((block, kv_heads, dim), torch.float32, torch.device("cpu"))
    return AttentionPlan(inputs, block, torch.device("cpu"), buffers, 32, (window,))


@pytest.mark.parametrize("window", [None, 5])
def test_flash_varlen_attends_as_gather_does_over_a_mixed_step(reference_kernel, window):
    inputs = mixed_step()
    layer_kv, query, key, value = step_tensors(inputs)
    gather = gather_plan(inputs, window)
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


def test_auto_takes_paged_cpu_for_float32_on_the_cpu_gather_elsewhere_and_naming_one_that_cannot_run_says_why():
    cpu = torch.device("cpu")
    assert choose_backend("auto", cpu, torch.float32, 16) == "paged-cpu"
    assert choose_backend("auto", cpu, torch.bfloat16, 16) == "gather"
    assert choose_backend("gather", cpu, torch.float32, 16) == "gather"
    with pytest.raises(AttentionBackendUnavailable, match=r"float32 pools, not torch.bfloat16"):
        choose_backend("paged-cpu", cpu, torch.bfloat16, 16)
    with pytest.raises(AttentionBackendUnavailable, match="runs on the CPU, not on cuda"):
        choose_backend("paged-cpu", torch.device("cuda"), torch.float32, 16)
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


# ---- paged-cpu ------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 5])
def test_paged_cpu_attends_as_gather_does_over_a_mixed_step(window):
    inputs = mixed_step()
    layer_kv, query, key, value = step_tensors(inputs)
    buffers = GatherBuffers((BLOCK, KV_HEADS, DIM), torch.float32, torch.device("cpu"))
    paged = PagedCpuPlan(inputs, BLOCK, buffers, (window,))
    expected = gather_plan(inputs, window).attend(query, key, value, layer_kv, 0.3, window)
    torch.testing.assert_close(paged.attend(query, key, value, layer_kv, 0.3, window), expected)
    assert paged.sample_rows == [0, 1, 7]


@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(12, 4, None), (4, 4, 37), (8, 1, None)])
def test_paged_cpu_over_many_decoding_rows_of_odd_lengths_and_scattered_blocks(heads, kv_heads, window):
    """Lengths on either side of block edges and of the operator's four-key and eight-lane strides."""
    generator = torch.Generator().manual_seed(3)
    block, dim, pool_blocks = 16, 64, 64
    order = torch.randperm(pool_blocks, generator=generator).tolist()
    inputs, used = [], 0
    for position in [0, 1, 3, 7, 15, 16, 17, 63, 64, 100, 131, 200]:
        count = position // block + 1
        inputs.append(StepInput([1], position, order[used : used + count], True))
        used += count
    layer_kv, query, key, value = step_tensors(inputs, block, heads, kv_heads, dim, pool_blocks)
    buffers = GatherBuffers((block, kv_heads, dim), torch.float32, torch.device("cpu"))
    paged = PagedCpuPlan(inputs, block, buffers, (window,))
    expected = gather_plan(inputs, window, block, kv_heads, dim).attend(query, key, value, layer_kv, 0.125, window)
    torch.testing.assert_close(paged.attend(query, key, value, layer_kv, 0.125, window), expected)


def test_paged_cpu_copies_no_keys_out_of_the_pool_for_decoding_rows():
    """The decode step's attention reads the pool in place: nothing is gathered into the step's buffers."""
    inputs = [StepInput([7], 13, [9, 2, 30, 5], True), StepInput([8], 2, [11], True)]
    layer_kv, query, key, value = step_tensors(inputs)
    buffers = GatherBuffers((BLOCK, KV_HEADS, DIM), torch.float32, torch.device("cpu"))
    PagedCpuPlan(inputs, BLOCK, buffers, (None,)).attend(query, key, value, layer_kv, 0.3, None)
    assert all(buffer.numel() == 0 for buffer in buffers._buffers)


def test_a_runner_on_paged_cpu_gives_the_gather_runners_logits(tiny_model):
    gather = ModelRunner(tiny_model, num_blocks=64, block_size=16, attention="gather")
    paged = ModelRunner(tiny_model, num_blocks=64, block_size=16, attention="paged-cpu")
    assert paged.attention_backend == "paged-cpu"
    for runner in (gather, paged):
        runner.kv.copy_(torch.randn(runner.kv.shape, generator=torch.Generator().manual_seed(1)))
    decoding = prefilled(gather, [5, 20, 40])
    prefilled(paged, [5, 20, 40])
    step = [*decoding, StepInput(list(range(30, 42)), 0, [60, 61], True)]
    torch.testing.assert_close(paged.execute(step), gather.execute(step), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("bad_position", "reaches_the_output"), [(13, True), (9, False), (14, False)])
def test_a_non_finite_key_reaches_the_rows_that_see_it_and_no_other(bad_position, reaches_the_output):
    """As with SDPA: a NaN key the query sees makes its output NaN (the engine then fails the request on its
    logits); one outside its window or past its position changes nothing."""
    inputs = [StepInput([7], 13, [9, 2, 30, 5], True), StepInput([8], 2, [11], True)]
    layer_kv, query, key, value = step_tensors(inputs)
    layer_kv[0, inputs[0].block_ids[bad_position // BLOCK], bad_position % BLOCK] = float("nan")
    buffers = GatherBuffers((BLOCK, KV_HEADS, DIM), torch.float32, torch.device("cpu"))
    out = PagedCpuPlan(inputs, BLOCK, buffers, (4,)).attend(query, key, value, layer_kv, 0.3, 4)
    assert bool(out[0].isnan().all()) is reaches_the_output
    assert bool(out[0].isfinite().all()) is not reaches_the_output
    assert bool(out[1].isfinite().all())


def test_the_operator_refuses_a_block_table_outside_the_pool_before_writing_anything():
    inputs = [StepInput([7], 13, [9, 2, 30, 5], True)]
    layer_kv, query, _key, _value = step_tensors(inputs)
    out = torch.full_like(query, 5.0)
    args = [torch.tensor(values) for values in ([0], [13], [0, 4], [9, 2, 32, 5])]
    with pytest.raises(RuntimeError, match="block id 32 is outside the pool"):
        torch.ops.diptych.paged_decode(query, layer_kv[0], layer_kv[1], out, *args, 0.3, 0)
    short = [torch.tensor(values) for values in ([0], [13], [0, 3], [9, 2, 30])]
    with pytest.raises(RuntimeError, match="blocks do not reach its position"):
        torch.ops.diptych.paged_decode(query, layer_kv[0], layer_kv[1], out, *short, 0.3, 0)
    assert bool((out == 5.0).all())


def test_the_operator_runs_on_torchs_own_openmp_threads():
    """Compiled without OpenMP, ATen's parallel_for (inlined into the operator) runs every row on one thread;
    linked to a second OpenMP runtime, two thread teams fight over the cores. The operator starts OpenMP
    teams (GOMP_parallel), and the process holds one libgomp: torch's."""
    assert paged_cpu_module.unavailable_reason(torch.device("cpu"), torch.float32) is None
    library = paged_cpu_module.built_library()
    imported = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True)
    assert "GOMP_parallel" in imported.stdout
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes
