-- berth's SQLite schema, version 12: the holder index leaves lease_until
-- out. It mirrors migrations/postgres/0012_leases_holder.sql.
--
-- Every renew tick rewrites lease_until of every lease a node holds. With
-- lease_until in the index, each of those writes also moved the lease's
-- index entry (one delete and one insert in the index); at 10,000 leases
-- that was about as much work as the rest of the tick. Renew changes
-- neither holder nor released, so it leaves this index alone. The index
-- still finds a node's leases ("what do I own"), and now counts the
-- unreleased ones per node (placement) without reading the table.
DROP INDEX leases_holder;
CREATE INDEX leases_holder ON leases (holder, released);
