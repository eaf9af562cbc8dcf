-- berth's PostgreSQL schema, version 9: where each node takes
-- node-to-node calls. It mirrors migrations/sqlite/0009_internal_url.sql.
--
-- Nodes call each other's `/internal/v1/…` API on a listener of its own
-- (`[cluster] internal_listen`), never on the public one; internal_url is
-- that listener's URL as the node advertises it. Empty until the node's
-- first heartbeat (and for a node of an earlier version, which has none).
ALTER TABLE nodes ADD COLUMN internal_url TEXT NOT NULL DEFAULT '';
