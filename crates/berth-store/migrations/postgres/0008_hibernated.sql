-- berth's PostgreSQL schema, version 8: hibernated instances (design
-- §4.5). It mirrors migrations/sqlite/0008_hibernated.sql.
--
-- A main idle for `hibernate_after_s` is frozen with its memory intact:
-- status 'hibernated', still live (it holds its lease and port), and
-- hibernated_at says since when.
ALTER TABLE instances DROP CONSTRAINT instances_status_check;
ALTER TABLE instances ADD CONSTRAINT instances_status_check
    CHECK (status IN ('starting', 'running', 'hibernated', 'crashed', 'stopped', 'failed'));
ALTER TABLE instances ADD COLUMN hibernated_at BIGINT;

-- A hibernated instance still holds its port.
DROP INDEX instances_live_port;
CREATE UNIQUE INDEX instances_live_port
    ON instances (node, port)
    WHERE status IN ('starting', 'running', 'hibernated', 'crashed');
