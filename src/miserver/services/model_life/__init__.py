"""The resident model's life: residency (load, unload), the catalogue, weight writes and checkpoints.

Beside ``services.inference`` (it uses the service context and its admission gate); it may import
``services.inference``, ``services.accounts``, ``engines``, ``scheduling``, ``store``, ``protocol``; never
``services.batch_api``.
"""
