-- berth's SQLite schema, version 2: launch parameters.
--
-- What each user's main was last launched with (folder and patch), so that
-- a node relaunching the user after a failover reproduces the launch. One
-- row per user, replaced by every launch; restarts keep it.
--
-- A plain rowid table rather than WITHOUT ROWID: a patch may be up to
-- 256 KiB, and SQLite recommends WITHOUT ROWID only for small rows.
CREATE TABLE launch_params (
    user_id    TEXT    NOT NULL PRIMARY KEY,
    folder     TEXT    NOT NULL,
    -- berth_core::MAX_PATCH_BYTES, counted in bytes as the Rust side does.
    patch      TEXT    CHECK (patch IS NULL OR length(CAST(patch AS BLOB)) <= 262144),
    -- The store's clock when the row was last written.
    updated_at INTEGER NOT NULL
);
