"""The Files and Batches endpoints with the ``openai`` client as the client, over a real port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.batch.conftest import (
    CHAT,
    FakeExecutor,
    Served,
    content_lines,
    jsonl,
    request_line,
    serve_batches,
    wait_final_over_http,
)
from tests.harness.wait import wait_until


@pytest.fixture
async def served(tmp_path: Path, store_url: str) -> AsyncIterator[Served]:
    executor = FakeExecutor(status_of=lambda content: 400 if content == "refused" else 200)
    async with serve_batches(tmp_path / "batches", executor, store_url=store_url) as served:
        yield served


async def upload(client: openai.AsyncOpenAI, data: bytes) -> str:
    return (await client.files.create(file=("input.jsonl", data), purpose="batch")).id


async def test_a_batch_from_upload_to_output_and_error_files(served: Served) -> None:
    client = served.client()
    data = jsonl(request_line("a"), request_line("refused"), request_line("b"))
    uploaded = await client.files.create(file=("input.jsonl", data), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.bytes, uploaded.filename) == (
        "file",
        "batch",
        len(data),
        "input.jsonl",
    )
    assert (await client.files.retrieve(uploaded.id)).id == uploaded.id
    assert (await client.files.content(uploaded.id)).content == data

    created = await client.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h", metadata={"job": "nightly"}
    )
    assert created.status == "validating" and created.metadata == {"job": "nightly"}
    batch = await wait_final_over_http(client, created.id)

    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 2, 1)
    assert batch.model == "m" and batch.completed_at is not None and batch.in_progress_at is not None
    assert batch.finalizing_at is not None and batch.cancelling_at is None
    assert batch.usage is not None  # the answered lines' own usage, summed (the refused one has none)
    assert (batch.usage.input_tokens, batch.usage.output_tokens, batch.usage.total_tokens) == (20, 2, 22)
    assert batch.usage.input_tokens_details.cached_tokens == 8
    assert batch.usage.output_tokens_details.reasoning_tokens == 2
    assert batch.output_file_id is not None and batch.error_file_id is not None

    output = await content_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == ["a", "b"]
    for line in output:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200
        assert line["response"]["request_id"] == f"req-{line['custom_id']}"
        assert line["response"]["body"]["choices"][0]["message"]["content"] == line["custom_id"]

    [refused] = await content_lines(client, batch.error_file_id)
    assert refused["custom_id"] == "refused" and refused["error"] is None
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["message"] == "refused"

    output_file = await client.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.bytes > 0


async def test_bad_lines_fail_the_batch_at_validation_naming_each_and_nothing_runs(tmp_path: Path) -> None:
    """As at OpenAI: a file with a line that is not a request the batch can send (here another url,
    a duplicate custom_id, a line that is not JSON) fails at validation, ``errors`` naming each line,
    and no line of it runs; a client never has to join results it cannot tell apart."""
    executor = FakeExecutor()
    async with serve_batches(tmp_path / "batches", executor) as served:
        client = served.client()
        data = jsonl(
            request_line("a"),
            request_line("x", url="/v1/completions"),
            request_line("a"),
            b'{"custom_id": "c", "body": ',
            request_line("b"),
        )
        file_id = await upload(client, data)
        created = await client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        batch = await wait_final_over_http(client, created.id)

        assert batch.status == "failed" and batch.failed_at is not None and batch.in_progress_at is None
        assert batch.errors is not None and batch.errors.data is not None
        assert [(e.code, e.line) for e in batch.errors.data] == [
            ("mismatched_url", 2),
            ("duplicate_custom_id", 3),
            ("invalid_json_line", 4),
        ]
        assert all(e.message and e.message.startswith(f"line {e.line}: ") for e in batch.errors.data)
        assert "line 2 " not in (batch.errors.data[2].message or "")  # the parser's own position is not quoted
        assert batch.output_file_id is None and batch.error_file_id is None
        assert executor.started == []


async def test_empty_metadata_comes_back_as_sent(served: Served) -> None:
    client = served.client()
    file_id = await upload(client, jsonl(request_line("a")))
    created = await client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={})
    assert created.metadata == {} and (await client.batches.retrieve(created.id)).metadata == {}


async def test_list_pages_newest_first(served: Served) -> None:
    client = served.client()
    file_id = await upload(client, jsonl(request_line("a")))
    ids = [
        (await client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")).id
        for _ in range(3)
    ]
    listed = await client.batches.list()
    assert [b.id for b in listed.data] == ids[::-1]
    first = await client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[:0:-1] and first.has_more
    rest = await client.batches.list(limit=2, after=ids[1])
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    assert [b.id async for b in client.batches.list(limit=1)] == ids[::-1]  # the client follows the pages
    files = await client.files.list(purpose="batch")
    assert [f.id for f in files.data] == [file_id]


async def test_cancel_lets_running_lines_finish_and_the_rest_end_in_the_error_file(
    tmp_path: Path, store_url: str
) -> None:
    gate = asyncio.Event()
    executor = FakeExecutor(gate=gate)
    async with serve_batches(tmp_path / "batches", executor, concurrency=2, store_url=store_url) as served:
        client = served.client()
        file_id = await upload(client, jsonl(*(request_line(c) for c in "abcd")))
        created = await client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
        await wait_until(lambda: executor.started == ["a", "b"], "executor.started == ['a', 'b']", timeout=20)

        cancelling = await client.batches.cancel(created.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        gate.set()
        batch = await wait_final_over_http(client, created.id)

        assert batch.status == "cancelled" and batch.cancelled_at is not None and batch.finalizing_at is None
        assert executor.started == ["a", "b"]  # nothing started after the cancel
        assert batch.output_file_id is not None and batch.error_file_id is not None
        assert [line["custom_id"] for line in await content_lines(client, batch.output_file_id)] == ["a", "b"]
        errors = await content_lines(client, batch.error_file_id)
        assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
            ("c", "batch_cancelled"),
            ("d", "batch_cancelled"),
        ]
        with pytest.raises(openai.ConflictError, match="cancelled"):
            await client.batches.cancel(created.id)


async def test_a_file_that_is_not_jsonl_fails_the_batch_naming_the_line(served: Served) -> None:
    client = served.client()
    file_id = await upload(client, b"\nthis is not json\n[1]\n")
    created = await client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    batch = await wait_final_over_http(client, created.id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.data is not None
    [error] = batch.errors.data
    assert (error.code, error.line) == ("invalid_json_line", 2)
    assert error.message is not None and "line 2" in error.message
    assert batch.output_file_id is None and batch.error_file_id is None


async def test_bad_purpose_is_refused_naming_it(served: Served) -> None:
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'") as caught:
        await served.client().files.create(file=("input.jsonl", jsonl(request_line("a"))), purpose="fine-tune")
    assert caught.value.param == "purpose"


async def _post_form(url: str, *fields: tuple[str, bytes | str, str | None]) -> tuple[int, dict[str, Any]]:
    """A multipart upload with the fields in the order given (name, value, filename: a file's)."""
    form = aiohttp.FormData()
    for name, value, filename in fields:
        form.add_field(name, value, filename=filename)  # bytes go as a file only with a filename
    headers = {"Authorization": "Bearer key-a"}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/files", data=form, headers=headers) as r:
        return r.status, await r.json()


async def test_the_form_fields_come_in_any_order(served: Served) -> None:
    """``curl -F file=@in.jsonl -F purpose=batch`` sends the file first: kept as with the purpose first."""
    data = jsonl(request_line("a"))
    status, body = await _post_form(served.url, ("file", data, "in.jsonl"), ("purpose", "batch", None))
    assert status == 200 and (body["purpose"], body["bytes"], body["filename"]) == ("batch", len(data), "in.jsonl")
    assert (await served.client().files.content(body["id"])).content == data
    status, body = await _post_form(served.url, ("file", data, "in.jsonl"), ("purpose", "fine-tune", None))
    assert status == 400 and body["error"]["param"] == "purpose"
    status, body = await _post_form(served.url, ("file", data, "in.jsonl"))
    assert status == 400 and "no 'purpose' field" in body["error"]["message"]
    assert [f.name for f in (served.service._db.store.staging_dir).iterdir()] == []  # nothing left half-kept


@pytest.mark.parametrize(
    ("head", "sent"),
    [
        pytest.param(
            b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"Content-Length: 100000\r\n\r\n",
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n{"custom_id"',
            id="an upload that stalls",
        ),
        pytest.param(
            b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n",
            b'{"input_file_id"',
            id="a batch's body that stops",
        ),
    ],
)
async def test_a_body_that_stops_arriving_is_cut_off_with_408(tmp_path: Path, head: bytes, sent: bytes) -> None:
    async with serve_batches(tmp_path / "batches", FakeExecutor(), body_timeout_s=0.5) as served:
        host, port = served.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + sent)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(4096), timeout=5)
        writer.close()
        await writer.wait_closed()  # else the server lingers for the rest of the body before it stops
        status, _, rest = data.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 408"), data
        assert b"proxy.body_timeout_s" in rest and b"connection: close" in rest.lower()
        assert list(served.service._db.store.staging_dir.iterdir()) == []  # the partial upload is not kept


async def test_unknown_input_file_is_404_naming_it(served: Served) -> None:
    with pytest.raises(openai.NotFoundError, match="file-nope"):
        await served.client().batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h")


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        pytest.param("endpoint", "/v1/embeddings", "endpoint must be one of", id="endpoint"),
        pytest.param("completion_window", "1h", "completion_window must be '24h'", id="window"),
    ],
)
async def test_bad_batch_fields_are_refused_naming_them(served: Served, field: str, value: str, named: str) -> None:
    client = served.client()
    fields = {
        "input_file_id": await upload(client, jsonl(request_line("a"))),
        "endpoint": CHAT,
        "completion_window": "24h",
    }
    with pytest.raises(openai.BadRequestError, match=named) as caught:
        await client.batches.create(**{**fields, field: value})
    assert caught.value.param == field and caught.value.status_code == 400


async def test_an_unknown_batch_is_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError, match="batch_nope"):
        await served.client().batches.retrieve("batch_nope")


async def test_another_key_sees_nothing_of_a_batch_or_file_it_did_not_create(served: Served) -> None:
    owner, stranger = served.client("key-a"), served.client("key-b")
    file_id = await upload(owner, jsonl(request_line("a")))
    created = await owner.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    batch = await wait_final_over_http(owner, created.id)
    assert batch.output_file_id is not None

    for attempt in (
        stranger.batches.retrieve(created.id),
        stranger.batches.cancel(created.id),
        stranger.files.retrieve(file_id),
        stranger.files.content(file_id),
        stranger.files.content(batch.output_file_id),
        stranger.files.delete(file_id),
        stranger.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            await attempt
    assert (await stranger.batches.list()).data == []
    assert (await stranger.files.list()).data == []

    assert (await owner.files.retrieve(file_id)).id == file_id  # the stranger's delete did nothing
    assert [b.id for b in (await owner.batches.list()).data] == [created.id]
