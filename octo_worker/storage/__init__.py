"""The worker's journal storage: the interface sessions and the daemon use, and its backends.

``interface`` holds the commit value types and the store protocols;
``documents`` the session and outbox documents every backend stores;
``scope_head``, ``changes``, ``sealing`` and ``base`` what every backend
shares (each scope's sealed head over its rows, change sets and their
decisions, sealed rows, the public API; group commit is
``octo_common.runtime.groupcommit``, the host's stores use it too);
``sqlite`` (with ``sqlite_writer``, ``sqlite_reader``, ``sqlite_rows`` and
``sqlite_heads``) the SQLite backend. A session or the daemon imports the
interface and the documents, never a backend module.
"""
