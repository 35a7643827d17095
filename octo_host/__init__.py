"""Octo host: plans, ledger, compensation policy and approvals, ledger store, client."""
