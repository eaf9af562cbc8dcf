-- berth's PostgreSQL schema, version 11: sign-in through an OpenID provider.
-- It mirrors migrations/sqlite/0011_logins.sql.

-- A session is now either the admin token's (user_id NULL) or a signed-in
-- user's, who may also be an admin (admin = 1). token_id names the user
-- token every app cookie of the login is minted under: revoking it (at
-- logout) revokes them all.
ALTER TABLE sessions ADD COLUMN user_id TEXT;
ALTER TABLE sessions ADD COLUMN admin BIGINT NOT NULL DEFAULT 1 CHECK (admin IN (0, 1));
ALTER TABLE sessions ADD COLUMN token_id TEXT;

-- A sign-in in progress at the provider, by the SHA-256 of its state
-- parameter: what the callback needs to finish it. Taken (deleted) by the
-- first callback that names it, so a state is good once.
CREATE TABLE login_attempts (
    state_hash    TEXT    NOT NULL PRIMARY KEY,
    pkce_verifier TEXT    NOT NULL,
    nonce         TEXT    NOT NULL,
    return_to     TEXT    NOT NULL,
    expires_at    BIGINT NOT NULL
);

-- A one-time code that carries a signed-in user from the berth host to
-- their app's own host, by the SHA-256 of the code; taken once.
CREATE TABLE login_hops (
    code_hash  TEXT    NOT NULL PRIMARY KEY,
    user_id    TEXT    NOT NULL,
    token_id   TEXT    NOT NULL,
    expires_at BIGINT NOT NULL
);
