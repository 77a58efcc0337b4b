"""The console's pages (thin: each reads the form or query, calls the services, renders a template), one module
per page: sign-in, the job list, the create page, a job's detail, usage, keys. ``render`` holds what they share.

``router`` gathers them in an order that matters: ``/batches/new`` is matched before ``/batches/{batch_id}``.
"""

from __future__ import annotations

from fastapi import APIRouter

from . import create, detail, jobs, keys, signin, usage

router = APIRouter()
for page in (signin, jobs, create, detail, usage, keys):
    router.include_router(page.router)
