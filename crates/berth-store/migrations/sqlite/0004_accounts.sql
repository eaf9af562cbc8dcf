-- berth's SQLite schema, version 4: instance accounts.
--
-- The host uid (and gid, the same number) each user's instances run as at
-- isolation level `user` or `sandbox`. Allocated once per slug from the
-- configured range and never changed or reused, so a user's files keep
-- their owner across restarts, and no two users ever share one.
-- (Versions 3 and 5 belong to other changes.)
CREATE TABLE accounts (
    slug       TEXT    NOT NULL PRIMARY KEY,
    uid        INTEGER NOT NULL UNIQUE CHECK (uid >= 0 AND uid < 4294967295),
    -- The store's clock when the account was allocated.
    created_at INTEGER NOT NULL
);
