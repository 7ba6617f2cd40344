"""OpenAI's organization usage and costs through the gateway, read with the official openai client
(`client.admin.organization.usage`): the gateway forwards /v1/organization/* to the live control plane,
which answers from its ledger in OpenAI's shapes."""

import asyncio
from datetime import UTC, datetime, timedelta

import openai
import pytest

from controlplane.billing.services import usage_events_ingest, usage_rollup
from controlplane.catalog.services import model_ensure, price_set
from controlplane.tenancy.models import Organization
from controlplane.tenancy.project_services import project_create
from controlplane.tenancy.services import api_key_create
from diptych_common.internal_api.messages import UsageEvent
from gateway.openai_api.batches import BatchApiProxy
from tests.gateway.harness import in_process_gateway

LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)


def report(api_key, request_id: str, phase: str, tokens: int, started_at: datetime) -> UsageEvent:
    return UsageEvent(
        request_id=request_id,
        phase=phase,
        organization_id=api_key.organization.public_id,
        api_key_id=api_key.public_id,
        model="diptych-tiny",
        region="local",
        worker_id="wrk_1",
        tokens=tokens,
        cached_tokens=0,
        kv_bytes=0,
        compute_ms=1,
        started_at=started_at.isoformat(),
        finished_at=started_at.isoformat(),
    )


@pytest.fixture
def usage(transactional_db):
    """An organization with one request in project Search yesterday (UTC), priced and rolled up."""
    model = model_ensure(
        name="diptych-tiny", source="builtin:diptych-tiny", context_length=2048, family="llama", dtype="float32"
    )
    for phase, micros in (("prefill", 1_000_000), ("cached_prefill", 500_000), ("decode", 2_000_000)):
        price_set(model=model, phase=phase, micros_per_million=micros, effective_from=LONG_AGO)
    organization = Organization.objects.create(name="Acme", slug="acme")
    search = project_create(organization=organization, name="Search")
    worker = api_key_create(organization=organization, name="search", project=search).api_key
    yesterday = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0) - timedelta(days=1)
    usage_events_ingest(
        reports=[
            report(worker, "exec_" + "1" * 32, "prefill", 300, yesterday),
            report(worker, "exec_" + "1" * 32, "decode", 50, yesterday),
        ]
    )
    usage_rollup()
    admin_key = api_key_create(organization=organization, name="admin", scopes=["admin:read"]).key
    day = int(yesterday.replace(hour=0).timestamp())
    return {"admin_key": admin_key, "project_id": search.public_id, "day": day}


def test_the_openai_client_reads_usage_and_costs_through_the_gateway(live_server, tmp_path, usage):
    async def read():
        proxy = BatchApiProxy(live_server.url)
        async with in_process_gateway(tmp_path, batch_api=proxy) as gateway:
            client = openai.AsyncOpenAI(
                base_url=str(gateway.http.make_url("/v1")), api_key="unused", admin_api_key=usage["admin_key"]
            )
            try:
                completions = await client.admin.organization.usage.completions(
                    start_time=usage["day"], end_time=usage["day"] + 86400, group_by=["project_id", "model"]
                )
                costs = await client.admin.organization.usage.costs(
                    start_time=usage["day"], end_time=usage["day"] + 86400, group_by=["project_id", "line_item"]
                )
            finally:
                await client.close()
                await proxy.close()
        return completions, costs

    completions, costs = asyncio.run(read())
    [bucket] = completions.data
    assert (bucket.start_time, bucket.end_time, completions.has_more) == (usage["day"], usage["day"] + 86400, False)
    [result] = bucket.results
    assert result.object == "organization.usage.completions.result"
    assert (result.input_tokens, result.output_tokens, result.num_model_requests) == (300, 50, 1)
    assert (result.project_id, result.model) == (usage["project_id"], "diptych-tiny")
    [bucket] = costs.data
    amounts = {item.line_item: item.amount.value for item in bucket.results}
    assert amounts == {"diptych-tiny, input": 0.0003, "diptych-tiny, output": 0.0001}
    assert {(item.project_id, item.amount.currency) for item in bucket.results} == {(usage["project_id"], "usd")}
