-- berth's PostgreSQL schema, version 2: launch parameters. It mirrors
-- migrations/sqlite/0002_launch_params.sql.
--
-- What each user's main was last launched with (folder and patch), so that
-- a node relaunching the user after a failover reproduces the launch. One
-- row per user, replaced by every launch; restarts keep it.
CREATE TABLE launch_params (
    user_id    TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    folder     TEXT   NOT NULL,
    -- berth_core::MAX_PATCH_BYTES, counted in bytes as the Rust side does.
    patch      TEXT   CHECK (octet_length(patch) <= 262144),
    -- The store's clock when the row was last written.
    updated_at BIGINT NOT NULL
);
