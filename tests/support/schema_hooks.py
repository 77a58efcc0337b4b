"""Schemathesis hooks of the schema fuzzing (``SCHEMATHESIS_HOOKS=tests.support.schema_hooks``).

Half the valid generated bodies that carry a ``model`` name the served model ``tiny`` (the schema can only say
"a string", and a random string is a 404 ``model_not_found``), so that the inference routes run past the model
check. Invalid bodies are left as generated: they must stay invalid for ``negative_data_rejection``.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode

#: The model name the fuzzed server serves (``tests.support.server.tiny_server_process``'s default).
SERVED_MODEL = "tiny"


@schemathesis.hook
def flatmap_case(context: Any, case: Any) -> Any:
    """The case as generated, or (for a valid body with a string ``model``) the same body naming ``tiny``."""
    body = case.body
    meta = case.meta
    if meta is None or meta.generation.mode is not GenerationMode.POSITIVE:
        return st.just(case)
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return st.just(case)
    served = case.derive()
    served.body = {**body, "model": SERVED_MODEL}
    return st.sampled_from([case, served])
