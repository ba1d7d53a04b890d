"""A schemathesis check of this project's, loaded by `schemathesis run` through SCHEMATHESIS_HOOKS.

The schema cannot express every rule (a prompt's length in tokens plus `max_tokens` within the
context, `min_tokens` <= `max_tokens`), so a schema-valid request may be refused with 400, but
only naming one of those fields; any other 400 on schema-valid data is a schema that lies.
"""

from __future__ import annotations

import schemathesis
from schemathesis.generation import GenerationMode

SEMANTIC_FIELDS = {"prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens"}
# Constraints on the output (lesson 15): whether a schema, regex or grammar compiles, which one constraint a
# request gives, and whether tool_choice names one of the tools are beyond what the OpenAPI schema can say.
SEMANTIC_PREFIXES = ("structured_outputs", "response_format", "tools", "tool_choice",
                     # Whether a server takes part in KV transfer, and in which role, is its configuration (lesson 18):
                     # a server started without --kv-transfer-config refuses kv_transfer_params, naming the field.
                     "kv_transfer_params")


@schemathesis.check
def semantic_refusals_only(ctx, response, case) -> None:
    if case.meta is None or case.meta.generation.mode is not GenerationMode.POSITIVE or response.status_code != 400:
        return None
    param = response.json()["error"]["param"]
    assert param in SEMANTIC_FIELDS or (param or "").startswith(SEMANTIC_PREFIXES), f"a schema-valid request was refused for {param!r}: {response.text}"
    return None
