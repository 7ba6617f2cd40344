"""What the sampler costs per step on this device: `python -m bench.sampler_cost [--device cpu] [--threads 1]`.

Random logits of each shape, every row greedy, sampled at temperature 1, with top-p 0.9 and top-k 50, and
seeded; milliseconds per call of `workers.engine.sampling.sample` (the picks copied to the host included).
"""

import argparse
import time

import torch

from workers.engine.sampling import SamplingParams, sample

SHAPES = ((8, 4096), (32, 4096), (8, 32000), (32, 32000))
KINDS = {
    "greedy": lambda _row: SamplingParams(temperature=0.0),
    "temperature 1": lambda _row: SamplingParams(),
    "top-p 0.9, top-k 50": lambda _row: SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    "seeded": lambda row: SamplingParams(seed=row),
}


def milliseconds(logits: torch.Tensor, params: list[SamplingParams], calls: int) -> float:
    indices = [0] * len(params)
    sample(logits, params, indices)
    started = time.perf_counter()
    for _ in range(calls):
        sample(logits, params, indices)
    return (time.perf_counter() - started) * 1000 / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"ms per sample() call on {args.device}, {args.threads} thread(s)")
    print(f"{'rows x vocabulary':<18}" + "".join(f"{kind:>22}" for kind in KINDS))
    for rows, vocab in SHAPES:
        logits = torch.randn(rows, vocab, device=args.device) * 3
        cells = [milliseconds(logits, [make(row) for row in range(rows)], args.calls) for make in KINDS.values()]
        print(f"{f'{rows} x {vocab}':<18}" + "".join(f"{cell:>22.3f}" for cell in cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
