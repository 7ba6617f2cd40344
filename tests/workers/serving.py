"""Calls on workers served in this process (`bench.local_workers.Worker`, re-exported here with its secret):
what the worker tests (and the model-family tests) drive."""

from bench.local_workers import SECRET as SECRET
from bench.local_workers import Worker as Worker
from bench.local_workers import split_calls as split_calls
from diptych_common.proto.v1 import worker_pb2


def sampling(count: int) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)


async def split(
    prefill,
    decode,
    request_id: str,
    prompt: list[int],
    count: int,
    cache_salt: str = "",
    give_prompt: bool = False,
    params: worker_pb2.SamplingParams | None = None,
):
    """One split request: the decode call first, then the prefill call that sends it the KV; returns the
    prefill call's events and the decode call's. `give_prompt`: the decode call gives its prompt's token
    ids, as the gateway's does (the decode worker then pins the blocks of it it holds, and they are not sent).
    `params`: the calls' sampling (default: greedy, `count` tokens, past the end-of-sequence token)."""
    decode_call, prefill_call = await split_calls(
        prefill, decode, request_id, prompt, params or sampling(count), cache_salt, give_prompt
    )
    prefill_events = [e async for e in prefill_call]
    rest = [e async for e in decode_call]
    return prefill_events, rest
