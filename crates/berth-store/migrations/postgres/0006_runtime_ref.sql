-- berth's PostgreSQL schema, version 6: the runtime's reference of an
-- instance. It mirrors migrations/sqlite/0006_runtime_ref.sql.
--
-- The controller runs instances through a runtime (local shims, Kubernetes
-- pods) and records the runtime's own opaque name for the current run;
-- adoption after a restart of berth compares it, so a reused pid (or a
-- recreated pod) is never mistaken for the instance. It replaces
-- pid_start, which only the local runtime had.
ALTER TABLE instances ADD COLUMN runtime_ref TEXT;

-- Instances started before this version keep running across the upgrade:
-- their reference is what the local runtime names a run by, its program's
-- pid and start time (berth_local's runtime::ref_of).
UPDATE instances SET runtime_ref = 'pid ' || pid || ' start ' || pid_start
    WHERE pid IS NOT NULL AND pid_start IS NOT NULL;

ALTER TABLE instances DROP COLUMN pid_start;
