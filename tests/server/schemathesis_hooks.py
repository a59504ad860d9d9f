"""Checks of ours for `schemathesis run` (loaded through SCHEMATHESIS_HOOKS by test_schemathesis.py)."""
from __future__ import annotations

import json

import schemathesis


@schemathesis.check
def every_error_is_the_json_error_object(ctx, response, case):
    """Every 4xx and 5xx answers {"error": {"message", "type", "param", "code"}} with a message."""
    if response.status_code < 400:
        return None
    content_type = response.headers.get("Content-Type") or response.headers.get("content-type") or [""]
    content_type = content_type[0] if isinstance(content_type, list) else content_type
    if not content_type.startswith("application/json"):
        raise AssertionError(f"a {response.status_code} answered {content_type!r}, not JSON")
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"a {response.status_code} without the error object: {response.content[:200]!r}")
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        raise AssertionError(f"a {response.status_code} with a malformed error object: {error}")
    return None
