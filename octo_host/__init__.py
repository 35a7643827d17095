"""Octo host: plans, ledger, compensation policy and approvals, ledger store, client.

The package never imports :mod:`octo_worker`; the two meet only in octo_common.
"""
