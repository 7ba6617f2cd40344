"""The speculative-decoding settings of an engine and the worker's command-line flags for them."""

import argparse
from dataclasses import dataclass

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """How an engine drafts tokens: `method` "ngram" (prompt lookup) or "draft" (a smaller model)."""

    method: str
    num_draft_tokens: int = 4  # k: drafts proposed per request per step, at most
    ngram_min: int = 2  # ngram: the shortest run of last tokens that must recur to propose (1 drafts too eagerly)
    ngram_max: int = 4  # ngram: the longest run looked up (a longer match is preferred)
    draft_model: str = ""  # draft: builtin:<name> or a local Hugging Face model directory

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {', '.join(METHODS)}")
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"num_draft_tokens must be between 1 and 64, not {self.num_draft_tokens}")
        if self.method == "ngram" and not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"the n-gram sizes must satisfy 1 <= ngram_min <= ngram_max, not {self.ngram_min} and {self.ngram_max}"
            )
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs a draft model (builtin:<name> or a model directory)")
        if self.method == "ngram" and self.draft_model:
            raise ValueError("a draft model is only used by speculative method 'draft', not 'ngram'")


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's speculative-decoding flags (off unless --speculative is given)."""
    parser.add_argument(
        "--speculative",
        choices=METHODS,
        default=None,
        help="draft tokens on decoding requests and verify them in one step: ngram (prompt lookup) or "
        "draft (a smaller model of the same vocabulary, --draft-model); off by default",
    )
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="drafts per request per step, at most")
    parser.add_argument(
        "--ngram-min", type=int, default=SpecConfig.ngram_min, help="ngram: the shortest recurring run of last tokens"
    )
    parser.add_argument("--ngram-max", type=int, default=4, help="ngram: the longest run of last tokens looked up")
    parser.add_argument(
        "--draft-model", default="", help="draft: builtin:<name> or a local Hugging Face model directory"
    )


def spec_config_from_args(args: argparse.Namespace) -> SpecConfig | None:
    """The SpecConfig the flags ask for, or None when --speculative was not given (a draft flag without it
    is refused: it would silently do nothing)."""
    if args.speculative is None:
        if args.draft_model:
            raise ValueError("--draft-model needs --speculative draft")
        return None
    return SpecConfig(
        method=args.speculative,
        num_draft_tokens=args.num_draft_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        draft_model=args.draft_model,
    )
