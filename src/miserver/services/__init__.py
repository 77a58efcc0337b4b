"""The services: the rules of every route and batch row, called by ``api/`` (synchronous requests), ``console/``
and ``batches/`` (rows): the one code path of DESIGN §2.

Four parts, layered bottom-up (a part imports only the parts below it, never one above):

- ``accounts``: API keys and who is calling, prices, usage, balances and quotas.
- ``inference``: the endpoint services (chat, completions, embeddings, probes, Responses, Messages), their shared
  checks, routing between the resident engine and upstreams, and the many-rows call the batch runner uses.
- ``model_life``: the resident model's residency, catalogue, weight writes and checkpoints (beside ``inference``).
- ``batch_api``: files, batches, Message Batches, batch operations, webhooks, idempotency and estimates.

Below them: ``store``, ``engines``, ``scheduling``, ``protocol``; above them: ``batches``, ``api``, ``console``.
"""
