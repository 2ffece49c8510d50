"""Persistence: conversations in SQLite, written and read back as plain records
(``records.py``); the store knows nothing of ``Conversation``."""

from clm_middleware.store.migrations import MIGRATIONS, migrate
from clm_middleware.store.records import ConversationChanges, ConversationRecord, StoredConversation
from clm_middleware.store.store import ConversationExistsError, Store, StoreError

__all__ = [
    "MIGRATIONS",
    "ConversationChanges",
    "ConversationExistsError",
    "ConversationRecord",
    "Store",
    "StoreError",
    "StoredConversation",
    "migrate",
]
