-- berth's PostgreSQL schema, version 4: instance accounts. It mirrors
-- migrations/sqlite/0004_accounts.sql.
--
-- The host uid (and gid, the same number) each user's instances run as at
-- isolation level `user` or `sandbox`. Allocated once per slug from the
-- configured range and never changed or reused, so a user's files keep
-- their owner on every node of the cluster, and no two users ever share
-- one: the UNIQUE constraint settles two nodes allocating at once.
-- (Versions 3 and 5 belong to other changes.)
CREATE TABLE accounts (
    slug       TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    uid        BIGINT NOT NULL UNIQUE CHECK (uid >= 0 AND uid < 4294967295),
    -- The store's clock when the account was allocated.
    created_at BIGINT NOT NULL
);
