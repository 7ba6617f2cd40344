"""The GPU benchmarks' smoke runs on the CPU (`bench.gpu_split`, `bench.gpu_busy` on diptych-tiny), and the
arithmetic `bench.gpu_busy` applies to a profile, on known intervals."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from bench import gpu_busy, gpu_serving, gpu_split
from bench.gpu_busy import Activity, covered_ns, device_kind, device_share
from workers.runner.kv_pool import kv_layout_of
from workers.runner.model_loader import load_model

SPLIT_ARGV = ["--device", "cpu", "--model", "diptych-tiny", "--requests", "6", "--concurrency", "3"]
SPLIT_ARGV += ["--prompt-tokens", "24", "--output-tokens", "6", "--threads", "1"]


def test_split_and_colocated_agree_over_the_real_data_path():
    report = gpu_split.run(gpu_split.parser().parse_args([*SPLIT_ARGV, "--reference", "2"]))
    (result,) = report.rounds
    split, colocated = result.split.outcomes, result.colocated.outcomes
    assert [len(o.tokens) for o in split + colocated] == [6] * 12
    # float32 on the CPU: the split pair and the colocated worker pick the same tokens, as generate does
    assert result.equal() == 6 and result.divergences() == []
    assert report.reference is not None
    assert (report.reference.count, report.reference.split_equal, report.reference.colocated_equal) == (2, 2, 2)
    # every prompt's KV crossed over TCP, whole blocks of it
    model = load_model("diptych-tiny", "builtin:diptych-tiny").model
    block_nbytes = kv_layout_of(model.config, gpu_split.BLOCK_SIZE, torch.float32).block_nbytes
    assert [o.kv_bytes for o in split] == [-(-len(p) // gpu_split.BLOCK_SIZE) * block_nbytes for p in result.prompts]
    assert {o.data_path for o in split} == {"tcp"} and not any(o.kv_bytes for o in colocated)
    assert all(0 < o.ttft_s <= o.seconds for o in split + colocated)
    # no worker keeps a block past its requests
    assert all(free == total for free, total in report.kv_blocks)


def test_gpu_serving_hands_its_split_mode_to_gpu_split(capsys):
    assert gpu_serving.main(["--split", *SPLIT_ARGV]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("diptych-tiny (3 M parameters) on cpu, float32; 6 requests, 3 concurrent")
    assert lines[2].startswith("split (1 prefill + 1 decode)") and "KV 0." in lines[2] and "(tcp)" in lines[2]
    assert lines[3].startswith("colocated (1 worker)") and "KV" not in lines[3]
    assert lines[4] == "greedy outputs equal, split vs colocated: 6/6; first divergence at token []"


def test_host_time_per_step_per_sequence_on_the_micro_model(capsys):
    argv = ["--device", "cpu", "--concurrency", "1,4", "--requests-per-stream", "2", "--output-tokens", "8"]
    assert gpu_busy.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "diptych-tiny on cpu, float32, 1 torch threads, attention paged-cpu"  # auto's choice here
    rows = [line.split() for line in lines[3:]]
    assert [row[0] for row in rows] == ["1", "4"]
    for streams, steps, per_step, _ms_per_step, tok_s, total, inside, outside in rows:
        assert int(steps) > 0 and 0 < float(per_step) <= int(streams)
        assert abs(float(total) - float(inside) - float(outside)) < 0.2
        assert float(inside) > 0 and float(tok_s) > 0
    assert float(rows[0][2]) == 1.0  # one stream: one sequence a step


def test_a_profile_on_the_cpu_holds_host_calls_and_no_device_time():
    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (a @ a).sum().item()
    found = gpu_busy.activities_of(prof)
    assert "aten::mm" in {activity.name for activity in found}
    assert {activity.kind for activity in found} == {"host"}
    share = device_share(found, wall_s=1.0, steps=1)
    assert (share.kernel_s, share.busy_s, share.copies) == (0.0, 0.0, {})


def test_device_kinds_by_the_profilers_activity_and_by_name():
    assert device_kind("kernel", "ampere_sgemm", True, False) == "kernel"
    assert device_kind("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", True, False) == "copy"
    assert device_kind("gpu_memset", "Memset (Device)", True, False) == "fill"
    assert device_kind("gpu_user_annotation", "forward", True, True) is None
    assert device_kind("cuda_sync", "Stream Sync", True, False) is None
    assert device_kind("cuda_runtime", "cudaMemcpyAsync", False, False) == "host"
    # a profiler that numbers its activities
    assert device_kind("3", "Memcpy HtoD (Pageable -> Device)", True, False) == "copy"
    assert device_kind("5", "void gemv_kernel<float>", True, False) == "kernel"
    assert device_kind("9", "Event Sync", True, False) is None


def test_copy_bytes_from_the_profilers_metadata():
    metadata = (
        '\n      "device": 0, "context": 1,\n      "stream": 7, "correlation": 42,'
        '\n      "bytes": 512000, "memory bandwidth (GB/s)": 12.5'
    )
    assert gpu_busy.copy_bytes(metadata) == 512000
    assert gpu_busy.copy_bytes("") == 0 and gpu_busy.copy_bytes("not json") == 0


def test_device_share_counts_overlaps_once_and_copies_by_direction():
    assert covered_ns([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    activities = [
        Activity("gemm", "kernel", 0, 400),
        Activity("gemm", "kernel", 1000, 1400),
        Activity("softmax", "kernel", 300, 500),  # overlaps the first gemm by 100
        Activity("Memcpy DtoH (Device -> Pageable)", "copy", 500, 600, nbytes=4096),
        Activity("Memcpy DtoH (Device -> Pageable)", "copy", 1400, 1500, nbytes=4096),
        Activity("Memcpy HtoD (Pageable -> Device)", "copy", 900, 1000, nbytes=256),
        Activity("Memset (Device)", "fill", 2000, 2050),
        Activity("cudaMemcpyAsync", "host", 450, 650),
        Activity("cudaStreamSynchronize", "host", 1300, 1500),
        Activity("aten::mm", "host", 0, 5000),
    ]
    share = device_share(activities, wall_s=5e-6, steps=2, top=1)
    assert share.kernel_s == pytest.approx(1000e-9)
    assert share.busy_s == pytest.approx((600 + 600 + 50) * 1e-9)  # [0, 600), [900, 1500), [2000, 2050)
    assert share.copies == {"DtoH": (2, 8192), "HtoD": (1, 256)}
    assert share.host_wait_s == pytest.approx(400e-9)
    assert [(name, n) for name, _, n in share.top_kernels] == [("gemm", 2)]
    assert share.top_kernels[0][1] == pytest.approx(800e-9)
    text = gpu_busy.render_share(share, plain=None)
    assert "copies DtoH: 2 (1.00 a step)" in text and "device kernels 0.000 s = 20.0% of the wall time" in text


def test_a_run_with_no_device_activity_says_so():
    share = device_share([Activity("aten::mm", "host", 0, 1000)], wall_s=1.0, steps=3)
    assert gpu_busy.render_share(share, plain=None) == (
        "under torch.profiler: 3 steps in 1.00 s; no device activity recorded"
    )
