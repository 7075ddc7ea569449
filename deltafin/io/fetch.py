"""HTTP from a Hugging Face repository: whole small files and byte ranges of large ones.

URLs, the endpoint (``HF_ENDPOINT``), the token (``HF_TOKEN`` or a stored login) and the HTTP client
are huggingface_hub's; every URL names the commit the revision resolved to, so a repository that
moves on while a model runs cannot mix two versions. What this module adds is what range reads of
huge files need: a body that is not exactly the bytes asked for (cut short, too long, a 200 where
a 206 was due) is refetched, as are 429 / 5xx answers and broken connections, with exponential
backoff (``Retry-After`` honoured); other errors end at once with a message naming the file.

Every byte received is counted (``bytes_received``), wasted retries included: that is what the
network delivered.
"""
from __future__ import annotations

import importlib
import re
import threading
import time

from ..files import CheckpointError

TIMEOUT_S = 60.0
MAX_RETRY_AFTER_S = 60.0
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class HubError(CheckpointError):
    """The repository cannot be read: not found, not allowed, offline, or failing past the retries."""


class NotOnHub(HubError):
    """HTTP 404: no such repository, revision or file."""


class _Retry(Exception):
    def __init__(self, why: str, wait: float | None = None):
        super().__init__(why)
        self.wait = wait


class Remote:
    """One repository at one commit, read over HTTP."""

    def __init__(self, repo_id: str, commit: str, endpoint: str | None, retries: int, backoff: float):
        self.repo_id, self.commit, self.endpoint = repo_id, commit, endpoint
        self.retries, self.backoff = retries, backoff
        self.bytes_received = 0
        self.requests = 0
        self._lock = threading.Lock()

    def url(self, file: str) -> str:
        from huggingface_hub import hf_hub_url
        return hf_hub_url(self.repo_id, file, revision=self.commit, endpoint=self.endpoint)

    def get_file(self, file: str) -> bytes:
        """A whole (small) file."""
        return self._get(file, None)

    def get_range(self, file: str, start: int, end: int) -> tuple[bytes, int]:
        """Bytes [start, end) of `file`, and the file's total size."""
        return self._get(file, (start, end))

    def _get(self, file: str, span: tuple[int, int] | None):
        for attempt in range(self.retries + 1):
            try:
                return self._once(file, span)
            except _Retry as r:
                if attempt == self.retries:
                    raise HubError(f"{self.repo_id}/{file}: {r} (gave up after {self.retries + 1} attempts)") from None
                wait = r.wait if r.wait is not None else self.backoff * 2 ** attempt
                time.sleep(min(wait, MAX_RETRY_AFTER_S))
        raise AssertionError("unreachable")

    def _once(self, file: str, span: tuple[int, int] | None):
        from huggingface_hub.utils import build_hf_headers, get_session

        headers = build_hf_headers()
        headers["Accept-Encoding"] = "identity"  # byte offsets are offsets of the stored file
        if span is not None:
            headers["Range"] = f"bytes={span[0]}-{span[1] - 1}"
        with self._lock:
            self.requests += 1
        try:
            with get_session().stream("GET", self.url(file), headers=headers, follow_redirects=True,
                                      timeout=TIMEOUT_S) as r:
                self._check_status(file, r)
                want, total = self._expected(file, r, span)
                body = bytearray()
                for chunk in r.iter_raw():
                    body += chunk
                    with self._lock:
                        self.bytes_received += len(chunk)
                    if want is not None and len(body) > want:
                        raise _Retry(f"the server sent more than the {want} bytes asked for")
        except _client_errors("TransportError") as e:  # reset, refused, timed out, cut mid-body
            raise _Retry(f"connection failed ({type(e).__name__}: {e})") from None
        if want is not None and len(body) != want:
            raise _Retry(f"the body has {len(body)} bytes, {want} were due (cut short)")
        return bytes(body) if span is None else (bytes(body), total)

    def _check_status(self, file: str, r) -> None:
        code = r.status_code
        if code in (200, 206):
            return
        if code == 429 or code >= 500:
            raise _Retry(f"HTTP {code}", _retry_after(r.headers.get("Retry-After")))
        hint = {401: " (a gated or private repository: log in or set HF_TOKEN)",
                403: " (not allowed: check access to the repository and HF_TOKEN)",
                404: " (no such repository, revision or file)"}.get(code, "")
        raise (NotOnHub if code == 404 else HubError)(f"{self.repo_id}/{file} at {self.commit}: HTTP {code}{hint}")

    def _expected(self, file: str, r, span) -> tuple[int | None, int | None]:
        """(body length due, total file size) from the response headers."""
        length = r.headers.get("Content-Length")
        if span is None:
            return (int(length) if length is not None else None), None
        if r.status_code != 206:
            raise _Retry(f"HTTP {r.status_code} instead of 206 for a range request")
        m = CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", ""))
        if m is None or (int(m[1]), int(m[2]) + 1) != span or m[3] == "*":
            raise _Retry(f"the server answered range {r.headers.get('Content-Range')!r}, "
                         f"bytes {span[0]}-{span[1] - 1} were asked for")
        return span[1] - span[0], int(m[3])


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _client_errors(name: str) -> tuple[type[BaseException], ...]:
    """The HTTP client's error class `name` (HTTPError, TransportError): huggingface_hub's client is
    httpx2 in recent releases and httpx in older ones, so both are caught where installed."""
    out = []
    for module in ("httpx2", "httpx"):
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(out)


def resolve_commit(repo_id: str, revision: str, endpoint: str | None) -> str:
    """The commit `revision` (branch, tag or commit) of `repo_id` points to now."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    url = hf_hub_url(repo_id, "config.json", revision=revision, endpoint=endpoint)
    try:
        meta = get_hf_file_metadata(url, endpoint=endpoint, retry_on_errors=True)
    except HfHubHTTPError as e:
        raise HubError(f"{repo_id} (revision {revision}): cannot read its config.json from the Hugging Face hub "
                       f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
    except (*_client_errors("HTTPError"), OSError) as e:  # connection refused, DNS, ...
        raise HubError(f"{repo_id} (revision {revision}): cannot reach the Hugging Face hub "
                       f"({type(e).__name__}: {e})") from None
    if not meta.commit_hash or not re.fullmatch(r"[0-9a-f]{40}", meta.commit_hash):
        raise HubError(f"{repo_id} (revision {revision}): the hub named no commit for it "
                       f"(X-Repo-Commit: {meta.commit_hash!r})")
    return meta.commit_hash
