"""logit_bias, presence/frequency penalties and logprobs in the engine and the workers, against a reference
computed with `transformers` on the same model: a greedy loop over the model's logits with OpenAI's
rules applied (bias added; `frequency_penalty * count + presence_penalty * (count > 0)` taken off, counted
over the output tokens only), and logprobs the `log_softmax` of those logits (before temperature)."""

import asyncio

import pytest
import torch

from diptych_common.proto.v1 import worker_pb2
from tests.workers.conftest import prompts
from tests.workers.serving import Worker, split_calls
from tests.workers.test_engine import assert_all_blocks_free, settle
from tests.workers.test_spec_decode import SAME_MODEL_DRAFT
from workers.engine.core import RequestFailed
from workers.engine.request import EngineRequest
from workers.engine.sampler import Sampler, SamplingRow
from workers.engine.sampling import MIN_LOGPROB, SamplingParams, logprob_table, logprobs_of
from workers.serving.server import Role

# The engine's logits differ from `transformers`' in the last bits (another summation order: up to 5e-5
# per logit on the tiny model, docs/engine.md); a logprob is a logit less the log of a sum over them all.
LOGPROB_TOLERANCE = 3e-4


def controls(count: int, **options) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": count, "ignore_eos": True, **options})


def controlled_reference(model, prompt: list[int], count: int, params: SamplingParams, picks: list[int] | None = None):
    """(tokens, per token (logprob, top list)) of a loop over `model`'s logits with the request's bias and
    penalties; greedy unless `picks` gives the tokens (then only their logprobs are computed)."""
    ids, output, logprobs = list(prompt), [], []
    already = params.tokens_already_generated
    earlier = list(prompt[len(prompt) - already :]) if already else []
    for step in range(count):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        for token_id, bias in params.logit_bias:
            logits[token_id] += bias
        generated = earlier + output
        for token_id in set(generated):
            logits[token_id] -= params.frequency_penalty * generated.count(token_id) + params.presence_penalty
        token = int(logits.argmax()) if picks is None else picks[step]
        distribution = torch.log_softmax(logits, dim=-1)
        values, top_ids = torch.topk(distribution, params.top_logprobs) if params.top_logprobs else ([], [])
        best = list(zip(map(int, top_ids), map(float, values), strict=True))
        logprobs.append((float(distribution[token]), best))
        output.append(token)
        ids.append(token)
    return output, logprobs


async def run(engine, request_id: str, prompt: list[int], params: SamplingParams):
    """(tokens, logprobs) of one request on `engine`."""
    handle = engine.add(EngineRequest(request_id, prompt, params))
    tokens, logprobs = [], []
    while True:
        output = await handle.outputs.get()
        if isinstance(output, Exception):
            raise output
        tokens.append(output.token_id)
        logprobs.append(output.logprobs)
        if output.finished:
            return tokens, logprobs


def assert_logprobs_match(got, expected, top: int) -> None:
    assert len(got) == len(expected)
    for index, (mine, (logprob, best)) in enumerate(zip(got, expected, strict=True)):
        assert mine is not None, f"token {index} came without its logprobs"
        assert mine.logprob == pytest.approx(logprob, abs=LOGPROB_TOLERANCE), f"token {index}"
        assert len(mine.top) == top
        assert [token_id for token_id, _ in mine.top] == [token_id for token_id, _ in best], f"token {index}"
        for (_, value), (_, wanted) in zip(mine.top, best, strict=True):
            assert value == pytest.approx(wanted, abs=LOGPROB_TOLERANCE)


# ---- the pieces ------------------------------------------------------------------------------------


def test_bias_then_penalties_follow_openai_formula_and_count_each_pick_on():
    """The sampler's changes to a row, read back as its logprobs (the log_softmax of the changed row): bias
    added, then `frequency_penalty * count + presence_penalty * (count > 0)` over the output so far, given
    once as the row's history; the next step's row comes without it and counts the pick on."""
    sampler = Sampler()
    params = SamplingParams(
        temperature=0.0,
        logit_bias=((1, 5.0), (2, -3.0)),
        presence_penalty=0.5,
        frequency_penalty=2.0,
        logprobs=True,
        top_logprobs=8,
    )
    first = sampler(torch.zeros(1, 8), [SamplingRow("r", params, 4, history=(1, 1, 3, 1))])[0]
    expected = torch.tensor([0.0, 5.0 - 3 * 2.0 - 0.5, -3.0, -2.0 - 0.5, 0.0, 0.0, 0.0, 0.0])
    assert first.token_id == 0  # the first of the highest logits, 0.0
    assert_row(first.logprobs, expected)
    second = sampler(torch.zeros(1, 8), [SamplingRow("r", params, 5)])[0]
    expected[0] -= 2.0 + 0.5  # token 0 is in the output now
    assert_row(second.logprobs, expected)
    negative = SamplingParams(temperature=0.0, presence_penalty=-1.0, frequency_penalty=-0.5, logprobs=True)
    other = Sampler()(torch.zeros(1, 4), [SamplingRow("n", negative, 2, history=(2, 2))])[0]
    assert other.token_id == 2 and other.logprobs is not None
    assert other.logprobs.logprob == pytest.approx(float(torch.log_softmax(torch.tensor([0.0, 0, 2, 0]), -1)[2]))


def assert_row(logprobs, row: torch.Tensor) -> None:
    assert logprobs is not None
    expected = torch.log_softmax(row, dim=-1)
    assert sorted(token_id for token_id, _ in logprobs.top) == list(range(len(row)))
    for token_id, value in logprobs.top:
        assert value == pytest.approx(float(expected[token_id]), abs=1e-6)


def test_a_request_leaving_gives_back_its_counts_and_a_new_one_of_its_id_starts_afresh():
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=True, top_logprobs=4)
    sampler(torch.zeros(1, 4), [SamplingRow("r", params, 0, history=(3,))])
    assert len(sampler.counts) == 1
    sampler.forget(["r"])
    assert len(sampler.counts) == 0
    again = sampler(torch.zeros(1, 4), [SamplingRow("r", params, 0, history=())])[0]
    assert dict(again.logprobs.top)[3] == pytest.approx(float(torch.log_softmax(torch.zeros(4), -1)[0]))


def test_logprobs_are_the_log_softmax_and_a_ruled_out_token_reports_the_floor():
    rows = torch.tensor([[1.0, 3.0, 2.0, float("-inf")], [0.5, 0.0, 0.0, 2.0]])
    table = logprob_table(rows, torch.tensor([3, 0]), 2).tolist()
    got, other = logprobs_of(table[0], 2), logprobs_of(table[1], 0)
    expected = torch.log_softmax(rows, dim=-1)
    assert got.logprob == MIN_LOGPROB
    assert [token_id for token_id, _ in got.top] == [1, 2]
    assert got.top[0][1] == pytest.approx(float(expected[0, 1]))
    assert other.logprob == pytest.approx(float(expected[1, 0])) and other.top == ()


def test_a_batch_of_plain_requests_samples_the_models_logits_without_a_copy():
    logits = torch.randn(3, 16)
    plain = [SamplingRow(f"r{i}", SamplingParams(logprobs=True), 0) for i in range(3)]
    assert Sampler()._controlled(logits, plain, {}) == (logits, {})
    biased = [*plain[:2], SamplingRow("b", SamplingParams(logit_bias=((3, 1.0),)), 0)]
    changed, failed = Sampler()._controlled(logits, biased, {})
    assert changed is not logits and not failed
    assert torch.equal(changed[:2], logits[:2]) and changed[2, 3] == logits[2, 3] + 1.0


def test_a_sampler_call_crosses_to_the_host_once_with_the_logprobs_in_it(monkeypatch):
    """Picks, finite flags and logprobs of every row, penalties and bias among them, come in one copy."""
    copies = []
    original = torch.Tensor.tolist

    def counted(tensor):
        copies.append(tuple(tensor.shape))
        return original(tensor)

    rows = [
        SamplingRow("a", SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), 0),
        SamplingRow("b", SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=True), 2, history=(1, 5)),
        SamplingRow("c", SamplingParams(temperature=0.0, logit_bias=((4, 2.0),)), 1),
    ]
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    monkeypatch.setattr(torch.Tensor, "item", lambda tensor: pytest.fail("a second copy to the host"))
    sampled = Sampler()(torch.randn(3, 32), rows)
    assert len(copies) == 1
    assert all(row.logprobs is not None for row in sampled[:2]) and sampled[2].logprobs is None


# ---- the engine --------------------------------------------------------------------------------------


async def test_logit_bias_forces_and_bans_tokens_as_the_reference_does(make_engine, tiny_model):
    engine = make_engine()
    prompt = prompts([30], salt=5)[0]
    plain, _ = controlled_reference(tiny_model, prompt, 10, controls(10))
    banned = controls(10, logit_bias=tuple((token, -100.0) for token in sorted(set(plain))))
    forced = controls(10, logit_bias=((77, 100.0),))
    nudged = controls(10, logit_bias=((plain[1], -2.5), (plain[3], 1.5), (400, 4.0)))
    for name, params in (("banned", banned), ("forced", forced), ("nudged", nudged)):
        expected, _ = controlled_reference(tiny_model, prompt, 10, params)
        tokens, logprobs = await run(engine, name, prompt, params)
        assert tokens == expected, name
        assert logprobs == [None] * 10  # not asked for
    assert not set(plain) & set(controlled_reference(tiny_model, prompt, 10, banned)[0])
    assert controlled_reference(tiny_model, prompt, 10, forced)[0] == [77] * 10


@pytest.mark.parametrize(
    ("presence", "frequency"), [(0.0, 1.5), (1.2, 0.0), (0.7, 0.9), (-2.0, -2.0)], ids=["freq", "pres", "both", "neg"]
)
async def test_penalties_count_the_output_only_as_the_reference_does(make_engine, tiny_model, presence, frequency):
    engine = make_engine()
    start = prompts([24], salt=9)[0]
    # Its tokens are in the prompt several times: a penalty counting the prompt would show.
    prompt = start + controlled_reference(tiny_model, start, 2, controls(2))[0] * 3
    plain, _ = controlled_reference(tiny_model, prompt, 2, controls(2))
    # The random model seldom repeats a token: a bias towards its first two picks makes it, so that a positive
    # penalty has repeats to count; a negative one makes repeats of its own.
    bias = ((plain[0], 8.0), (plain[1], 8.0)) if presence + frequency > 0 else ()
    params = controls(
        16, presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias, logprobs=True, top_logprobs=3
    )
    expected, expected_logprobs = controlled_reference(tiny_model, prompt, 16, params)
    assert (
        expected != controlled_reference(tiny_model, prompt, 16, controls(16, logit_bias=bias))[0]
    )  # the penalties matter
    tokens, logprobs = await run(engine, "p", prompt, params)
    assert tokens == expected
    assert_logprobs_match(logprobs, expected_logprobs, 3)


async def test_logprobs_of_every_token_the_first_included_equal_the_log_softmax(make_engine, tiny_model):
    engine = make_engine()
    prompt = prompts([40], salt=3)[0]
    params = controls(8, logprobs=True, top_logprobs=5)
    expected, expected_logprobs = controlled_reference(tiny_model, prompt, 8, params)
    tokens, logprobs = await run(engine, "l", prompt, params)
    assert tokens == expected
    assert_logprobs_match(logprobs, expected_logprobs, 5)
    only_chosen = await run(engine, "c", prompt, controls(8, logprobs=True))
    assert [lp.top for lp in only_chosen[1]] == [()] * 8


async def test_logprobs_are_taken_before_temperature(make_engine, tiny_model):
    engine = make_engine()
    prompt = prompts([25], salt=4)[0]
    params = controls(8, temperature=0.4, seed=11, logprobs=True, top_logprobs=2, logit_bias=((9, 2.0),))
    tokens, logprobs = await run(engine, "t", prompt, params)
    _, expected_logprobs = controlled_reference(tiny_model, prompt, 8, params, picks=tokens)
    assert_logprobs_match(logprobs, expected_logprobs, 2)


async def test_a_migrated_request_counts_the_tokens_before_the_migration(make_engine, tiny_model):
    engine = make_engine()
    prompt = prompts([20], salt=6)[0]
    params = controls(14, presence_penalty=0.8, frequency_penalty=1.1, logprobs=True, top_logprobs=2)
    whole, whole_logprobs = await run(engine, "whole", prompt, params)
    assert whole == controlled_reference(tiny_model, prompt, 14, params)[0]
    for cut in (1, 5, 9):
        # the gateway re-runs prefill on prompt + the tokens sent, which count as output
        migrated = controls(
            14, presence_penalty=0.8, frequency_penalty=1.1, logprobs=True, top_logprobs=2, tokens_already_generated=cut
        )
        rest, rest_logprobs = await run(engine, f"m{cut}", prompt + whole[:cut], migrated)
        assert rest == whole[cut:]
        expected = [(lp.logprob, list(lp.top)) for lp in whole_logprobs[cut:]]
        assert_logprobs_match(rest_logprobs, expected, 2)


async def test_requests_with_controls_share_a_batch_with_plain_ones(make_engine, tiny_model):
    engine = make_engine()
    batch = prompts([12, 33, 50, 21], salt=8)
    options = [
        controls(7),
        controls(7, frequency_penalty=1.3, logprobs=True, top_logprobs=1),
        controls(7, logit_bias=((5, 100.0),)),
        controls(7, presence_penalty=1.0),
    ]
    results = await asyncio.gather(
        *(run(engine, f"b{i}", p, o) for i, (p, o) in enumerate(zip(batch, options, strict=True)))
    )
    for prompt, params, (tokens, _) in zip(batch, options, results, strict=True):
        assert tokens == controlled_reference(tiny_model, prompt, 7, params)[0]
    await settle(engine)
    assert_all_blocks_free(engine)


async def test_requests_with_controls_get_no_drafts(make_engine, tiny_model):
    engine = make_engine(speculative=SAME_MODEL_DRAFT)
    prompt = prompts([30], salt=2)[0]
    params = controls(12, frequency_penalty=1.5, presence_penalty=0.5)
    tokens, _ = await run(engine, "s", prompt, params)
    assert tokens == controlled_reference(tiny_model, prompt, 12, params)[0]
    assert engine.stats().draft_tokens_proposed == 0
    await run(engine, "plain", prompt, controls(12))
    assert engine.stats().draft_tokens_proposed > 0  # the engine does draft for a plain request


async def test_a_bias_outside_the_vocabulary_fails_the_request_alone(make_engine, tiny_model):
    engine = make_engine()
    prompt = prompts([10])[0]
    with pytest.raises(RequestFailed, match="logit_bias 512"):
        await run(engine, "bad", prompt, controls(3, logit_bias=((512, 1.0),)))
    with pytest.raises(RequestFailed, match="penalty"):
        await run(engine, "nan", prompt, controls(3, presence_penalty=float("nan")))
    assert (await run(engine, "ok", prompt, controls(3)))[0] == controlled_reference(
        tiny_model, prompt, 3, controls(3)
    )[0]


# ---- the workers: split and colocated ---------------------------------------------------------------


def worker_sampling(count: int, **options) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True, **options)


def from_proto(message: worker_pb2.TokenLogprobs):
    return (message.logprob, [(top.token_id, top.logprob) for top in message.top])


async def split_run(prefill, decode, request_id: str, prompt: list[int], sampling: worker_pb2.SamplingParams):
    decode_call, prefill_call = await split_calls(prefill, decode, request_id, prompt, sampling)
    prefill_events = [event async for event in prefill_call]
    first = prefill_events[0].first_token
    rest = [event async for event in decode_call]
    return [first.token_id] + [e.token_id for e in rest], [from_proto(first.logprobs)] + [
        from_proto(e.logprobs) for e in rest
    ]


async def test_split_and_colocated_workers_equal_the_reference(workers, tiny_model, executor):
    prefill, decode = workers
    colocated = Worker(Role.COLOCATED, tiny_model, executor, allow_shm=False)
    await colocated.start()
    try:
        prompt = prompts([45], salt=12)[0]
        plain, _ = controlled_reference(tiny_model, prompt, 4, controls(4))
        options = {
            "presence_penalty": 0.6,
            "frequency_penalty": 1.4,
            "logit_bias": {plain[0]: -100.0, 17: 3.0},
            "logprobs": True,
            "top_logprobs": 4,
        }
        params = controls(
            12,
            presence_penalty=0.6,
            frequency_penalty=1.4,
            logit_bias=tuple(sorted(options["logit_bias"].items())),
            logprobs=True,
            top_logprobs=4,
        )
        expected, expected_logprobs = controlled_reference(tiny_model, prompt, 12, params)
        tokens, logprobs = await split_run(prefill, decode, "split", prompt, worker_sampling(12, **options))
        assert tokens == expected
        events = [
            e
            async for e in colocated.stub.Generate(
                worker_pb2.GenerateWork(
                    request_id="colo", prompt_token_ids=prompt, sampling=worker_sampling(12, **options)
                )
            )
        ]
        assert [e.token_id for e in events] == expected
        colocated_logprobs = [from_proto(e.logprobs) for e in events]
        for got in (logprobs, colocated_logprobs):
            assert len(got) == 12
            for (logprob, best), (wanted, wanted_best) in zip(got, expected_logprobs, strict=True):
                assert logprob == pytest.approx(wanted, abs=LOGPROB_TOLERANCE)
                assert [t for t, _ in best] == [t for t, _ in wanted_best]
        # without logprobs asked for, none travel
        plain_events = [
            e
            async for e in colocated.stub.Generate(
                worker_pb2.GenerateWork(request_id="p", prompt_token_ids=prompt, sampling=worker_sampling(3))
            )
        ]
        assert not any(e.HasField("logprobs") for e in plain_events)
    finally:
        await colocated.stop()


async def test_the_decode_worker_counts_the_first_token_the_prefill_worker_sampled(workers, tiny_model):
    prefill, decode = workers
    prompt = prompts([30], salt=11)[0]
    params = controls(12, presence_penalty=-2.0, frequency_penalty=-2.0)
    expected, _ = controlled_reference(tiny_model, prompt, 12, params)
    assert expected[0] in expected[1:]  # the negative penalties make the first token come back
    sampling = worker_sampling(12, presence_penalty=-2.0, frequency_penalty=-2.0)
    tokens, _ = await split_run(prefill, decode, "first", prompt, sampling)
    assert tokens == expected
