"""Accounts: API keys and the caller (authentication), prices, usage records, balances and quotas.

The lowest part of ``services``: it may import ``store``, ``protocol``, ``scheduling``, ``errors`` and ``clock``,
never another part of ``services``.
"""
