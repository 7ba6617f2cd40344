"""What the pieces of a CPU engine step cost, each next to the way the runner does not do it
(docs/engine.md cites these figures):

    .venv/bin/python -m bench.step_costs
    OMP_WAIT_POLICY=ACTIVE .venv/bin/python -m bench.step_costs   # the second-thread case at its worst

- the LM head at 32 rows: `nn.Linear` against the runner's prepacked projection;
- each matrix of a decoder layer at 8 rows: the CPU GEMM its size did not choose against the one it did, and a
  whole decode step with every layer matrix on oneDNN against the runner's choice;
- copying 32 sequences' KV blocks out of the pool: advanced indexing against `index_select` into a buffer;
- a decode step of 31 short contexts and one long: one padded attention batch against groups of similar lengths
  (the gather backend), and the gather backend's groups against the paged-cpu operator;
- a 512-token prefill step run from the thread that ran the previous one against from a second thread.
"""

import argparse
import itertools
import math
import statistics
import sys
import threading
import time

import torch

from workers.models.backends import choose_backend
from workers.models.projections import Projection
from workers.models.step import StepInput
from workers.runner.model_loader import load_model
from workers.runner.model_runner import GROUP_COST_IN_BLOCKS, ModelRunner


def median_ms(fn, repeats: int) -> float:
    """The median of `repeats` timed calls of fn, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _other_gemm(chosen: Projection) -> str:
    """The CPU GEMM layout the runner did not choose (`workers.models.projections.gemm_for`)."""
    return "onednn" if chosen.gemm == "mm" else "mm"


def _layers_with(model, layers: list, gemm: str | None) -> None:
    """Rebuilds the decoder layers' projections from the model's linears: on `gemm`, or as the runner picks."""
    for layer, source in zip(layers, model.model.layers, strict=True):
        attn, mlp = source.self_attn, source.mlp
        layer.qkv = Projection(attn.q_proj, attn.k_proj, attn.v_proj, gemm=gemm)
        layer.o = Projection(attn.o_proj, gemm=gemm)
        layer.gate_up = Projection(mlp.gate_proj, mlp.up_proj, gemm=gemm)
        layer.down = Projection(mlp.down_proj, gemm=gemm)


def _row(what: str, baseline_ms: float, ours_ms: float) -> None:
    print(f"{what:<44} {baseline_ms:8.2f} ms {ours_ms:8.2f} ms {baseline_ms / ours_ms:6.2f}x")


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_costs", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="diptych-100m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"loading {args.model}", file=sys.stderr, flush=True)
    model = load_model(args.model, f"builtin:{args.model}").model
    print(f"{'':<44} {'the other way':>11} {'the runner':>11} {'ratio':>7}")

    rows = torch.randn(32, model.config.hidden_size)
    lm_head = Projection(model.lm_head)
    _row(
        "LM head, 32 rows",
        median_ms(lambda: model.lm_head(rows), args.repeats),
        median_ms(lambda: lm_head(rows), args.repeats),
    )

    layer = model.model.layers[0]
    for name, linears in (
        ("q/k/v", (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
        ("o", (layer.self_attn.o_proj,)),
        ("gate/up", (layer.mlp.gate_proj, layer.mlp.up_proj)),
        ("down", (layer.mlp.down_proj,)),
    ):
        chosen = Projection(*linears)
        other = Projection(*linears, gemm=_other_gemm(chosen))
        x = torch.randn(8, linears[0].in_features)
        _row(
            f"{name}, 8 rows: {other.gemm} against {chosen.gemm}",
            median_ms(lambda other=other, x=x: other(x), args.repeats),
            median_ms(lambda chosen=chosen, x=x: chosen(x), args.repeats),
        )

    runner = ModelRunner(model, num_blocks=4096, block_size=16, attention="gather")
    runner.kv.normal_()  # touched memory, as a pool in use is
    pool = runner.kv[0, 0]
    tables = torch.randperm(4096)[: 32 * 14].view(32, 14)
    buffer = torch.empty(32 * 14, *pool.shape[1:])
    _row(
        "KV of 32 sequences x 14 blocks, one layer",
        median_ms(lambda: pool[tables], args.repeats),
        median_ms(lambda: torch.index_select(pool, 0, tables.reshape(-1), out=buffer), args.repeats),
    )

    lengths = [160] * 31 + [430]
    firsts = list(itertools.accumulate((n // 16 + 1 for n in lengths), initial=0))
    decoding = [StepInput([5], n, list(range(firsts[i], firsts[i + 1])), True) for i, n in enumerate(lengths)]
    grouped = median_ms(lambda: runner.execute(decoding), args.repeats)
    runner.decode_group_cost = math.inf
    one_batch = median_ms(lambda: runner.execute(decoding), args.repeats)
    runner.decode_group_cost = GROUP_COST_IN_BLOCKS
    _row("decode step, 31 x 160 tokens and 1 x 430", one_batch, grouped)
    _layers_with(model, runner.decoder.layers, "mm")
    every_mm = median_ms(lambda: runner.execute(decoding), args.repeats)
    _layers_with(model, runner.decoder.layers, None)
    _row("the same step, every layer matrix on mm", every_mm, grouped)
    runner.attention_backend = choose_backend("paged-cpu", runner.device, runner.kv.dtype, 16)
    _row("the same step, gather against paged-cpu", grouped, median_ms(lambda: runner.execute(decoding), args.repeats))
    runner.attention_backend = "gather"

    prompts = [StepInput(list(range(100 + i, 228 + i)), 0, list(range(10 * i, 10 * i + 10)), True) for i in range(4)]
    repeats = max(3, args.repeats // 5)
    same_thread = median_ms(lambda: runner.execute(prompts), repeats)
    other_thread = []
    worker = threading.Thread(target=lambda: other_thread.append(median_ms(lambda: runner.execute(prompts), repeats)))
    worker.start()
    worker.join()
    _row("prefill step of 4 x 128 tokens, other thread", other_thread[0], same_thread)
    return 0


if __name__ == "__main__":
    sys.exit(main())
