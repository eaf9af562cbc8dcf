-- berth's PostgreSQL schema, version 3: users and their slugs (design §9).
-- It mirrors migrations/sqlite/0003_users.sql.
--
-- The slug berth gives a user's files, DNS names and Kubernetes names,
-- recorded the first time berth needs it and never changed afterwards:
-- so no data root moves when the slug rule changes (earlier versions used
-- 8 hex digits of SHA-256; a user whose data root was made under such a
-- slug keeps it). slug is UNIQUE: two ids never share a slug, whatever
-- the rule produced for them, and the two unique constraints decide a
-- race between nodes. A slug is a DNS label of at most 43 characters
-- (berth_core::MAX_SLUG_LEN), checked here as well.
CREATE TABLE users (
    user_id    TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    slug       TEXT COLLATE "C" NOT NULL UNIQUE
               CHECK (slug ~ '^[a-z0-9]([-a-z0-9]{0,41}[a-z0-9])?$'),
    -- The store's clock when the slug was recorded.
    created_at BIGINT NOT NULL
);
