"""The store's schema revision, for tools that look before they open a store (``tracetrain db``).

``Store.open`` upgrades by itself; these are the same steps taken one at a time: which revisions
this release knows (``revisions``, ``head``), where a database is (``current_revision``: a
revision, ``LEGACY`` for one tracetrain 35c4648 wrote, None when empty), and ``upgrade``, which
reports what it did (``Upgrade``) and raises ``store.SchemaTooNew`` for a database a newer
tracetrain migrated. How each kind of database is upgraded is ``store._migrate``'s docstring.
"""

from store._migrate import LEGACY, Upgrade, current_revision, head, revisions, upgrade

__all__ = ["LEGACY", "Upgrade", "current_revision", "head", "revisions", "upgrade"]
