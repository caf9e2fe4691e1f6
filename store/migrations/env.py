"""Alembic's environment for the store: online only, on the connection ``store._migrate`` passes in.

``store._migrate`` runs every command inside a transaction it opened (and, on Postgres, under
its advisory lock), so this script never makes an engine or commits: it runs the revisions
on ``config.attributes["connection"]``. Nor does it configure logging (no ``fileConfig``):
the process that opens the store owns its logging.

Revision files are written by hand, or started with alembic's autogenerate against
``SQLModel.metadata`` and then read and trimmed like any other code.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection
from sqlmodel import SQLModel

import store._tables  # noqa: F401  (registers the tables in SQLModel.metadata)

if context.is_offline_mode():
    raise RuntimeError("tracetrain's migrations run online only, through store._migrate.upgrade")

connection = context.config.attributes.get("connection")
if not isinstance(connection, Connection):
    raise RuntimeError('run the migrations through store._migrate: config.attributes["connection"] is not set')

context.configure(
    connection=connection,
    target_metadata=SQLModel.metadata,
    render_as_batch=True,  # SQLite alters most columns only by copying the table; batch mode does that
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
