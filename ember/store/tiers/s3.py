"""The S3 remote tier: a store root under `s3://BUCKET/PREFIX/`, read with boto3's ranged GetObject.

The layout under the prefix is the HTTP origin's (`chunks/<2 hex>/<digest>`, `manifests/<name>/<version>.json`),
so one store root can be served by nginx and copied to a bucket as is. Endpoint, credentials and region come
from boto3's standard configuration (AWS_ENDPOINT_URL[_S3], AWS_ACCESS_KEY_ID, AWS_PROFILE, AWS_REGION,
AWS_MAX_ATTEMPTS, ...). boto3 is an optional dependency (`pip install 'ember[s3]'`), imported only when an
s3:// origin is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ember.errors import StoreError, TierUnavailable
from ember.store.manifest import Chunk
from ember.store.tiers.body import BodyCopier, Hasher, chunk_path, copy_chunk

# Error codes S3 (and compatible servers) answer for a key that does not exist.
_MISSING = {"NoSuchKey", "404", "NotFound"}


class _NotFound(Exception):
    pass


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket[/prefix]` -> (bucket, prefix ending in "/" or empty)."""
    if not url.startswith("s3://"):
        raise StoreError(f"origin {url!r} is not an s3:// URL")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise StoreError(f"origin {url!r} names no bucket")
    prefix = prefix.strip("/")
    return bucket, prefix + "/" if prefix else ""


class S3Tier:
    """Implements `ember.store.tiers.Remote`."""

    name = "origin"

    def __init__(self, url: str, *, timeout_s: float = 30.0, part_size: int = 16 << 20, threads: int = 4) -> None:
        self.base_url = url
        self._bucket, self._prefix = parse_s3_url(url)
        self._part = part_size
        self._client = self._make_client(timeout_s, threads)
        self._body = BodyCopier(f"origin {url}")
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ember-s3")

    def fetch(self, path: str) -> bytes | None:
        try:
            return self._call(path, lambda: self._get_object(path, None)["Body"].read())
        except _NotFound:
            return None

    def copy_to(self, chunk: Chunk, fds: Sequence[int]) -> str | None:
        """One ranged GET (hashed as it arrives) for a chunk up to the part size; parallel ones above it."""
        path = chunk_path(chunk)
        try:
            return copy_chunk(chunk, self._part, self._pool,
                              lambda span, hasher: self._copy_part(path, span, fds, hasher))
        except _NotFound:
            raise StoreError(f"origin {self.base_url} has no chunk {chunk.digest}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # -- boto3 ---------------------------------------------------------------------------------------------------
    def _make_client(self, timeout_s: float, threads: int) -> Any:
        try:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError
        except ImportError:
            raise StoreError(f"origin {self.base_url} needs boto3: pip install 'ember[s3]'") from None
        # Retries stay boto3's (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE); the pool holds a connection per part in flight
        # plus one per store thread asking for a small chunk meanwhile.
        config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, max_pool_connections=2 * threads)
        try:
            # A session of its own: boto3's default session is not safe to share across threads.
            return boto3.session.Session().client("s3", config=config)
        except (BotoCoreError, ValueError) as err:  # a bad endpoint URL or profile in the environment
            raise StoreError(f"origin {self.base_url}: cannot configure an S3 client: {err}") from None

    def _get_object(self, path: str, span: tuple[int, int] | None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"Bucket": self._bucket, "Key": self._prefix + path}
        if span is not None:
            kwargs["Range"] = f"bytes={span[0]}-{span[1] - 1}"
        result: dict[str, Any] = self._client.get_object(**kwargs)
        return result

    def _call(self, path: str, op: Any) -> Any:
        """Run `op` (requests and body reads), translating botocore's errors into the store's."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return op()
        except NoCredentialsError:
            raise TierUnavailable(f"origin {self.base_url}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
                                  "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)") from None
        except ClientError as err:
            code = str(err.response.get("Error", {}).get("Code", ""))
            if code in _MISSING:
                raise _NotFound(path) from None
            if code == "InvalidRange":  # the object is shorter than the manifest says
                raise StoreError(f"origin {self.base_url}: {path} is shorter than its manifest entry") from None
            raise TierUnavailable(f"origin {self.base_url} answered {code or err} for {path}") from None
        except BotoCoreError as err:  # endpoint, connection, timeout, credentials
            raise TierUnavailable(f"origin {self.base_url} is unreachable: {err}") from None

    # -- one part ------------------------------------------------------------------------------------------------
    def _copy_part(self, path: str, span: tuple[int, int], fds: Sequence[int], hasher: Hasher | None) -> None:
        def op() -> None:
            resp = self._get_object(path, span)
            body = resp["Body"]
            try:
                if resp.get("ContentLength") != span[1] - span[0]:
                    raise StoreError(f"origin {self.base_url}: {path} bytes {span[0]}-{span[1] - 1} came as "
                                     f"{resp.get('ContentLength')} bytes (a different object, or Range ignored)")
                self._body.copy(body, path, span, fds, hasher)
            finally:
                body.close()

        self._call(path, op)
