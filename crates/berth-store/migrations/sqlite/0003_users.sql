-- berth's SQLite schema, version 3: users and their slugs (design §9).
--
-- The slug berth gives a user's files, DNS names and Kubernetes names,
-- recorded the first time berth needs it and never changed afterwards:
-- so no data root moves when the slug rule changes (earlier versions used
-- 8 hex digits of SHA-256; a user whose data root was made under such a
-- slug keeps it). slug is UNIQUE: two ids never share a slug, whatever
-- the rule produced for them. A slug is a DNS label of at most 43
-- characters (berth_core::MAX_SLUG_LEN), checked here as well.
CREATE TABLE users (
    user_id    TEXT    NOT NULL PRIMARY KEY,
    slug       TEXT    NOT NULL UNIQUE
               CHECK (length(slug) BETWEEN 1 AND 43
                      AND slug NOT GLOB '*[^a-z0-9-]*'
                      AND slug NOT GLOB '-*' AND slug NOT GLOB '*-'),
    -- The store's clock when the slug was recorded.
    created_at INTEGER NOT NULL
) WITHOUT ROWID;
