-- berth's SQLite schema, version 5: user tokens that expire, are listed and
-- revoked by a public id, and remember who minted them; admin sessions
-- (design §8.2). It mirrors migrations/postgres/0005_tokens.sql.
--
-- SQLite cannot add NOT NULL or UNIQUE columns to a table in place, so the
-- tokens table is rebuilt. Tokens from before this version get an id made
-- of the first 16 hex digits of their hash (public, and useless for
-- guessing the token) and expire 30 days after they were minted.
CREATE TABLE tokens_v5 (
    -- SHA-256 of the token, lowercase hex: the secret itself is never kept.
    token_hash   TEXT    NOT NULL PRIMARY KEY,
    -- The token's public handle, for listing and revoking.
    id           TEXT    NOT NULL UNIQUE,
    user_id      TEXT    NOT NULL,
    -- The store's clock, Unix milliseconds.
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    -- When a node last looked the token up (a cache miss), not every use.
    last_used_at INTEGER,
    -- The id of the user token this one was minted with; NULL when the
    -- admin minted it. Revoking a token revokes what was minted with it.
    parent_id    TEXT
) WITHOUT ROWID;

INSERT INTO tokens_v5 (token_hash, id, user_id, created_at, expires_at)
SELECT token_hash, substr(token_hash, 1, 16), user_id, created_at,
       created_at + 2592000000
FROM tokens;

DROP TABLE tokens;
ALTER TABLE tokens_v5 RENAME TO tokens;

-- Counting a user's live tokens (the cap) and listing them.
CREATE INDEX tokens_user ON tokens (user_id, expires_at);
-- Finding what was minted with a revoked token.
CREATE INDEX tokens_parent ON tokens (parent_id);

-- The admin page's sessions: the SHA-256 of each session cookie's secret.
CREATE TABLE sessions (
    secret_hash TEXT    NOT NULL PRIMARY KEY,
    created_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL
) WITHOUT ROWID;
