"""Scheduling rules, pure and low in the house: the admission gate of an engine (``admission``) and which batch
runs next (``policy``: priority, deadlines, batch hours, fair share, the ETA model).

Imports nothing of miServer but ``errors``: ``engines``, ``services`` and ``batches`` all use it.
"""
