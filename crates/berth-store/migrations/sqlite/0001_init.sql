-- berth's SQLite schema, version 1.
--
-- Conventions: times are INTEGER Unix milliseconds. Times the lease logic
-- compares (leases.lease_until, nodes.heartbeat) are written and compared
-- with the store's own clock, CAST(unixepoch('subsec') * 1000 AS INTEGER),
-- never a node's wall clock (design §3). Booleans are INTEGER 0/1. Enums
-- are stored as their lowercase names, as berth-core spells them.

-- One record per (user, role): the user's main instance and its watchdog.
CREATE TABLE instances (
    user_id     TEXT    NOT NULL,
    role        TEXT    NOT NULL CHECK (role IN ('main', 'watchdog')),
    id          TEXT    NOT NULL,
    status      TEXT    NOT NULL
                CHECK (status IN ('starting', 'running', 'crashed', 'stopped', 'failed')),
    node        TEXT    NOT NULL,
    epoch       INTEGER NOT NULL,
    port        INTEGER CHECK (port BETWEEN 0 AND 65535),
    pid         INTEGER CHECK (pid >= 0),
    -- /proc/<pid>/stat field 22; a u64 in Rust, so values above i64::MAX
    -- are refused by the store rather than wrapped.
    pid_start   INTEGER CHECK (pid_start >= 0),
    folder      TEXT    NOT NULL,
    started_at  INTEGER NOT NULL,
    ready       INTEGER NOT NULL CHECK (ready IN (0, 1)),
    restarts    INTEGER NOT NULL CHECK (restarts >= 0),
    last_error  TEXT,
    exit_code   INTEGER,
    last_active INTEGER NOT NULL,
    PRIMARY KEY (user_id, role)
) WITHOUT ROWID;

-- No port is ever recorded for two live instances on one node: a second
-- put_instance with a live (node, port) pair fails instead of silently
-- routing one user's traffic to another user's process.
CREATE UNIQUE INDEX instances_live_port
    ON instances (node, port)
    WHERE status IN ('starting', 'running', 'crashed');

CREATE INDEX instances_node ON instances (node);

-- The fenced lease of each user's main instance (design §3).
-- holder stays set after release as a sticky hint of where the user's data
-- may live; released tells a deliberate end from one that ran out.
CREATE TABLE leases (
    user_id     TEXT    NOT NULL PRIMARY KEY,
    holder      TEXT,
    epoch       INTEGER NOT NULL DEFAULT 0,
    lease_until INTEGER,
    released    INTEGER NOT NULL DEFAULT 0 CHECK (released IN (0, 1))
) WITHOUT ROWID;

-- "What do I own" is one indexed query per node.
CREATE INDEX leases_holder ON leases (holder, lease_until);

-- Crash history and breaker (design §4.3): berth_core::policy::CrashState
-- as JSON. A clear state has no row.
CREATE TABLE crash_state (
    user_id TEXT NOT NULL PRIMARY KEY,
    state   TEXT NOT NULL CHECK (json_valid(state))
) WITHOUT ROWID;

-- User tokens, stored only as hashes (design §8.2).
CREATE TABLE tokens (
    token_hash TEXT    NOT NULL PRIMARY KEY,
    user_id    TEXT    NOT NULL,
    created_at INTEGER NOT NULL
) WITHOUT ROWID;

CREATE INDEX tokens_user ON tokens (user_id);

-- Cluster nodes (design §8.1). heartbeat is the store's clock at the
-- node's last heartbeat; it is the evidence a lease takeover needs.
CREATE TABLE nodes (
    id            TEXT    NOT NULL PRIMARY KEY,
    advertise_url TEXT    NOT NULL,
    capacity      INTEGER NOT NULL CHECK (capacity >= 0),
    load          INTEGER NOT NULL CHECK (load >= 0),
    status        TEXT    NOT NULL CHECK (status IN ('up', 'draining', 'down')),
    heartbeat     INTEGER NOT NULL
) WITHOUT ROWID;
