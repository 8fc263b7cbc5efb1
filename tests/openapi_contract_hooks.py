"""schemathesis hooks for tests/server/test_openapi_contract.py (loaded with SCHEMATHESIS_HOOKS).

The built-in ``positive_data_acceptance`` check is replaced by `accepted_unless_semantic`:
every request the published schema allows must be accepted, except for refusals whose reason
JSON Schema cannot state because it depends on tokenizing the text or compiling what the user
sent. Each of those is listed in `tests.helpers.semantic_refusals.SEMANTIC` with how its 400
message reads; the context-length one is checked arithmetically from the numbers it names. Any
other 400 (or 413, 422) for schema-valid data fails the run, as the built-in check would.
"""

from __future__ import annotations

import schemathesis

from tests.helpers.semantic_refusals import semantic_reason


@schemathesis.check
def accepted_unless_semantic(ctx, response, case):
    """Schema-valid requests are accepted (2xx), or refused for a reason in `SEMANTIC`."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code not in (400, 413, 422):
        return None
    try:
        error = response.json()["error"]
        message = error if isinstance(error, str) else error["message"]  # (Ollama's: {"error": "..."})
    except Exception:  # noqa: BLE001 - any other body is a failure too
        message = response.text
    if response.status_code == 400 and semantic_reason(message) is not None:
        return None
    raise AssertionError(f"Schema-valid request rejected: {response.status_code}: {message}")
