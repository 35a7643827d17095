"""The worker's journal storage: the interface sessions and the daemon use, and its backends.

``interface`` holds the commit value types and the store protocols;
``documents`` the session and outbox documents every backend stores;
``sqlite`` (with ``sqlite_writer`` and ``sqlite_reader``) the SQLite
backend. A session or the daemon imports the interface and the documents,
never a backend module.
"""
