"""Decode step time against its floor.

A decode step reads every weight of the decoder layers and the LM head once, and the KV it attends over,
so no step can take less than those bytes divided by the device's memory bandwidth; nor less than its
multiply-adds divided by the device's matmul rate, which is the tighter bound once many sequences share
the step. Both rates are measured here (a device-to-device copy, a large square matmul), not taken
from a data sheet.

    .venv/bin/python -m bench.decode_floor                      # CPU, float32, eager steps
    .venv/bin/python -m bench.decode_floor --device cuda        # GPU, bfloat16: eager and CUDA-graph steps
    .venv/bin/python -m bench.decode_floor --device cuda --attention gather,triton   # two backends, side by side

Each backend asked for by name must run on the device (else the program stops and says why); `auto` is the
one a worker would take there.
"""

import argparse
import sys
from dataclasses import dataclass
from functools import partial

import torch

from bench.step_costs import median_ms
from workers.models.backends import ATTENTION_BACKENDS, AttentionBackendUnavailable, choose_backend
from workers.models.families import ServedModel
from workers.models.step import StepInput
from workers.runner.decode_graphs import DecodeGraphSpec
from workers.runner.model_loader import load_model
from workers.runner.model_runner import ModelRunner

BLOCK_SIZE = 16


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    """As bench.step_costs.median_ms, each call ending once the device has finished its work."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda _device: None
    return median_ms(lambda: (fn(), synchronize(device)), repeats)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second a copy moves through memory (each byte read once and written once)."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * nbytes / (_median_ms(lambda: target.copy_(source), repeats, device) / 1000)


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """Floating-point operations per second of a [size, size] @ [size, size] matmul."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    return 2 * size**3 / (_median_ms(lambda: a @ b, repeats, device) / 1000)


def weights_read_per_step(model: ServedModel) -> list[torch.Tensor]:
    """The decoder layers, the final norm and the LM head; of the embedding, a step reads only its rows."""
    read = {id(p): p for p in [*model.model.layers.parameters(), *model.model.norm.parameters(), model.lm_head.weight]}
    return list(read.values())


@dataclass(frozen=True)
class Floor:
    weight_bytes: int
    weight_count: int
    kv_token_bytes: int
    attention_flops_per_token: int  # per token of context attended over: scores and weighted values
    bandwidth: float  # bytes/s
    matmul_rate: float  # FLOP/s

    def ms(self, batch: int, context: int) -> tuple[float, str]:
        """The step's floor in milliseconds, and which resource sets it."""
        memory = (self.weight_bytes + batch * (context + 1) * self.kv_token_bytes) / self.bandwidth
        flops = 2 * self.weight_count * batch + batch * (context + 1) * self.attention_flops_per_token
        compute = flops / self.matmul_rate
        return max(memory, compute) * 1000, "memory" if memory >= compute else "compute"


def decode_inputs(batch: int, context: int) -> list[StepInput]:
    blocks = context // BLOCK_SIZE + 1
    return [StepInput([5 + row], context, list(range(row * blocks, (row + 1) * blocks)), True) for row in range(batch)]


def build_runners(
    model, names: list[str], num_blocks: int, device: torch.device, spec: DecodeGraphSpec | None
) -> dict[str, ModelRunner]:
    """A runner per backend, each with its own pool (random values) and graphs; `auto` is labelled with the
    backend it took."""
    runners = {}
    for name in names:
        graphs = " and capturing its graphs" if spec is not None else ""
        print(f"{name}: building the runner{graphs}", file=sys.stderr, flush=True)
        runner = ModelRunner(model, num_blocks, BLOCK_SIZE, str(device), decode_graphs=spec, attention=name)
        runner.kv.normal_()
        runners[name if name != "auto" else f"auto={runner.attention_backend}"] = runner
    return runners


def against_floor(eager: float, replayed: float | None, floor_ms: float, bound: str) -> str:
    """The row's columns from graphs ms on: each step time against the floor, and the graphs' speedup."""
    if replayed is None:
        return f"{'-':>9} {floor_ms:>9.2f} {bound:>7} {eager / floor_ms:>10.2f}x {'-':>12} {'-':>14}"
    return (
        f"{replayed:>9.2f} {floor_ms:>9.2f} {bound:>7} {eager / floor_ms:>10.2f}x "
        f"{replayed / floor_ms:>11.2f}x {eager / replayed:>13.2f}x"
    )


def attention_backends(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in ATTENTION_BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: each of {', '.join(ATTENTION_BACKENDS)}, comma-separated")
    return names


def timed_steps(runner: ModelRunner, inputs: list[StepInput], repeats: int, device: torch.device):
    """(eager ms, replayed ms) of one decode step; replayed is None for a runner without graphs."""
    graphs = runner.decode_graphs, runner.step_graphs
    runner.decode_graphs = runner.step_graphs = None
    try:
        eager = _median_ms(partial(runner.execute, inputs), repeats, device)
    finally:
        runner.decode_graphs, runner.step_graphs = graphs
    if graphs == (None, None):
        return eager, None
    if not replays(runner, inputs):
        raise RuntimeError(f"{runner.attention_backend}: no captured graph holds a step of {len(inputs)} sequences")
    return eager, _median_ms(partial(runner.execute, inputs), repeats, device)


def replays(runner: ModelRunner, inputs: list[StepInput]) -> bool:
    """Whether the runner's captured graphs hold the step (else it would run eagerly, unsaid)."""
    if runner.step_graphs is not None:
        return runner.step_graphs.rows_for(inputs) is not None
    return runner.decode_graphs is not None and runner.decode_graphs.covers(inputs)


def side_by_side(rows: dict[tuple[str, int], float], labels: list[str], batches: list[int], timing: str) -> list[str]:
    """Each batch's step time under each backend, and each backend's against the first."""
    first = labels[0]
    lines = [
        f"side by side ({timing}), ms per decode step; ratios against {first}:",
        f"{'batch':>5} "
        + " ".join(f"{label:>14}" for label in labels)
        + "".join(f" {f'{label}/{first}':>20}" for label in labels[1:]),
    ]
    for batch in batches:
        line = f"{batch:>5} " + " ".join(f"{rows[label, batch]:>14.2f}" for label in labels)
        line += "".join(f" {rows[label, batch] / rows[first, batch]:>19.2f}x" for label in labels[1:])
        lines.append(line)
    return lines


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_floor", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="diptych-100m")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda[:n] (bfloat16)")
    parser.add_argument("--attention", type=attention_backends, default=["auto"], help="backends, comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--batches", default="1,8,32,64", help="decoding sequences per step, comma-separated")
    parser.add_argument("--context", type=int, default=256, help="tokens each sequence attends over")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    batches = [int(b) for b in args.batches.split(",")]
    dtype = torch.bfloat16 if cuda else torch.float32
    for name in args.attention:  # before the model loads: a backend that cannot run here stops the program
        try:
            choose_backend(name, device, dtype, BLOCK_SIZE)
        except AttentionBackendUnavailable as error:
            parser.error(f"--attention {name} cannot run on {device} in {str(dtype).removeprefix('torch.')}: {error}")

    print(f"loading {args.model}", file=sys.stderr, flush=True)
    model = load_model(args.model, f"builtin:{args.model}", dtype=dtype).model
    # PreTrainedModel.to is functools.wraps(nn.Module.to), which typeshed types as a callable that binds no self.
    model.to(device)  # type: ignore[arg-type]
    blocks_per_sequence = args.context // BLOCK_SIZE + 1
    spec = DecodeGraphSpec(max(batches), blocks_per_sequence) if cuda else None
    runners = build_runners(model, args.attention, max(batches) * blocks_per_sequence, device, spec)
    layout = next(iter(runners.values())).layout
    weights = weights_read_per_step(model)
    print("measuring the copy bandwidth and the matmul rate", file=sys.stderr, flush=True)
    config = model.config
    floor = Floor(
        weight_bytes=sum(w.numel() * w.element_size() for w in weights),
        weight_count=sum(w.numel() for w in weights),
        kv_token_bytes=layout.token_nbytes,
        attention_flops_per_token=4 * config.num_hidden_layers * config.num_attention_heads * layout.head_dim,
        bandwidth=copy_bandwidth(device, (1 << 30) if cuda else (256 << 20), args.repeats),
        matmul_rate=matmul_rate(device, dtype, 8192 if cuda else 2048, args.repeats),
    )

    threads = "" if cuda else f" ({args.threads} threads)"
    print(
        f"{args.model} on {device}{threads}, {str(dtype).removeprefix('torch.')}; "
        f"weights read per step {floor.weight_bytes / 1e6:.0f} MB; copy bandwidth {floor.bandwidth / 1e9:.1f} GB/s; "
        f"matmul {floor.matmul_rate / 1e12:.2f} TFLOP/s"
    )
    print(
        f"{'attention':>14} {'batch':>5} {'context':>7} {'eager ms':>9} {'graphs ms':>9} {'floor ms':>9} {'bound':>7} "
        f"{'eager/floor':>11} {'graphs/floor':>12} {'graphs speedup':>14}"
    )
    best: dict[tuple[str, int], float] = {}  # the replayed step where there are graphs, else the eager one
    for batch in batches:
        inputs = decode_inputs(batch, args.context)
        floor_ms, bound = floor.ms(batch, args.context)
        for label, runner in runners.items():  # interleaved: a drift of the machine moves every backend alike
            print(f"{label}: decode steps of {batch}", file=sys.stderr, flush=True)
            eager, replayed = timed_steps(runner, inputs, args.repeats, device)
            best[label, batch] = eager if replayed is None else replayed
            line = f"{label:>14} {batch:>5} {args.context:>7} {eager:>9.2f} "
            print(line + against_floor(eager, replayed, floor_ms, bound), flush=True)
    if len(runners) > 1:
        print("\n".join(side_by_side(best, list(runners), batches, "CUDA graphs" if cuda else "eager")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
