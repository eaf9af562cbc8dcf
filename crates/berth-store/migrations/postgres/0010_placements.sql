-- berth's PostgreSQL schema, version 10: places reserved by placement. It
-- mirrors migrations/sqlite/0010_placements.sql.
--
-- Placement chooses a node from live counts: the leases each node holds
-- plus the places reserved for it here. A reservation bridges the moment
-- a node is chosen for `user_id` and the moment that node claims the
-- user's lease; the claim bumps the lease's epoch past the one recorded
-- here, and from then on the lease counts instead. One row per user (a
-- new choice replaces the old one); rows past `held_until` count for
-- nothing and are deleted by the next placement.
CREATE TABLE placements (
    user_id    TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    node       TEXT COLLATE "C" NOT NULL,
    -- The user's lease epoch when the place was reserved (0: no lease yet).
    epoch      BIGINT NOT NULL,
    held_until BIGINT NOT NULL
);

CREATE INDEX placements_node ON placements (node);
