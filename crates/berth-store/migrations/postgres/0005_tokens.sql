-- berth's PostgreSQL schema, version 5: user tokens that expire, are listed
-- and revoked by a public id, and remember who minted them; admin sessions
-- (design §8.2). It mirrors migrations/sqlite/0005_tokens.sql.
--
-- Tokens from before this version get an id made of the first 16 hex
-- digits of their hash (public, and useless for guessing the token) and
-- expire 30 days after they were minted.

-- The token's public handle, for listing and revoking.
ALTER TABLE tokens ADD COLUMN id TEXT COLLATE "C";
-- The store's clock, Unix milliseconds.
ALTER TABLE tokens ADD COLUMN expires_at BIGINT;
-- When a node last looked the token up (a cache miss), not every use.
ALTER TABLE tokens ADD COLUMN last_used_at BIGINT;
-- The id of the user token this one was minted with; NULL when the admin
-- minted it. Revoking a token revokes what was minted with it.
ALTER TABLE tokens ADD COLUMN parent_id TEXT COLLATE "C";

UPDATE tokens SET id = substr(token_hash, 1, 16), expires_at = created_at + 2592000000;

ALTER TABLE tokens ALTER COLUMN id SET NOT NULL;
ALTER TABLE tokens ALTER COLUMN expires_at SET NOT NULL;
CREATE UNIQUE INDEX tokens_id ON tokens (id);

-- Counting a user's live tokens (the cap) and listing them.
DROP INDEX tokens_user;
CREATE INDEX tokens_user ON tokens (user_id, expires_at);
-- Finding what was minted with a revoked token.
CREATE INDEX tokens_parent ON tokens (parent_id);

-- The admin page's sessions: the SHA-256 of each session cookie's secret.
CREATE TABLE sessions (
    secret_hash TEXT   NOT NULL PRIMARY KEY,
    created_at  BIGINT NOT NULL,
    expires_at  BIGINT NOT NULL
);
