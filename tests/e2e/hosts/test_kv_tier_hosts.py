"""The shared KV tier across hosts: its store on a host of its own (bench.hosts.fleet, `kv_tier=True`), every
prefill and decode worker pointed at that host's address. A prompt prefilled on one prefill host is put to
the store across the link; a prompt sharing its prefix, sent once that host is gone, lands on the other
prefill host, which never computed it, loads the prefix's blocks from the store across the link, and
answers token for token what transformers' generate does. Then the store's host is lost under load: the
workers compute instead, and nothing is lost or billed twice."""

import asyncio
import random

import pytest
import torch

import diptych
from bench.hosts.fleet import KV_TIER_HOST, PREFILL_HOSTS, multi_host_platform
from bench.hosts.kv_tier import (
    BLOCK_SIZE,
    MAX_TOKENS,
    TAIL_TOKENS,
    prefill_of,
    stop_worker,
    tier_link_bytes,
    tier_sockets,
    tier_summary,
    timed,
    tokens,
    wait_for_puts,
)
from bench.hosts.launch import KV_TIER_PORT
from bench.hosts.network import SUBNET
from bench.hosts.run import fault_under_load, table
from tests.e2e.conftest import own_database
from tests.e2e.hosts.conftest import assert_nothing_left
from tests.e2e.test_generation import generate_reference
from workers.runner.kv_pool import kv_layout_of

PREFIX_TOKENS = 480  # 30 full blocks, shared by the two prompts
PROMPT_TOKENS = PREFIX_TOKENS + TAIL_TOKENS


@pytest.fixture(scope="module")
def hosts(namespaces, tmp_path_factory):
    with (
        own_database(tmp_path_factory.mktemp("tier-hosts-db")) as database_url,
        multi_host_platform(tmp_path_factory.mktemp("tier-hosts"), database_url, kv_tier=True) as platform,
    ):
        yield platform
    assert_nothing_left()


def test_a_prompt_prefilled_on_one_host_is_loaded_from_the_tier_on_another(hosts, reference):
    model, _ = reference
    block_nbytes = kv_layout_of(model.config, BLOCK_SIZE, torch.float32).block_nbytes
    tier_host = hosts.network.hosts[KV_TIER_HOST].address
    assert hosts.kv_tier_address == f"{tier_host}:{KV_TIER_PORT}"
    listening = [local for local, _ in tier_sockets(hosts, "listening")]
    assert listening == [tier_host], f"the store listens on {listening}, not its host's address alone"
    rng = random.Random(70)
    prefix = tokens(rng, PREFIX_TOKENS)
    prompt, again = prefix + tokens(rng, TAIL_TOKENS), prefix + tokens(rng, TAIL_TOKENS)
    fresh = tokens(rng, PROMPT_TOKENS)
    prefix_blocks = PREFIX_TOKENS // BLOCK_SIZE
    worker_names = {entry["id"]: name for name, entry in hosts.workers.items()}
    with diptych.Client(api_key=hosts.credentials.api_key, base_url=hosts.base_url) as client:
        received_before, _ = tier_link_bytes(hosts)
        first, computed_ttft = timed(hosts, client, prompt)
        computer = worker_names[prefill_of(first).worker_id]
        assert computer in PREFILL_HOSTS and prefill_of(first).cached_tokens == 0
        assert first.token_ids == generate_reference(model, prompt, MAX_TOKENS)
        assert wait_for_puts(hosts, computer, PROMPT_TOKENS // BLOCK_SIZE) >= PROMPT_TOKENS // BLOCK_SIZE
        received, _ = tier_link_bytes(hosts)
        assert received - received_before >= PROMPT_TOKENS // BLOCK_SIZE * block_nbytes, "the puts crossed no link"
        peers = {peer for _, peer in tier_sockets(hosts, "established")}
        assert hosts.network.hosts[computer].address in peers, peers

        stop_worker(hosts, computer)
        (other,) = [name for name in PREFILL_HOSTS if name != computer]
        tier_before, computed_before = tier_summary(hosts, other)
        _, sent_before = tier_link_bytes(hosts)
        second, loaded_ttft = timed(hosts, client, again)
        _, sent = tier_link_bytes(hosts)
        tier_after, computed_after = tier_summary(hosts, other)
        fresh_completion, fresh_ttft = timed(hosts, client, fresh)

    assert worker_names[prefill_of(second).worker_id] == other
    assert second.token_ids == generate_reference(model, again, MAX_TOKENS)
    assert prefill_of(second).cached_tokens == PREFIX_TOKENS == tier_after.hit_tokens - tier_before.hit_tokens
    assert computed_after - computed_before == TAIL_TOKENS
    assert sent - sent_before >= prefix_blocks * block_nbytes, "the blocks crossed no link"
    peers = {peer for _, peer in tier_sockets(hosts, "established")}
    assert hosts.network.hosts[other].address in peers, peers
    assert all(peer.startswith(f"{SUBNET}.") for peer in peers), f"a peer of the store is not a host: {peers}"
    assert worker_names[prefill_of(fresh_completion).worker_id] == other
    assert prefill_of(fresh_completion).cached_tokens == 0
    print(
        f"\n{PROMPT_TOKENS}-token prompts, {PREFIX_TOKENS} tokens of them loaded ({prefix_blocks} blocks, "
        f"{(sent - sent_before) / 1e6:.2f} MB sent by the store's host): TTFT computed on {computer} "
        f"{computed_ttft * 1000:.0f} ms (prefill {prefill_of(first).compute_ms} ms), loaded from the tier on "
        f"{other} {loaded_ttft * 1000:.0f} ms (prefill {prefill_of(second).compute_ms} ms), a fresh prompt "
        f"computed on {other} {fresh_ttft * 1000:.0f} ms (prefill {prefill_of(fresh_completion).compute_ms} ms); "
        f"the store's peers: {sorted(peers)}"
    )


def test_the_tier_host_lost_under_load_loses_and_doubles_nothing(hosts):
    # the module's last test: the store's host stays down
    before = {name: tier_summary(hosts, name)[0] for name in hosts.workers}
    outcome = asyncio.run(fault_under_load(hosts, "host-lost", 3.0, seed=71, restart=False, target=(KV_TIER_HOST,)))
    print(f"\n{table([outcome])}")
    r = outcome.reconciliation
    assert outcome.drained, "the gateway's usage did not reach the ledger"
    assert r.completed > 0 and not r.failed and r.delivered_tokens == r.billed_output_tokens, table([outcome])
    assert (r.lost, r.doubled, r.misattributed, r.overbilled) == (0, 0, 0, 0), table([outcome])
    assert outcome.completed_while_down > 0, "nothing was served while the store was gone"
    assert not any(outcome.kv_blocks_held.values()), f"KV blocks still held: {outcome.kv_blocks_held}"
    after = {name: tier_summary(hosts, name)[0] for name in hosts.workers}
    failed = {name: after[name].errors - before[name].errors for name in hosts.workers}
    assert any(failed.values()), f"no worker's call to the lost store failed: {failed}"
