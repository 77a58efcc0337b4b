"""Background jobs that are not batch work, started by the runtime beside the batch runner: webhook delivery
(``webhook_delivery``) and file pruning (``pruning``).

May import ``services``, ``store``, ``clock``; the batch runner does not import them.
"""
