"""S3 object store on boto3: conditional writes, botocore retries, typed errors.

boto3 (not s3fs) because conditional PUTs (``If-None-Match: *``, ``If-Match``)
and botocore's retry modes are first-class there. What survives the retries
becomes :class:`~storage.errors.TransientStorageError`; missing, wrong or
expired credentials (or a refused permission) surface at once, unretried, as
:class:`S3CredentialsError`. No botocore type leaks to callers. Region:
docs/storage.md.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterator
from typing import Any

import boto3
from botocore import exceptions as bx
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, ProfileNotFound

from .errors import PreconditionFailed, StorageConfigError, StorageError, TransientStorageError
from .objects import ObjectInfo, ObjectStore, StoredObject

_TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestTimeTooSkewed", "503", "500", "502", "504"}
_PRECONDITION_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_SSE_MODES = {None, "AES256", "aws:kms"}
_KEYS_HINT = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE naming a profile in ~/.aws "
              "(or pass key/secret to open_store)")
#: S3 error codes that mean "these credentials cannot do this": (problem, how to fix it). Never retried.
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId": ("the AWS access key id is not known to this S3 endpoint",
                           "check AWS_ACCESS_KEY_ID (or the profile's aws_access_key_id) and the endpoint"),
    "SignatureDoesNotMatch": ("the request signature does not match: the AWS secret access key is wrong for "
                              "this access key id", "check AWS_SECRET_ACCESS_KEY (or the profile's "
                              "aws_secret_access_key)"),
    "AccessDenied": ("access denied: the credentials in use are not allowed to do this here",
                     "grant them s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject on the bucket "
                     "and prefix, or use other credentials (AWS_PROFILE)"),
    "AllAccessDisabled": ("all access to this bucket has been disabled", "use another bucket or ask its owner"),
    "AccountProblem": ("the AWS account has a problem that prevents this operation", "contact AWS support"),
    "ExpiredToken": ("the AWS session token has expired", "refresh the credentials (e.g. `aws sso login`, or a "
                     "new AWS_SESSION_TOKEN) and try again"),
    "ExpiredTokenException": ("the AWS session token has expired", "refresh the credentials (e.g. `aws sso "
                              "login`, or a new AWS_SESSION_TOKEN) and try again"),
    "TokenRefreshRequired": ("the AWS session token must be refreshed", "refresh the credentials and try again"),
    "InvalidToken": ("the AWS session token is malformed or invalid", "check AWS_SESSION_TOKEN"),
    "InvalidClientTokenId": ("the AWS access key id or session token is invalid",
                             "check AWS_ACCESS_KEY_ID and AWS_SESSION_TOKEN"),
    "AuthorizationHeaderMalformed": ("the request was signed for another region than the bucket's",
                                     "set AWS_REGION (or the store's region option) to the bucket's region"),
}


class S3CredentialsError(StorageConfigError):
    """S3 refused a request for its credentials (missing, wrong, expired) or their permissions.

    Raised at once, never retried: retrying cannot fix it. The message names
    the store, the operation, the problem and how to fix it.
    """


def _is_missing(e: Exception) -> bool:
    """True for S3's "no such key" answer (404 / NoSuchKey)."""
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

    ``sse="AES256"`` or ``sse="aws:kms"`` (``sse_kms_key_id``: the key, else the
    bucket's AWS managed key) is sent with every PUT; reads need no option.
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
            config = Config(
                # total_max_attempts counts the first try (botocore's "max_attempts" would not).
                retries={"mode": retry_mode, "total_max_attempts": max_attempts},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                # One PUT carries the bytes; no extra checksum pass unless S3 demands it.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                # A reader fetches a checkpoint chain's objects 64 at a time (storage.index.CHAIN_FETCH_THREADS).
                max_pool_connections=64,
            )
            try:
                session = boto3.session.Session()
            except ProfileNotFound as e:
                raise S3CredentialsError(f"{self.describe()}: the AWS profile {e.kwargs.get('profile')!r} "
                                         "(AWS_PROFILE) is not in ~/.aws/config or ~/.aws/credentials; "
                                         "fix AWS_PROFILE or add the profile") from None
            # The profile's (or AWS_DEFAULT_REGION's) region when none is given: a bucket outside us-east-1
            # must not be signed for us-east-1 just because the region came from ~/.aws/config.
            region = region or os.environ.get("AWS_REGION") or session.region_name or "us-east-1"
            client = session.client(
                "s3",
                endpoint_url=endpoint_url,
                aws_access_key_id=key or aws_access_key_id,
                aws_secret_access_key=secret or aws_secret_access_key,
                aws_session_token=token,
                region_name=region,
                config=config,
            )
        self.client = client
        #: The region requests are signed for.
        self.region = region or getattr(getattr(client, "meta", None), "region_name", None)
        self._fs_options["region"] = self.region

    # -- error mapping ---------------------------------------------------
    def _fail(self, e: Exception, key: str | None, op: str) -> StorageError:
        where = self.describe(key)
        refused = self._credential_error(e, where, op)
        if refused is not None:
            return refused
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

    @staticmethod
    def _credential_error(e: Exception, where: str, op: str) -> S3CredentialsError | None:
        """:class:`S3CredentialsError` when ``e`` means the credentials (or their permissions) are the problem."""
        if isinstance(e, bx.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in _CREDENTIAL_CODES:
                problem, fix = _CREDENTIAL_CODES[code]
                return S3CredentialsError(f"{where}: {op} refused ({code}): {problem}; {fix}")
            return None
        if isinstance(e, bx.NoCredentialsError):
            return S3CredentialsError(f"{where}: {op} not sent: no AWS credentials found; {_KEYS_HINT}")
        if isinstance(e, bx.PartialCredentialsError):
            return S3CredentialsError(f"{where}: {op} not sent: incomplete AWS credentials ({e}); {_KEYS_HINT}")
        sso = tuple(getattr(bx, n) for n in ("SSOTokenLoadError", "UnauthorizedSSOTokenError", "TokenRetrievalError")
                    if hasattr(bx, n))
        if sso and isinstance(e, sso):
            return S3CredentialsError(f"{where}: {op} not sent: the AWS SSO session is missing or expired ({e}); "
                                      "run `aws sso login` (with the same AWS_PROFILE) and try again")
        if isinstance(e, (bx.CredentialRetrievalError, bx.ProfileNotFound, bx.UnknownCredentialError)):
            return S3CredentialsError(f"{where}: {op} not sent: AWS credentials could not be loaded ({e}); "
                                      f"{_KEYS_HINT}")
        return None

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

    def list_dirs(self, *, prefix: str) -> builtins.list[str]:
        out: list[str] = []
        full = self._key(prefix)
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full, Delimiter="/")
            for page in pages:
                out.extend(p["Prefix"][len(full):].rstrip("/") for p in page.get("CommonPrefixes", ()))
        except Exception as e:
            raise self._fail(e, prefix, "LIST") from e
        return sorted(out)

    def delete(self, *, keys: builtins.list[str]) -> None:
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
        try:
            import s3fs  # the [fsspec] extra: loads only when an outside reader asks for it
        except ImportError as e:
            raise ImportError("Store.fsspec() on an S3 store needs s3fs: pip install 'loomray[fsspec]'") from e

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
