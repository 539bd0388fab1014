"""S3 object store on boto3: conditional writes, botocore retries, typed errors.

boto3 is used (not s3fs) for object operations because conditional PUTs
(``If-None-Match: *`` and ``If-Match: <etag>``) and botocore's retry modes are
first-class there. Transient failures (503 SlowDown, 500, timeouts,
connection resets) are retried by botocore's ``standard`` (default) or
``adaptive`` mode with exponential backoff and jitter; what survives the
retries becomes :class:`~storage.errors.TransientStorageError`. Nothing in
this module leaks a botocore type to callers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from storage.errors import PreconditionFailed, StorageError, TransientStorageError
from storage.objects import ObjectInfo, ObjectStore, StoredObject

_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestTimeTooSkewed", "503", "500", "502", "504"}
_PRECONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_SSE_MODES = {None, "AES256", "aws:kms"}


def _is_missing(e: Exception) -> bool:
    """True for S3's "no such key" answer (404 / NoSuchKey)."""
    from botocore.exceptions import ClientError

    if not isinstance(e, ClientError):
        return False
    code = str(e.response.get("Error", {}).get("Code", ""))
    status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code in ("NoSuchKey", "404", "NotFound") or status == "404"


class S3ObjectStore(ObjectStore):
    """Objects under ``s3://{bucket}/{prefix}``.

    Options: ``endpoint_url``, ``key``/``secret`` (or ``aws_access_key_id`` /
    ``aws_secret_access_key``, else the usual AWS environment), ``region``,
    ``retry_mode`` ("standard" | "adaptive"), ``max_attempts`` (default 5),
    ``connect_timeout`` / ``read_timeout`` in seconds, ``client`` (a ready
    boto3 S3 client, e.g. with fault-injection hooks registered).

    Server-side encryption: ``sse="AES256"`` (SSE-S3) or ``sse="aws:kms"``
    (SSE-KMS, with ``sse_kms_key_id`` naming the key, else the bucket's AWS
    managed key) is sent with every PUT, so every object the store writes
    (checkpoints, journal, run records, leases, index files) is encrypted
    at rest that way whatever the bucket's default. Reads need no option.
    """

    backend = "s3"

    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 key: str | None = None, secret: str | None = None, token: str | None = None,
                 region: str | None = None, retry_mode: str = "standard", max_attempts: int = 5,
                 connect_timeout: float = 5.0, read_timeout: float = 30.0, client: Any = None,
                 aws_access_key_id: str | None = None, aws_secret_access_key: str | None = None,
                 sse: str | None = None, sse_kms_key_id: str | None = None) -> None:
        if sse not in _SSE_MODES:
            raise ValueError(f"sse must be one of {sorted(m for m in _SSE_MODES if m)} or None, got {sse!r}")
        if sse_kms_key_id is not None and sse != "aws:kms":
            raise ValueError(f"sse_kms_key_id needs sse='aws:kms' (got sse={sse!r})")
        if sse_kms_key_id is not None and (not isinstance(sse_kms_key_id, str) or not sse_kms_key_id):
            raise ValueError(f"sse_kms_key_id must be a non-empty str, got {sse_kms_key_id!r}")
        #: Extra PUT arguments: the server-side encryption every write asks for.
        self._put_extra: dict[str, str] = {}
        if sse is not None:
            self._put_extra["ServerSideEncryption"] = sse
        if sse_kms_key_id is not None:
            self._put_extra["SSEKMSKeyId"] = sse_kms_key_id
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint_url = endpoint_url
        self._fs_options = {"endpoint_url": endpoint_url, "key": key or aws_access_key_id,
                            "secret": secret or aws_secret_access_key, "token": token, "region": region}
        if client is None:
            import boto3
            from botocore.config import Config

            config = Config(
                # total_max_attempts counts the first try (botocore's "max_attempts" would not).
                retries={"mode": retry_mode, "total_max_attempts": max_attempts},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                # One PUT carries the bytes; no extra checksum pass unless S3 demands it.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                max_pool_connections=32,
            )
            session = boto3.session.Session()
            client = session.client(
                "s3",
                endpoint_url=endpoint_url,
                aws_access_key_id=key or aws_access_key_id,
                aws_secret_access_key=secret or aws_secret_access_key,
                aws_session_token=token,
                region_name=region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
                config=config,
            )
        self.client = client

    # -- error mapping ---------------------------------------------------
    def _fail(self, e: Exception, key: str | None, op: str) -> StorageError:
        from botocore.exceptions import BotoCoreError, ClientError

        where = self.describe(key)
        if isinstance(e, ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _PRECONDITION_CODES or status in ("412", "409"):
                return PreconditionFailed(f"{where}: {op} precondition failed ({code or status})")
            if code in _TRANSIENT_CODES or status.startswith("5"):
                return TransientStorageError(f"{where}: {op} failed after retries ({code or status}): {e}")
            return StorageError(f"{where}: {op} failed ({code or status}): {e}")
        if isinstance(e, BotoCoreError):
            # Connection resets, timeouts, endpoint errors: botocore already retried these.
            return TransientStorageError(f"{where}: {op} failed after retries: {e}")
        return StorageError(f"{where}: {op} failed: {e!r}")

    def _key(self, key: str) -> str:
        return self.prefix + key

    # -- interface -------------------------------------------------------
    def put(self, *, key: str, data: bytes, if_none_match: bool = False, if_match: str | None = None) -> str:
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(key), "Body": data, **self._put_extra}
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        try:
            return self.client.put_object(**kwargs)["ETag"]
        except Exception as e:
            if if_match is not None and _is_missing(e):
                # S3 answers an If-Match PUT on a key deleted meanwhile with 404, not 412: the
                # compare-and-swap lost all the same (the caller reads again and decides).
                raise PreconditionFailed(f"{self.describe(key)}: PUT If-Match {if_match} precondition failed "
                                         "(the object no longer exists)") from e
            raise self._fail(e, key, "PUT") from e

    def get(self, *, key: str) -> StoredObject | None:
        from botocore.exceptions import ClientError

        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            data = resp["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._fail(e, key, "GET") from e
        except Exception as e:
            raise self._fail(e, key, "GET") from e
        return StoredObject(data, resp["ETag"])

    def list(self, *, prefix: str) -> Iterator[ObjectInfo]:
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
            for page in pages:
                for obj in page.get("Contents", ()):
                    yield ObjectInfo(obj["Key"][len(self.prefix):], obj["Size"], obj["ETag"], obj.get("LastModified"))
        except Exception as e:
            raise self._fail(e, prefix, "LIST") from e

    def list_dirs(self, *, prefix: str) -> list[str]:
        out: list[str] = []
        full = self._key(prefix)
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full, Delimiter="/")
            for page in pages:
                out.extend(p["Prefix"][len(full):].rstrip("/") for p in page.get("CommonPrefixes", ()))
        except Exception as e:
            raise self._fail(e, prefix, "LIST") from e
        return sorted(out)

    def delete(self, *, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
            try:
                resp = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            except Exception as e:
                raise self._fail(e, keys[i], "DELETE") from e
            errors = [err for err in resp.get("Errors", ()) if err.get("Code") != "NoSuchKey"]
            if errors:
                raise StorageError(f"{self.describe(errors[0]['Key'])}: DELETE failed: {errors[0].get('Message')}")

    def fsspec(self) -> tuple[Any, str]:
        import s3fs

        o = self._fs_options
        fs = s3fs.S3FileSystem(key=o["key"], secret=o["secret"], token=o["token"], endpoint_url=o["endpoint_url"],
                               client_kwargs={"region_name": o["region"]} if o["region"] else None,
                               use_listings_cache=False, skip_instance_cache=True)
        return fs, f"{self.bucket}/{self.prefix}".rstrip("/")

    def describe(self, key: str | None = None) -> str:
        where = f"s3://{self.bucket}/{self.prefix}"
        if self.endpoint_url:
            where += f" (endpoint {self.endpoint_url})"
        return where if key is None else f"{where} key {key!r}"

    def close(self) -> None:
        self.client.close()
