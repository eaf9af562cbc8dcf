-- berth's SQLite schema, version 12: each user's own egress policy.
-- It mirrors migrations/postgres/0012_user_egress.sql.
--
-- Where a user's instances may connect when an operator set it for that
-- user; a user without a row has the node's ([isolation] egress). policy
-- is the JSON of berth_core::egress::EgressPolicy, checked before it is
-- written.
CREATE TABLE user_egress (
    user_id    TEXT    NOT NULL PRIMARY KEY,
    policy     TEXT    NOT NULL,
    -- The store's clock when it was last set.
    updated_at INTEGER NOT NULL
) WITHOUT ROWID;
