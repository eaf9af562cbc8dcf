//! Every statement both backends run, written once.
//!
//! The text keeps to what SQLite and PostgreSQL read alike:
//!
//! * placeholders are `$1`, `$2`, …: PostgreSQL's own, and sqlx binds an
//!   SQLite `$N` by the number in its name, as it does `?N`;
//! * casts are `CAST(x AS type)`, never PostgreSQL's `x::type`;
//! * booleans are tested as such (`NOT released`, `$4 AND …`) and written
//!   as `true`/`false`: SQLite stores them as 0/1 and reads `true`/`false`
//!   as those, and sqlx binds a `bool` to SQLite as 0/1;
//! * the lesser of two values is a `CASE`, since SQLite has no `LEAST` and
//!   PostgreSQL no scalar `min`.
//!
//! The store's clock is the one thing spelled differently everywhere:
//! `{now}` stands for the dialect's expression ([`super::Dialect::NOW_MS`]),
//! filled in once per process by [`Statements::with_clock`], so every
//! statement is then fixed text that the drivers' statement caches key on.
//!
//! Every lease decision is one conditional statement judged by whether a
//! row came back, and every time comparison reads the store's clock.

/// The shared statements of one dialect.
pub(crate) struct Statements {
    pub(crate) now: String,
    pub(crate) instance_upsert: String,
    pub(crate) instance_delete_fenced: String,
    pub(crate) instance_get: String,
    pub(crate) instance_list: String,
    pub(crate) instance_delete: String,
    pub(crate) lease_row: String,
    pub(crate) lease_get: String,
    pub(crate) lease_list: String,
    pub(crate) lease_held: String,
    pub(crate) claim: String,
    pub(crate) take_over: String,
    pub(crate) release: String,
    pub(crate) launch_params_put: String,
    pub(crate) launch_params_get: String,
    pub(crate) crash_state_get: String,
    pub(crate) crash_state_put: String,
    pub(crate) crash_state_delete: String,
    pub(crate) tokens_drop_expired: String,
    pub(crate) token_mint: String,
    pub(crate) tokens_live: String,
    pub(crate) token_use: String,
    pub(crate) tokens_list: String,
    pub(crate) token_revoke: String,
    pub(crate) sessions_drop_expired: String,
    pub(crate) session_create: String,
    pub(crate) session_expiry: String,
    pub(crate) session_delete: String,
    pub(crate) login_attempts_drop_expired: String,
    pub(crate) login_attempt_create: String,
    pub(crate) login_attempt_take: String,
    pub(crate) login_hops_drop_expired: String,
    pub(crate) login_hop_create: String,
    pub(crate) login_hop_take: String,
    pub(crate) user_slug_get: String,
    pub(crate) user_slug_insert: String,
    pub(crate) user_slugs_on_node: String,
    pub(crate) heartbeat: String,
    pub(crate) nodes_list: String,
    pub(crate) node_claim: String,
    pub(crate) node_get: String,
    pub(crate) placements_drop_expired: String,
    pub(crate) placement_nodes: String,
    pub(crate) placement_put: String,
    pub(crate) account_get: String,
    pub(crate) account_take_next: String,
    pub(crate) account_highest: String,
    pub(crate) accounts_list: String,
    pub(crate) user_egress_get: String,
    pub(crate) user_egress_put: String,
    pub(crate) user_egress_delete: String,
    pub(crate) account_egress_list: String,
}

/// The columns of an instance record, in the order of
/// [`Statements::instance_upsert`]'s placeholders.
macro_rules! instance_columns {
    () => {
        "user_id, role, id, status, node, epoch, port, pid, folder, started_at, \
         ready, restarts, last_error, exit_code, last_active, runtime_ref, hibernated_at"
    };
}

/// The lease columns up to `holder_alive`, which each query adds.
/// `expired` is computed in SQL so that it uses the store's clock.
macro_rules! lease_columns {
    () => {
        "SELECT user_id, holder, epoch, lease_until, released, \
         COALESCE(holder IS NOT NULL AND NOT released AND lease_until < {now}, false) AS expired, "
    };
}

impl Statements {
    /// The statements with `now_ms`, the dialect's clock, for `{now}`.
    pub(crate) fn with_clock(now_ms: &str) -> Self {
        let sql = |template: &str| template.replace("{now}", now_ms);
        Self {
            now: sql("SELECT {now} AS now"),

            // --- instance records ---------------------------------------

            // Inserts or replaces a (user, role) record. An upsert on the
            // primary key only: a clash on the live (node, port) index still
            // fails, where a replace would silently delete the other user's
            // record.
            //
            // A main's record is fenced: the update applies only over a
            // record written under a lower epoch, or the same epoch by the
            // same node. A refused update changes no row, which is how the
            // caller tells.
            instance_upsert: sql(concat!(
                "INSERT INTO instances (",
                instance_columns!(),
                ") VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17) ",
                "ON CONFLICT (user_id, role) DO UPDATE SET id = excluded.id, status = excluded.status, ",
                "node = excluded.node, epoch = excluded.epoch, port = excluded.port, pid = excluded.pid, ",
                "folder = excluded.folder, ",
                "started_at = excluded.started_at, ready = excluded.ready, restarts = excluded.restarts, ",
                "last_error = excluded.last_error, exit_code = excluded.exit_code, ",
                "last_active = excluded.last_active, runtime_ref = excluded.runtime_ref, ",
                "hibernated_at = excluded.hibernated_at ",
                "WHERE excluded.role = 'watchdog' OR instances.epoch < excluded.epoch ",
                "OR (instances.epoch = excluded.epoch AND instances.node = excluded.node)"
            )),
            // Deletes a main's record (user $1) under the fencing rule of
            // the upsert: node $2, epoch $3.
            instance_delete_fenced: sql("DELETE FROM instances \
                 WHERE user_id = $1 AND role = 'main' AND (epoch < $3 OR (epoch = $3 AND node = $2))"),
            instance_get: sql(concat!(
                "SELECT ",
                instance_columns!(),
                " FROM instances WHERE user_id = $1 AND role = $2"
            )),
            // Status $1, node $2, role $3; each NULL for "any".
            instance_list: sql(concat!(
                "SELECT ",
                instance_columns!(),
                " FROM instances WHERE (CAST($1 AS text) IS NULL OR status = $1) ",
                "AND (CAST($2 AS text) IS NULL OR node = $2) ",
                "AND (CAST($3 AS text) IS NULL OR role = $3) ORDER BY user_id, role"
            )),
            instance_delete: sql("DELETE FROM instances WHERE user_id = $1 AND role = $2"),

            // --- the lease ----------------------------------------------
            lease_row: sql(
                "INSERT INTO leases (user_id) VALUES ($1) ON CONFLICT (user_id) DO NOTHING",
            ),
            lease_get: sql(concat!(
                lease_columns!(),
                "CAST(NULL AS boolean) AS holder_alive FROM leases WHERE user_id = $1"
            )),
            // Every lease, or only expired ones when $1. $2 is the TTL that
            // judges the holder alive: the same test as the claim's evidence
            // clause, so "expired and holder not alive" is exactly what an
            // evidence claim with that TTL may take.
            lease_list: sql(concat!(
                lease_columns!(),
                "CASE WHEN holder IS NULL THEN NULL ELSE EXISTS (SELECT 1 FROM nodes ",
                "WHERE nodes.id = leases.holder AND nodes.heartbeat >= {now} - $2) ",
                "END AS holder_alive FROM leases ",
                "WHERE NOT $1 OR (holder IS NOT NULL AND NOT released AND lease_until < {now}) ",
                "ORDER BY user_id"
            )),
            // Live leases of node $1 only: an expired one is no longer this
            // node's to run, even if nobody has taken it yet; the node must
            // claim it again.
            lease_held: sql(concat!(
                lease_columns!(),
                "CAST(NULL AS boolean) AS holder_alive FROM leases ",
                "WHERE holder = $1 AND NOT released AND lease_until >= {now} ORDER BY user_id"
            )),
            // The claim of user $1's lease for node $2, for $3 ms
            // (invariant 1 in ARCHITECTURE.md). $4 is true when expired
            // leases may be taken from a holder whose heartbeat is older
            // than one TTL (or which never registered a heartbeat at all).
            //
            // PostgreSQL, under READ COMMITTED: a claimer that finds the row
            // locked by a concurrent claim waits, then re-checks this WHERE
            // against the row as committed, so of several simultaneous
            // claimers exactly one gets a row back. SQLite: one writer at a
            // time.
            claim: sql(concat!(
                "UPDATE leases SET holder = $2, epoch = epoch + 1, lease_until = {now} + $3, ",
                "released = false ",
                "WHERE user_id = $1 AND (holder IS NULL OR holder = $2 OR released OR (",
                "$4 AND lease_until < {now} AND NOT EXISTS (SELECT 1 FROM nodes ",
                "WHERE nodes.id = leases.holder AND nodes.heartbeat >= {now} - $3)",
                ")) RETURNING epoch"
            )),
            // An operator's takeover: any free, released or expired lease,
            // whoever held it. A released lease's `lease_until` is already
            // in the past.
            take_over: sql(concat!(
                "UPDATE leases SET holder = $2, epoch = epoch + 1, lease_until = {now} + $3, ",
                "released = false ",
                "WHERE user_id = $1 AND (holder IS NULL OR released OR lease_until < {now}) ",
                "RETURNING epoch"
            )),
            release: sql(concat!(
                "UPDATE leases SET lease_until = {now} - 1, released = true ",
                "WHERE user_id = $1 AND holder = $2 AND epoch = $3 AND NOT released ",
                "RETURNING user_id"
            )),

            // --- launch parameters and crash state ----------------------
            launch_params_put: sql(concat!(
                "INSERT INTO launch_params (user_id, folder, patch, updated_at) ",
                "VALUES ($1, $2, $3, {now}) ",
                "ON CONFLICT (user_id) DO UPDATE SET folder = excluded.folder, ",
                "patch = excluded.patch, updated_at = excluded.updated_at"
            )),
            launch_params_get: sql("SELECT folder, patch FROM launch_params WHERE user_id = $1"),
            crash_state_get: sql("SELECT state FROM crash_state WHERE user_id = $1"),
            crash_state_put: sql("INSERT INTO crash_state (user_id, state) VALUES ($1, $2) \
                 ON CONFLICT (user_id) DO UPDATE SET state = excluded.state"),
            crash_state_delete: sql("DELETE FROM crash_state WHERE user_id = $1"),

            // --- user tokens --------------------------------------------
            tokens_drop_expired: sql(
                "DELETE FROM tokens WHERE user_id = $1 AND expires_at <= {now}",
            ),
            // Hash $1, id $2, user $3, TTL $4, parent $5 (or NULL), cap $6.
            // Inserts nothing when the user has $6 live tokens, or the
            // parent is not a live token of the user's; the expiry is the
            // earlier of the TTL's and the parent's.
            token_mint: sql(concat!(
                "INSERT INTO tokens (token_hash, id, user_id, created_at, expires_at, parent_id) ",
                "SELECT $1, $2, $3, c.now, ",
                "CASE WHEN CAST($5 AS text) IS NULL OR c.now + $4 <= p.expires_at ",
                "THEN c.now + $4 ELSE p.expires_at END, $5 ",
                "FROM (SELECT {now} AS now) c ",
                "LEFT JOIN tokens p ON p.id = $5 AND p.user_id = $3 AND p.expires_at > c.now ",
                "WHERE (CAST($5 AS text) IS NULL OR p.id IS NOT NULL) ",
                "AND (SELECT count(*) FROM tokens WHERE user_id = $3 AND expires_at > c.now) < $6 ",
                "RETURNING id, user_id, created_at, expires_at, last_used_at, parent_id"
            )),
            tokens_live: sql(
                "SELECT count(*) AS live FROM tokens WHERE user_id = $1 AND expires_at > {now}",
            ),
            // The clock is read once: the time recorded as the last use is
            // the time the token was found live at, and the one returned.
            token_use: sql(concat!(
                "UPDATE tokens SET last_used_at = c.now FROM (SELECT {now} AS now) AS c ",
                "WHERE token_hash = $1 AND expires_at > c.now ",
                "RETURNING user_id, id, expires_at, last_used_at AS now"
            )),
            tokens_list: sql(concat!(
                "SELECT id, user_id, created_at, expires_at, last_used_at, parent_id FROM tokens ",
                "WHERE user_id = $1 AND expires_at > {now} ORDER BY created_at, id"
            )),
            // Token $1 of user $2, and every token minted with it, directly
            // or not.
            token_revoke: sql("WITH RECURSIVE doomed(id) AS ( \
                   SELECT id FROM tokens WHERE id = $1 AND user_id = $2 \
                   UNION SELECT t.id FROM tokens t JOIN doomed d ON t.parent_id = d.id \
                 ) DELETE FROM tokens WHERE id IN (SELECT id FROM doomed) RETURNING id"),

            // --- sessions and sign-in -----------------------------------
            sessions_drop_expired: sql("DELETE FROM sessions WHERE expires_at <= {now}"),
            session_create: sql(concat!(
                "INSERT INTO sessions (secret_hash, created_at, expires_at, user_id, admin, token_id) ",
                "SELECT $1, c.now, c.now + $2, $3, $4, $5 FROM (SELECT {now} AS now) c ",
                "RETURNING expires_at"
            )),
            session_expiry: sql(concat!(
                "SELECT expires_at, user_id, admin, token_id FROM sessions ",
                "WHERE secret_hash = $1 AND expires_at > {now}"
            )),
            session_delete: sql("DELETE FROM sessions WHERE secret_hash = $1"),
            login_attempts_drop_expired: sql(
                "DELETE FROM login_attempts WHERE expires_at <= {now}",
            ),
            login_attempt_create: sql(concat!(
                "INSERT INTO login_attempts (state_hash, pkce_verifier, nonce, return_to, expires_at) ",
                "VALUES ($1, $2, $3, $4, {now} + $5)"
            )),
            login_attempt_take: sql(concat!(
                "DELETE FROM login_attempts WHERE state_hash = $1 AND expires_at > {now} ",
                "RETURNING pkce_verifier, nonce, return_to"
            )),
            login_hops_drop_expired: sql("DELETE FROM login_hops WHERE expires_at <= {now}"),
            login_hop_create: sql(concat!(
                "INSERT INTO login_hops (code_hash, user_id, token_id, expires_at) ",
                "VALUES ($1, $2, $3, {now} + $4)"
            )),
            login_hop_take: sql(concat!(
                "DELETE FROM login_hops WHERE code_hash = $1 AND expires_at > {now} ",
                "RETURNING user_id, token_id"
            )),

            // --- users and their slugs -----------------------------------
            user_slug_get: sql("SELECT slug FROM users WHERE user_id = $1"),
            // Records slug $2 for user $1. A concurrent first record for the
            // same user makes it insert nothing (the caller reads theirs
            // back); the same slug recorded for another user fails on the
            // slug's unique constraint.
            user_slug_insert: sql(
                "INSERT INTO users (user_id, slug, created_at) VALUES ($1, $2, {now}) \
                 ON CONFLICT (user_id) DO NOTHING",
            ),
            user_slugs_on_node: sql("SELECT DISTINCT users.user_id, users.slug FROM users \
                 JOIN instances ON instances.user_id = users.user_id WHERE instances.node = $1"),

            // --- nodes --------------------------------------------------
            heartbeat: sql(concat!(
                "INSERT INTO nodes (id, advertise_url, capacity, load, status, heartbeat, internal_url) ",
                "VALUES ($1, $2, $3, $4, $5, {now}, $6) ",
                "ON CONFLICT (id) DO UPDATE SET advertise_url = excluded.advertise_url, ",
                "internal_url = excluded.internal_url, ",
                "capacity = excluded.capacity, load = excluded.load, status = excluded.status, ",
                "heartbeat = excluded.heartbeat"
            )),
            nodes_list: sql(
                "SELECT id, advertise_url, internal_url, capacity, load, status, heartbeat \
                 FROM nodes ORDER BY id",
            ),
            // Claims node id $1 for data dir $2: a new row, or one that is
            // `down`, older than the TTL $3, or last claimed from $2.
            node_claim: sql(concat!(
                "INSERT INTO nodes (id, advertise_url, capacity, load, status, heartbeat, data_dir_id) ",
                "VALUES ($1, '', 0, 0, 'up', {now}, $2) ",
                "ON CONFLICT (id) DO UPDATE SET data_dir_id = excluded.data_dir_id, ",
                "heartbeat = excluded.heartbeat, ",
                "status = CASE WHEN nodes.status = 'down' THEN 'up' ELSE nodes.status END ",
                "WHERE nodes.status = 'down' OR nodes.heartbeat < excluded.heartbeat - $3 ",
                "OR nodes.data_dir_id = excluded.data_dir_id ",
                "RETURNING id"
            )),
            node_get: sql(
                "SELECT id, advertise_url, internal_url, capacity, load, status, heartbeat \
                 FROM nodes WHERE id = $1",
            ),

            // --- placement ----------------------------------------------
            placements_drop_expired: sql("DELETE FROM placements WHERE held_until < {now}"),
            // Every node's row with `load` replaced by its live count: the
            // leases it holds and has not released (expired ones too: their
            // instance may still run there, frozen, until another node
            // claims the lease), plus the places reserved for it whose
            // user's lease has not been claimed since (a claim bumps the
            // epoch past the reservation's, and the lease counts instead).
            placement_nodes: sql(concat!(
                "SELECT n.id, n.advertise_url, n.internal_url, n.capacity, n.status, n.heartbeat, {now} AS now, ",
                "(SELECT count(*) FROM leases l WHERE l.holder = n.id AND NOT l.released) ",
                "+ (SELECT count(*) FROM placements p WHERE p.node = n.id AND p.held_until >= {now} ",
                "AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.user_id = p.user_id AND l.epoch > p.epoch)",
                ") AS load FROM nodes n ORDER BY n.id"
            )),
            // Reserves a place for user $1 on node $2 for $3 ms, recording
            // the user's lease epoch now; replaces the user's earlier
            // reservation. (`WHERE true` lets SQLite read the upsert after
            // an INSERT … SELECT.)
            placement_put: sql(concat!(
                "INSERT INTO placements (user_id, node, epoch, held_until) ",
                "SELECT $1, $2, COALESCE((SELECT epoch FROM leases WHERE user_id = $1), 0), ",
                "{now} + $3 WHERE true ",
                "ON CONFLICT (user_id) DO UPDATE SET node = excluded.node, ",
                "epoch = excluded.epoch, held_until = excluded.held_until"
            )),

            // --- accounts -----------------------------------------------
            account_get: sql("SELECT uid FROM accounts WHERE slug = $1"),
            // Gives slug $1 the uid after the highest taken in $2..=$3, in
            // one statement. A slug or uid taken meanwhile by another node
            // makes it insert nothing (the unique constraints, not a lock,
            // decide).
            account_take_next: sql(concat!(
                "INSERT INTO accounts (slug, uid, created_at) ",
                "SELECT $1, COALESCE(MAX(uid) + 1, CAST($2 AS bigint)), {now} ",
                "FROM accounts WHERE uid BETWEEN $2 AND $3 ",
                "HAVING COALESCE(MAX(uid) + 1, CAST($2 AS bigint)) <= $3 ",
                "ON CONFLICT DO NOTHING RETURNING uid"
            )),
            account_highest: sql(
                "SELECT MAX(uid) AS uid FROM accounts WHERE uid BETWEEN $1 AND $2",
            ),
            accounts_list: sql("SELECT slug, uid FROM accounts ORDER BY uid"),

            // --- users' own egress policies ----------------------------
            user_egress_get: sql("SELECT policy FROM user_egress WHERE user_id = $1"),
            user_egress_put: sql(
                "INSERT INTO user_egress (user_id, policy, updated_at) VALUES ($1, $2, {now}) \
                 ON CONFLICT (user_id) DO UPDATE SET policy = excluded.policy, \
                 updated_at = excluded.updated_at",
            ),
            user_egress_delete: sql("DELETE FROM user_egress WHERE user_id = $1"),
            account_egress_list: sql(
                "SELECT accounts.uid, accounts.slug, user_egress.policy FROM user_egress \
                 JOIN users ON users.user_id = user_egress.user_id \
                 JOIN accounts ON accounts.slug = users.slug ORDER BY accounts.uid",
            ),
        }
    }
}
