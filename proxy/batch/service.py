"""The Batch API's operations for one owner at a time, and the lifecycle of its store and runner.

:meth:`BatchService.open` is the one owner of the lifecycle: it opens the store on its thread,
starts the runner (which resumes every unfinished batch) and, on exit, stops the runner (lines in
flight are cancelled and run again on the next start) and closes the store. Every operation takes
the ``owner`` (:func:`owner_of` of the caller's API key, never the key itself): another owner's file
or batch is answered exactly as a missing one (404).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from pathlib import Path
from typing import Any

from proxy.batch.jsonl import ENDPOINTS, MAX_FILE_BYTES
from proxy.batch.runner import CLAIM_S, POLL_S, BatchRunner, Executor
from proxy.batch.shapes import Json, new_id
from proxy.batch.store import BatchStore, NotCancellable, StoreThread
from proxy.errors import ApiError, bad_request

COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def owner_of(api_key: str) -> str:
    """The owner an API key stands for: a hash, so the database never holds a key."""
    return hashlib.sha256(b"pacer-batch:" + api_key.encode()).hexdigest()


def _not_found(what: str, object_id: str) -> ApiError:
    return ApiError(404, f"No such {what}: {object_id!r}", code="not_found")


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > MAX_METADATA_KEYS
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in metadata.items()
        )
    ):
        raise bad_request(
            f"metadata must be an object of at most {MAX_METADATA_KEYS} string values "
            f"(keys up to {MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})",
            param="metadata",
        )
    return metadata


class BatchService:
    def __init__(
        self, db: StoreThread, runner: BatchRunner, clock: Callable[[], float], body_timeout_s: float = 60.0
    ) -> None:
        self._db = db
        self._runner = runner
        self._clock = clock
        self.body_timeout_s = body_timeout_s  # each read of a request's body (a JSON body, a part, a chunk)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        data_dir: Path,
        executor: Executor,
        *,
        concurrency: int = 256,
        clock: Callable[[], float] = time.time,
        accepts_model: Callable[[str], bool] = lambda _model: True,
        body_timeout_s: float = 60.0,
        store_url: str = "",
        claim_s: float = CLAIM_S,
        poll_s: float = POLL_S,
    ) -> AsyncIterator[BatchService]:
        """The service on ``data_dir`` with its runner going; ``accepts_model`` says which models are
        served; ``body_timeout_s``: the most a client may take to send each piece of a body (0: no limit).
        ``store_url``: a PostgreSQL server the replicas share ("": the SQLite file in ``data_dir``);
        then ``claim_s`` (how long a dead replica's lines wait for another) and ``poll_s`` (how often
        the runner looks for other replicas' batches) apply: the proxy runs the constants of
        :mod:`proxy.batch.runner`; a test may pass shorter ones."""
        async with StoreThread.open(data_dir, store_url) as db:
            runner = BatchRunner(
                db,
                executor,
                concurrency=concurrency,
                clock=clock,
                accepts_model=accepts_model,
                claim_s=claim_s,
                poll_s=poll_s,
            )
            task = asyncio.create_task(runner.run(), name="batch runner")
            try:
                yield cls(db, runner, clock, body_timeout_s)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _now(self) -> int:
        return int(self._clock())

    # -- files ---------------------------------------------------------------------------------------

    async def upload_file(self, owner: str, *, filename: str, purpose: str, chunks: AsyncIterable[bytes]) -> Json:
        """Receive and keep a batch input file whose purpose is known before it arrives."""
        self.check_purpose(purpose)
        async with self.receiving(chunks) as staged:
            return await self.add_upload(owner, staged, filename=filename, purpose=purpose)

    @staticmethod
    def check_purpose(purpose: str) -> None:
        if purpose != "batch":
            raise bad_request(
                f"purpose must be 'batch' (the only purpose served here), got {purpose!r}", param="purpose"
            )

    @contextlib.asynccontextmanager
    async def receiving(self, chunks: AsyncIterable[bytes]) -> AsyncIterator[Path]:
        """Receive an uploaded file into the staging folder; past 200 MB it is refused (413) while it
        arrives. Yields the staged file, removed at the block's end unless :meth:`add_upload` took it."""
        staged = self._db.store.staging_dir / f"{new_id('upload-')}.part"
        loop = asyncio.get_running_loop()
        size = 0
        try:
            with staged.open("wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > MAX_FILE_BYTES:
                        raise ApiError(
                            413,
                            f"the file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MB, "
                            "the limit for a batch input file",
                            param="file",
                            code="file_too_large",
                        )
                    await loop.run_in_executor(None, out.write, chunk)
            yield staged
        finally:
            staged.unlink(missing_ok=True)

    async def add_upload(self, owner: str, staged: Path, *, filename: str, purpose: str) -> Json:
        """Keep a received file as a batch input file.

        Its lines are checked when a batch uses it (:mod:`proxy.batch.jsonl`), as OpenAI does.
        """
        self.check_purpose(purpose)
        return await self._db(
            BatchStore.add_file, owner, staged=staged, filename=filename, purpose=purpose, now=self._now()
        )

    async def list_files(
        self,
        owner: str,
        *,
        after: str | None = None,
        limit: int = 10_000,
        order: str = "desc",
        purpose: str | None = None,
    ) -> Json:
        if not 1 <= limit <= 10_000:
            raise bad_request("limit must be between 1 and 10000", param="limit")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", param="order")
        return await self._db(
            BatchStore.list_files, owner, after=after, limit=limit, ascending=order == "asc", purpose=purpose
        )

    async def get_file(self, owner: str, file_id: str) -> Json:
        found = await self._db(BatchStore.get_file, owner, file_id)
        if found is None:
            raise _not_found("File object", file_id)
        return found

    async def file_content(self, owner: str, file_id: str) -> Path:
        await self.get_file(owner, file_id)
        return await self._db(BatchStore.local_file, file_id)

    async def delete_file(self, owner: str, file_id: str) -> Json:
        if not await self._db(BatchStore.delete_file, owner, file_id):
            raise _not_found("File object", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches -------------------------------------------------------------------------------------

    async def create_batch(
        self, owner: str, *, input_file_id: Any, endpoint: Any, completion_window: Any, metadata: Any = None
    ) -> Json:
        """A ``validating`` batch; the runner validates its file and starts it."""
        if endpoint not in ENDPOINTS:
            raise bad_request(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
        if completion_window not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window must be '24h', got {completion_window!r}", param="completion_window")
        if not isinstance(input_file_id, str):
            raise bad_request("input_file_id must be a file id", param="input_file_id")
        checked_metadata = _check_metadata(metadata)
        input_file = await self._db(BatchStore.get_file, owner, input_file_id)
        if input_file is None:
            raise _not_found("File object", input_file_id)
        if input_file["purpose"] != "batch":
            raise bad_request(
                f"the file {input_file_id!r} has purpose {input_file['purpose']!r}, not 'batch'", param="input_file_id"
            )
        batch = await self._db(
            BatchStore.create_batch,
            owner,
            input_file_id=input_file_id,
            endpoint=endpoint,
            metadata=checked_metadata,
            now=self._now(),
            window_s=COMPLETION_WINDOWS[completion_window],
        )
        self._runner.kick()
        return batch

    async def get_batch(self, owner: str, batch_id: str) -> Json:
        found = await self._db(BatchStore.get_batch, owner, batch_id)
        if found is None:
            raise _not_found("batch", batch_id)
        return found

    async def list_batches(self, owner: str, *, after: str | None = None, limit: int = 20) -> Json:
        if not 1 <= limit <= 100:
            raise bad_request("limit must be between 1 and 100", param="limit")
        return await self._db(BatchStore.list_batches, owner, after=after, limit=limit)

    async def cancel_batch(self, owner: str, batch_id: str) -> Json:
        """``cancelling`` at once: no new line of it starts; running lines finish; then ``cancelled``."""
        try:
            batch = await self._db(BatchStore.request_cancel, owner, batch_id, self._now())
        except NotCancellable as exc:
            raise ApiError(409, str(exc), code="batch_not_cancellable") from None
        if batch is None:
            raise _not_found("batch", batch_id)
        self._runner.cancel(batch_id)
        return batch
