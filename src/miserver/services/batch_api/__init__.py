"""The Batch API's rules: files, batches, Message Batches, batch operations, webhooks, idempotency, estimates, and
the searches the console shows.

The top part of ``services``: it may import every other part of ``services``, ``store``, ``scheduling``,
``protocol``; never ``batches`` (the runner), ``api`` or ``console``.
"""
