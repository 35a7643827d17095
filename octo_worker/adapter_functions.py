"""The public import path of function adapters (a re-export).

They live in :mod:`octo_worker.adapters.functions`.
"""

from octo_worker.adapters.functions import AdapterCall, FunctionAdapter, FunctionAdapterIncomplete

__all__ = ["AdapterCall", "FunctionAdapter", "FunctionAdapterIncomplete"]
