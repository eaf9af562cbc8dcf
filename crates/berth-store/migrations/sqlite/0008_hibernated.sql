-- berth's SQLite schema, version 8: hibernated instances (design §4.5).
--
-- A main idle for `hibernate_after_s` is frozen with its memory intact:
-- status 'hibernated', still live (it holds its lease and port), and
-- hibernated_at says since when. SQLite cannot change a CHECK constraint
-- in place, so the table is rebuilt with the same columns in the same
-- order, and its indexes made again (the live-port index now counts a
-- hibernated instance as live: its port stays held).
CREATE TABLE instances_v8 (
    user_id       TEXT    NOT NULL,
    role          TEXT    NOT NULL CHECK (role IN ('main', 'watchdog')),
    id            TEXT    NOT NULL,
    status        TEXT    NOT NULL
                  CHECK (status IN ('starting', 'running', 'hibernated', 'crashed', 'stopped', 'failed')),
    node          TEXT    NOT NULL,
    epoch         INTEGER NOT NULL,
    port          INTEGER CHECK (port BETWEEN 0 AND 65535),
    pid           INTEGER CHECK (pid >= 0),
    folder        TEXT    NOT NULL,
    started_at    INTEGER NOT NULL,
    ready         INTEGER NOT NULL CHECK (ready IN (0, 1)),
    restarts      INTEGER NOT NULL CHECK (restarts >= 0),
    last_error    TEXT,
    exit_code     INTEGER,
    last_active   INTEGER NOT NULL,
    runtime_ref   TEXT,
    hibernated_at INTEGER,
    PRIMARY KEY (user_id, role)
) WITHOUT ROWID;

INSERT INTO instances_v8 (user_id, role, id, status, node, epoch, port, pid, folder,
        started_at, ready, restarts, last_error, exit_code, last_active, runtime_ref)
    SELECT user_id, role, id, status, node, epoch, port, pid, folder,
        started_at, ready, restarts, last_error, exit_code, last_active, runtime_ref
    FROM instances;

DROP TABLE instances;
ALTER TABLE instances_v8 RENAME TO instances;

CREATE UNIQUE INDEX instances_live_port
    ON instances (node, port)
    WHERE status IN ('starting', 'running', 'hibernated', 'crashed');

CREATE INDEX instances_node ON instances (node);
