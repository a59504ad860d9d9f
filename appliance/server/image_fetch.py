"""The chat API's image_url: base64 data: URLs always, http(s) URLs only from allow-listed hosts.

The server's only network client. Boards usually have no internet, so remote fetching is off
unless the operator lists hosts (`image_url_hosts`). Every redirect hop is checked against the
same allow-list: an allowed host must not be able to send the server anywhere else.
"""
from __future__ import annotations

import base64
import binascii
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from appliance.models.images import MAX_IMAGE_BYTES, ImageError

MAX_REDIRECTS = 3

_DATA_URL = re.compile(r"^data:(?P<mime>image/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


@dataclass
class ImageFetchPolicy:
    """Where images may come from: data: URLs always; http(s) URLs only from allowed hosts."""

    allowed_hosts: list[str] = field(default_factory=list)   # "camera.local", "*.lan"; empty: none
    max_bytes: int = MAX_IMAGE_BYTES
    timeout_s: float = 5.0

    def host_allowed(self, host: str) -> bool:
        host = host.lower()
        for pattern in self.allowed_hosts:
            pattern = pattern.lower()
            if host == pattern or (pattern.startswith("*.") and host.endswith(pattern[1:])):
                return True
        return False

    def check_url(self, url: str) -> None:
        """Refuse a URL this policy does not allow (an http(s) URL to an allow-listed host)."""
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ImageError(f"image_url.url must be a data: URL (data:image/...;base64,...) or an http(s) URL, "
                             f"not {url[:40]!r}")
        if not self.host_allowed(parsed.hostname):
            raise ImageError(f"remote image URLs are not allowed (host {parsed.hostname!r} is not in the "
                             f"server's image URL allow-list); send the image inline as a data: URL")

    def check_redirect(self, code: int, url: str) -> None:
        """Each redirect hop must stay on http(s) and on an allow-listed host."""
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ImageError(f"the image URL redirects ({code}) to {url[:40]!r}, which is not an http(s) URL")
        if not self.host_allowed(parsed.hostname):
            raise ImageError(f"the image URL redirects ({code}) to host {parsed.hostname!r}, which is not in "
                             f"the server's image URL allow-list")


def image_bytes_from_url(url: str, policy: ImageFetchPolicy | None = None) -> bytes:
    """The bytes an image_url names: a base64 data: URL, or an allow-listed http(s) URL."""
    policy = policy or ImageFetchPolicy()
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url must be a non-empty string")
    if url[:5].lower() == "data:":
        return _data_url_bytes(url, policy.max_bytes)
    policy.check_url(url)
    return _fetch(url, policy)


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    match = _DATA_URL.match(url)
    if not match or not match.group("b64"):
        raise ImageError("image_url.url must be a base64 data URL: data:image/<type>;base64,<data>")
    payload = url[match.end():]
    if len(payload) > 4 * (max_bytes // 3 + 1) + 4:
        raise ImageError(f"the image is over the limit of {max_bytes} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image's data URL is not valid base64") from None
    if len(data) > max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, over the limit of {max_bytes} bytes")
    return data


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows at most MAX_REDIRECTS hops, each to a URL the policy allows."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, policy: ImageFetchPolicy):
        super().__init__()
        self.policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.policy.check_redirect(code, newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, policy: ImageFetchPolicy) -> bytes:
    # No proxies from the environment: an allow-listed host is reached directly or not at all.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _CheckedRedirects(policy))
    try:
        with opener.open(url, timeout=policy.timeout_s) as response:
            data = response.read(policy.max_bytes + 1)
    except ImageError:
        raise
    except urllib.error.HTTPError as e:
        raise ImageError(f"could not fetch the image (HTTP {e.code} from {urllib.parse.urlsplit(url).hostname})") from None
    except Exception as e:
        raise ImageError(f"could not fetch the image ({type(e).__name__}: {e})") from None
    if len(data) > policy.max_bytes:
        raise ImageError(f"the image is over the limit of {policy.max_bytes} bytes")
    return data
