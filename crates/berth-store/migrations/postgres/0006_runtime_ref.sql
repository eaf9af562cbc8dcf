-- berth's PostgreSQL schema, version 6: the runtime's reference of an
-- instance. It mirrors migrations/sqlite/0006_runtime_ref.sql.
--
-- The controller runs instances through a runtime (local shims, Kubernetes
-- pods) and records the runtime's own opaque name for the current run;
-- adoption after a restart of berth compares it, so a reused pid (or a
-- recreated pod) is never mistaken for the instance.
ALTER TABLE instances ADD COLUMN runtime_ref TEXT;
