"""Octo worker: journal, adapters, sessions, SQLite store, RabbitMQ daemon."""
