-- berth's PostgreSQL schema, version 1. It mirrors the SQLite schema
-- (migrations/sqlite/0001_init.sql) table for table.
--
-- Conventions: times are BIGINT Unix milliseconds. Times the lease logic
-- compares (leases.lease_until, nodes.heartbeat) are written and compared
-- with the store's own clock,
-- (extract(epoch FROM clock_timestamp()) * 1000)::bigint — clock_timestamp(),
-- not now(), which is frozen at the start of the transaction — never a
-- node's wall clock (design §3). Every integer is BIGINT so the Rust side
-- decodes one type and range-checks it, as it does for SQLite. Enums are
-- stored as their lowercase names, as berth-core spells them. Identifiers
-- use the "C" collation: byte order, as in SQLite, whatever locale the
-- cluster was created with.

-- One record per (user, role): the user's main instance and its watchdog.
CREATE TABLE instances (
    user_id     TEXT COLLATE "C" NOT NULL,
    role        TEXT    NOT NULL CHECK (role IN ('main', 'watchdog')),
    id          TEXT    NOT NULL,
    status      TEXT    NOT NULL
                CHECK (status IN ('starting', 'running', 'crashed', 'stopped', 'failed')),
    node        TEXT COLLATE "C" NOT NULL,
    epoch       BIGINT  NOT NULL,
    port        BIGINT  CHECK (port BETWEEN 0 AND 65535),
    pid         BIGINT  CHECK (pid >= 0),
    -- /proc/<pid>/stat field 22; a u64 in Rust, so values above i64::MAX
    -- are refused by the store rather than wrapped.
    pid_start   BIGINT  CHECK (pid_start >= 0),
    folder      TEXT    NOT NULL,
    started_at  BIGINT  NOT NULL,
    ready       BOOLEAN NOT NULL,
    restarts    BIGINT  NOT NULL CHECK (restarts >= 0),
    last_error  TEXT,
    exit_code   BIGINT,
    last_active BIGINT  NOT NULL,
    PRIMARY KEY (user_id, role)
);

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
--
-- Every renew tick rewrites lease_until of every live row. Half-empty pages
-- and no index on lease_until let PostgreSQL do those as HOT updates, in
-- the same page and without touching any index: measured on 10 000 leases,
-- that makes the tick about 2.5 times faster.
CREATE TABLE leases (
    user_id     TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    holder      TEXT COLLATE "C",
    epoch       BIGINT  NOT NULL DEFAULT 0,
    lease_until BIGINT,
    released    BOOLEAN NOT NULL DEFAULT false
) WITH (fillfactor = 50);

-- "What do I own" is one indexed query per node.
CREATE INDEX leases_holder ON leases (holder);

-- Crash history and breaker (design §4.3): berth_core::policy::CrashState
-- as JSON text, returned exactly as written. A clear state has no row.
CREATE TABLE crash_state (
    user_id TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    state   TEXT NOT NULL CHECK (state::jsonb IS NOT NULL)
);

-- User tokens, stored only as hashes (design §8.2).
CREATE TABLE tokens (
    token_hash TEXT   NOT NULL PRIMARY KEY,
    user_id    TEXT COLLATE "C" NOT NULL,
    created_at BIGINT NOT NULL
);

CREATE INDEX tokens_user ON tokens (user_id);

-- Cluster nodes (design §8.1). heartbeat is the store's clock at the
-- node's last heartbeat; it is the evidence a lease takeover needs.
CREATE TABLE nodes (
    id            TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    advertise_url TEXT   NOT NULL,
    capacity      BIGINT NOT NULL CHECK (capacity >= 0),
    load          BIGINT NOT NULL CHECK (load >= 0),
    status        TEXT   NOT NULL CHECK (status IN ('up', 'draining', 'down')),
    heartbeat     BIGINT NOT NULL
);
