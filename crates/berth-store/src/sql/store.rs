//! The logic of every store operation, written once for both backends.

use std::time::Duration;

use async_trait::async_trait;
use berth_core::egress::EgressPolicy;
use berth_core::policy::CrashState;
use berth_core::{Epoch, Instance, InstanceStatus, Role, Slug, UnixMillis, UserId};

use super::driver::Tx;
use super::rows::{
    get, instance_from_row, lease_from_row, narrow, node_from_row, node_status_str, parse_egress,
    parse_slug, parse_user, refused_mint, slug_taken, token_from_row, token_owner_from_row, ttl_ms,
};
use super::{Dialect, SqlBackend};
use crate::{
    ACCOUNT_ATTEMPTS, AuthStore, ChooseNode, ClaimOutcome, InstanceFilter, InstanceStore,
    LaunchParams, LaunchStore, LeaseRecord, LeaseStore, LoginAttempt, MintOutcome, NewToken,
    NodeClaim, NodeRecord, NodeStore, Placement, SessionOwner, SessionRecord, StoreError,
    TakeoverPolicy, TokenOwner, TokenRecord, UidRange, UserStore, account_bounds, check_patch_size,
};

#[async_trait]
impl<B: SqlBackend> InstanceStore for B {
    async fn put_instance(&self, i: &Instance) -> Result<(), StoreError> {
        // The upsert decides; the read only names the record that refused
        // it. If that record vanished in between (deleted), nothing stands
        // in the way any more and the write is tried once more.
        for _ in 0..2 {
            if upsert_instance(self, i).await? {
                return Ok(());
            }
            if let Some(current) = self.get_instance(&i.user, i.role).await? {
                return Err(StoreError::fenced(&i.user, i.epoch, &current));
            }
        }
        Err(StoreError::Query(format!(
            "the {} record of {} refused the write twice yet is not there",
            i.role, i.user
        )))
    }

    async fn get_instance(
        &self,
        user: &UserId,
        role: Role,
    ) -> Result<Option<Instance>, StoreError> {
        let row = self
            .stmt(&self.sql().instance_get)
            .bind(user.as_str())
            .bind(role.as_str())
            .fetch_optional()
            .await?;
        row.as_ref().map(instance_from_row).transpose()
    }

    async fn list_instances(&self, filter: &InstanceFilter) -> Result<Vec<Instance>, StoreError> {
        let rows = self
            .stmt(&self.sql().instance_list)
            .bind(filter.status.map(InstanceStatus::as_str))
            .bind(filter.node.as_deref())
            .bind(filter.role.map(Role::as_str))
            .fetch_all()
            .await?;
        rows.iter().map(instance_from_row).collect()
    }

    async fn delete_instance(&self, user: &UserId, role: Role) -> Result<(), StoreError> {
        self.stmt(&self.sql().instance_delete)
            .bind(user.as_str())
            .bind(role.as_str())
            .execute()
            .await?;
        Ok(())
    }

    async fn delete_instance_fenced(
        &self,
        user: &UserId,
        node: &str,
        epoch: Epoch,
    ) -> Result<(), StoreError> {
        let deleted = self
            .stmt(&self.sql().instance_delete_fenced)
            .bind(user.as_str())
            .bind(node)
            .bind(epoch)
            .execute()
            .await?;
        if deleted > 0 {
            return Ok(());
        }
        // Nothing deleted: either there is no record (fine) or it belongs
        // to a newer lease, which the read names.
        match self.get_instance(user, Role::Main).await? {
            Some(current) => Err(StoreError::fenced(user, epoch, &current)),
            None => Ok(()),
        }
    }

    async fn record_activity(&self, activity: &[(UserId, UnixMillis)]) -> Result<(), StoreError> {
        if activity.is_empty() {
            return Ok(());
        }
        let pairs = activity.iter().map(|(u, t)| (u.as_str(), *t)).collect();
        self.stmt(<B::Db as Dialect>::ACTIVITY)
            .one_off()
            .bind_pairs(pairs)?
            .execute()
            .await?;
        Ok(())
    }
}

#[async_trait]
impl<B: SqlBackend> LeaseStore for B {
    async fn claim_lease(
        &self,
        user: &UserId,
        node: &str,
        ttl: Duration,
        takeover: TakeoverPolicy,
    ) -> Result<ClaimOutcome, StoreError> {
        let evidence = takeover == TakeoverPolicy::Evidence;
        conditional_claim(self, &self.sql().claim, user, node, ttl, Some(evidence)).await
    }

    async fn take_over_lease(
        &self,
        user: &UserId,
        node: &str,
        ttl: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        conditional_claim(self, &self.sql().take_over, user, node, ttl, None).await
    }

    async fn renew_leases(
        &self,
        node: &str,
        held: &[(UserId, Epoch)],
        ttl: Duration,
    ) -> Result<Vec<UserId>, StoreError> {
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let pairs = held.iter().map(|(u, e)| (u.as_str(), *e)).collect();
        let rows = self
            .stmt(<B::Db as Dialect>::RENEW)
            .one_off()
            .bind(node)
            .bind(ttl_ms(ttl))
            .bind_pairs(pairs)?
            .fetch_all()
            .await?;
        rows.iter()
            .map(|row| parse_user(get(row, "user_id")?))
            .collect()
    }

    async fn release_lease(
        &self,
        user: &UserId,
        node: &str,
        epoch: Epoch,
    ) -> Result<bool, StoreError> {
        let row = self
            .stmt(&self.sql().release)
            .bind(user.as_str())
            .bind(node)
            .bind(epoch)
            .fetch_optional()
            .await?;
        Ok(row.is_some())
    }

    async fn get_lease(&self, user: &UserId) -> Result<Option<LeaseRecord>, StoreError> {
        let row = self
            .stmt(&self.sql().lease_get)
            .bind(user.as_str())
            .fetch_optional()
            .await?;
        row.as_ref().map(lease_from_row).transpose()
    }

    async fn list_leases(
        &self,
        expired_only: bool,
        ttl: Duration,
    ) -> Result<Vec<LeaseRecord>, StoreError> {
        let rows = self
            .stmt(&self.sql().lease_list)
            .bind(expired_only)
            .bind(ttl_ms(ttl))
            .fetch_all()
            .await?;
        rows.iter().map(lease_from_row).collect()
    }

    async fn leases_held_by(&self, node: &str) -> Result<Vec<LeaseRecord>, StoreError> {
        let rows = self
            .stmt(&self.sql().lease_held)
            .bind(node)
            .fetch_all()
            .await?;
        rows.iter().map(lease_from_row).collect()
    }
}

#[async_trait]
impl<B: SqlBackend> LaunchStore for B {
    async fn put_launch_params(
        &self,
        user: &UserId,
        folder: &str,
        patch: Option<&str>,
    ) -> Result<(), StoreError> {
        check_patch_size(user, patch)?;
        self.stmt(&self.sql().launch_params_put)
            .bind(user.as_str())
            .bind(folder)
            .bind(patch)
            .execute()
            .await?;
        Ok(())
    }

    async fn get_launch_params(&self, user: &UserId) -> Result<Option<LaunchParams>, StoreError> {
        let row = self
            .stmt(&self.sql().launch_params_get)
            .bind(user.as_str())
            .fetch_optional()
            .await?;
        row.map(|row| {
            Ok(LaunchParams {
                folder: get(&row, "folder")?,
                patch: get(&row, "patch")?,
            })
        })
        .transpose()
    }

    async fn load_crash_state(&self, user: &UserId) -> Result<CrashState, StoreError> {
        let row = self
            .stmt(&self.sql().crash_state_get)
            .bind(user.as_str())
            .fetch_optional()
            .await?;
        match row {
            None => Ok(CrashState::default()),
            Some(row) => {
                let json: String = get(&row, "state")?;
                serde_json::from_str(&json)
                    .map_err(|e| StoreError::Corrupt(format!("crash state of {user}: {e}")))
            }
        }
    }

    async fn save_crash_state(&self, user: &UserId, state: &CrashState) -> Result<(), StoreError> {
        if state.is_clear() {
            self.stmt(&self.sql().crash_state_delete)
                .bind(user.as_str())
                .execute()
                .await?;
            return Ok(());
        }
        let json = serde_json::to_string(state).map_err(|e| StoreError::Query(e.to_string()))?;
        self.stmt(&self.sql().crash_state_put)
            .bind(user.as_str())
            .bind(&json)
            .execute()
            .await?;
        Ok(())
    }
}

#[async_trait]
impl<B: SqlBackend> AuthStore for B {
    async fn mint_token(&self, new: &NewToken<'_>) -> Result<MintOutcome, StoreError> {
        let sql = self.sql();
        let mut tx = Tx::begin(self).await?;
        if let Some(lock) = <B::Db as Dialect>::LOCK_USER_TOKENS {
            tx.stmt(lock).bind(new.user.as_str()).execute().await?;
        }
        tx.stmt(&sql.tokens_drop_expired)
            .bind(new.user.as_str())
            .execute()
            .await?;
        let row = tx
            .stmt(&sql.token_mint)
            .bind(new.token_hash)
            .bind(new.id)
            .bind(new.user.as_str())
            .bind(ttl_ms(new.ttl))
            .bind(new.parent)
            .bind(i64::from(new.max_live))
            .fetch_optional()
            .await?;
        let outcome = match row {
            Some(row) => MintOutcome::Minted(token_from_row(&row)?),
            None => {
                let row = tx
                    .stmt(&sql.tokens_live)
                    .bind(new.user.as_str())
                    .fetch_one()
                    .await?;
                refused_mint(get(&row, "live")?, new.max_live)?
            }
        };
        tx.commit().await?;
        Ok(outcome)
    }

    async fn use_token(&self, token_hash: &str) -> Result<Option<TokenOwner>, StoreError> {
        let row = self
            .stmt(&self.sql().token_use)
            .bind(token_hash)
            .fetch_optional()
            .await?;
        row.map(|row| token_owner_from_row(&row)).transpose()
    }

    async fn list_tokens(&self, user: &UserId) -> Result<Vec<TokenRecord>, StoreError> {
        let rows = self
            .stmt(&self.sql().tokens_list)
            .bind(user.as_str())
            .fetch_all()
            .await?;
        rows.iter().map(token_from_row).collect()
    }

    async fn revoke_token(&self, user: &UserId, id: &str) -> Result<Vec<String>, StoreError> {
        let rows = self
            .stmt(&self.sql().token_revoke)
            .bind(id)
            .bind(user.as_str())
            .fetch_all()
            .await?;
        rows.iter().map(|row| get(row, "id")).collect()
    }

    async fn create_session(
        &self,
        secret_hash: &str,
        owner: &SessionOwner,
        ttl: Duration,
    ) -> Result<UnixMillis, StoreError> {
        let sql = self.sql();
        let mut tx = Tx::begin(self).await?;
        tx.stmt(&sql.sessions_drop_expired).execute().await?;
        let row = tx
            .stmt(&sql.session_create)
            .bind(secret_hash)
            .bind(ttl_ms(ttl))
            .bind(owner.user.as_ref().map(UserId::as_str))
            .bind(i64::from(owner.admin))
            .bind(owner.token_id.as_deref())
            .fetch_one()
            .await?;
        let expires_at = get(&row, "expires_at")?;
        tx.commit().await?;
        Ok(expires_at)
    }

    async fn session(&self, secret_hash: &str) -> Result<Option<SessionRecord>, StoreError> {
        let Some(row) = self
            .stmt(&self.sql().session_expiry)
            .bind(secret_hash)
            .fetch_optional()
            .await?
        else {
            return Ok(None);
        };
        let user: Option<String> = get(&row, "user_id")?;
        let admin: i64 = get(&row, "admin")?;
        Ok(Some(SessionRecord {
            owner: SessionOwner {
                user: user.map(parse_user).transpose()?,
                admin: admin != 0,
                token_id: get(&row, "token_id")?,
            },
            expires_at: get(&row, "expires_at")?,
        }))
    }

    async fn create_login_attempt(
        &self,
        state_hash: &str,
        attempt: &LoginAttempt,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let sql = self.sql();
        let mut tx = Tx::begin(self).await?;
        tx.stmt(&sql.login_attempts_drop_expired).execute().await?;
        tx.stmt(&sql.login_attempt_create)
            .bind(state_hash)
            .bind(attempt.pkce_verifier.as_str())
            .bind(attempt.nonce.as_str())
            .bind(attempt.return_to.as_str())
            .bind(ttl_ms(ttl))
            .execute()
            .await?;
        tx.commit().await
    }

    async fn take_login_attempt(
        &self,
        state_hash: &str,
    ) -> Result<Option<LoginAttempt>, StoreError> {
        let row = self
            .stmt(&self.sql().login_attempt_take)
            .bind(state_hash)
            .fetch_optional()
            .await?;
        row.map(|row| {
            Ok(LoginAttempt {
                pkce_verifier: get(&row, "pkce_verifier")?,
                nonce: get(&row, "nonce")?,
                return_to: get(&row, "return_to")?,
            })
        })
        .transpose()
    }

    async fn create_login_hop(
        &self,
        code_hash: &str,
        user: &UserId,
        token_id: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let sql = self.sql();
        let mut tx = Tx::begin(self).await?;
        tx.stmt(&sql.login_hops_drop_expired).execute().await?;
        tx.stmt(&sql.login_hop_create)
            .bind(code_hash)
            .bind(user.as_str())
            .bind(token_id)
            .bind(ttl_ms(ttl))
            .execute()
            .await?;
        tx.commit().await
    }

    async fn take_login_hop(
        &self,
        code_hash: &str,
    ) -> Result<Option<(UserId, String)>, StoreError> {
        let row = self
            .stmt(&self.sql().login_hop_take)
            .bind(code_hash)
            .fetch_optional()
            .await?;
        row.map(|row| Ok((parse_user(get(&row, "user_id")?)?, get(&row, "token_id")?)))
            .transpose()
    }

    async fn delete_session(&self, secret_hash: &str) -> Result<bool, StoreError> {
        let deleted = self
            .stmt(&self.sql().session_delete)
            .bind(secret_hash)
            .execute()
            .await?;
        Ok(deleted > 0)
    }
}

#[async_trait]
impl<B: SqlBackend> UserStore for B {
    async fn user_slug(&self, user: &UserId) -> Result<Option<Slug>, StoreError> {
        let row = self
            .stmt(&self.sql().user_slug_get)
            .bind(user.as_str())
            .fetch_optional()
            .await?;
        row.map(|row| parse_slug(get(&row, "slug")?)).transpose()
    }

    async fn user_slugs_on(&self, node: &str) -> Result<Vec<(UserId, Slug)>, StoreError> {
        let rows = self
            .stmt(&self.sql().user_slugs_on_node)
            .bind(node)
            .fetch_all()
            .await?;
        rows.iter()
            .map(|row| {
                Ok((
                    parse_user(get(row, "user_id")?)?,
                    parse_slug(get(row, "slug")?)?,
                ))
            })
            .collect()
    }

    async fn record_user_slug(&self, user: &UserId, slug: &Slug) -> Result<Slug, StoreError> {
        if let Some(recorded) = self.user_slug(user).await? {
            return Ok(recorded);
        }
        let inserted = match self
            .stmt(&self.sql().user_slug_insert)
            .bind(user.as_str())
            .bind(slug.as_str())
            .execute_or_sqlx_error()
            .await
        {
            Ok(inserted) => inserted,
            Err(e) => match slug_taken(&e, user, slug) {
                // PostgreSQL checks the slug's unique index before the
                // user's when two nodes insert the same row at once, so
                // the user's own concurrent record can surface as a slug
                // conflict: theirs stands if it is there.
                Some(taken) => return self.user_slug(user).await?.ok_or(taken),
                None => return Err(self.err(e)),
            },
        };
        if inserted > 0 {
            return Ok(slug.clone());
        }
        // Nothing inserted: another node recorded this user's slug in
        // between, and theirs stands.
        self.user_slug(user).await?.ok_or_else(|| {
            StoreError::Query(format!(
                "the slug of {user} was recorded concurrently but cannot be read back"
            ))
        })
    }

    async fn account_uid(&self, slug: &str, range: UidRange) -> Result<u32, StoreError> {
        let sql = self.sql();
        let (first, last) = account_bounds(range)?;
        for _ in 0..ACCOUNT_ATTEMPTS {
            let existing = self
                .stmt(&sql.account_get)
                .bind(slug)
                .fetch_optional()
                .await?;
            if let Some(row) = existing {
                return narrow(get(&row, "uid")?, "accounts.uid");
            }
            // Inserts nothing when another node took the slug or the uid
            // meanwhile; the loop then looks again.
            let inserted = self
                .stmt(&sql.account_take_next)
                .bind(slug)
                .bind(first)
                .bind(last)
                .fetch_optional()
                .await?;
            if let Some(row) = inserted {
                return narrow(get(&row, "uid")?, "accounts.uid");
            }
            let highest = self
                .stmt(&sql.account_highest)
                .bind(first)
                .bind(last)
                .fetch_one()
                .await?;
            if get::<_, Option<i64>>(&highest, "uid")? == Some(last) {
                return Err(StoreError::UidsExhausted {
                    first: range.first,
                    last: narrow(last, "accounts.uid")?,
                });
            }
        }
        Err(StoreError::Query(format!(
            "could not allocate a uid for account {slug:?} in {ACCOUNT_ATTEMPTS} attempts: \
             other nodes took every uid tried"
        )))
    }

    async fn list_accounts(&self) -> Result<Vec<(String, u32)>, StoreError> {
        let rows = self.stmt(&self.sql().accounts_list).fetch_all().await?;
        rows.iter()
            .map(|row| Ok((get(row, "slug")?, narrow(get(row, "uid")?, "accounts.uid")?)))
            .collect()
    }

    async fn user_egress(&self, user: &UserId) -> Result<Option<EgressPolicy>, StoreError> {
        let row = self
            .stmt(&self.sql().user_egress_get)
            .bind(user.as_str())
            .fetch_optional()
            .await?;
        row.map(|row| parse_egress(&get::<_, String>(&row, "policy")?))
            .transpose()
    }

    async fn set_user_egress(
        &self,
        user: &UserId,
        policy: Option<&EgressPolicy>,
    ) -> Result<(), StoreError> {
        match policy {
            Some(policy) => {
                let json = serde_json::to_string(policy).map_err(|e| {
                    StoreError::Query(format!("cannot write an egress policy: {e}"))
                })?;
                self.stmt(&self.sql().user_egress_put)
                    .bind(user.as_str())
                    .bind(json.as_str())
                    .execute()
                    .await?;
            }
            None => {
                self.stmt(&self.sql().user_egress_delete)
                    .bind(user.as_str())
                    .execute()
                    .await?;
            }
        }
        Ok(())
    }

    async fn account_egress(&self) -> Result<Vec<(u32, String, EgressPolicy)>, StoreError> {
        let rows = self
            .stmt(&self.sql().account_egress_list)
            .fetch_all()
            .await?;
        rows.iter()
            .map(|row| {
                Ok((
                    narrow(get(row, "uid")?, "accounts.uid")?,
                    get(row, "slug")?,
                    parse_egress(&get::<_, String>(row, "policy")?)?,
                ))
            })
            .collect()
    }
}

#[async_trait]
impl<B: SqlBackend> NodeStore for B {
    async fn now(&self) -> Result<UnixMillis, StoreError> {
        let row = self.stmt(&self.sql().now).fetch_one().await?;
        get(&row, "now")
    }

    async fn heartbeat(&self, node: &NodeRecord) -> Result<(), StoreError> {
        self.stmt(&self.sql().heartbeat)
            .bind(&node.id)
            .bind(&node.advertise_url)
            .bind(i64::from(node.capacity))
            .bind(i64::from(node.load))
            .bind(node_status_str(node.status))
            .bind(&node.internal_url)
            .execute()
            .await?;
        Ok(())
    }

    async fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let rows = self.stmt(&self.sql().nodes_list).fetch_all().await?;
        rows.iter().map(node_from_row).collect()
    }

    async fn claim_node(
        &self,
        node: &str,
        data_dir_id: &str,
        ttl: Duration,
    ) -> Result<NodeClaim, StoreError> {
        let claimed = self
            .stmt(&self.sql().node_claim)
            .bind(node)
            .bind(data_dir_id)
            .bind(ttl_ms(ttl))
            .fetch_optional()
            .await?;
        if claimed.is_some() {
            return Ok(NodeClaim::Claimed);
        }
        match self
            .stmt(&self.sql().node_get)
            .bind(node)
            .fetch_optional()
            .await?
        {
            Some(row) => Ok(NodeClaim::Live(node_from_row(&row)?)),
            // Deleted in between: nothing to be refused by.
            None => Err(StoreError::Query(format!(
                "the row of node {node} vanished during its claim; try again"
            ))),
        }
    }

    async fn reserve_place(
        &self,
        user: &UserId,
        hold: Duration,
        choose: &ChooseNode<'_>,
    ) -> Result<Placement, StoreError> {
        let sql = self.sql();
        let mut tx = Tx::begin(self).await?;
        if let Some(lock) = <B::Db as Dialect>::LOCK_PLACEMENTS {
            tx.stmt(lock).execute().await?;
        }
        tx.stmt(&sql.placements_drop_expired).execute().await?;
        let rows = tx.stmt(&sql.placement_nodes).fetch_all().await?;
        let mut nodes = Vec::with_capacity(rows.len());
        for row in &rows {
            let now: UnixMillis = get(row, "now")?;
            nodes.push(node_from_row(row)?.view(now));
        }
        let node = choose(&nodes);
        if let Some(node) = &node {
            tx.stmt(&sql.placement_put)
                .bind(user.as_str())
                .bind(node)
                .bind(ttl_ms(hold))
                .execute()
                .await?;
        }
        tx.commit().await?;
        Ok(Placement { node, nodes })
    }
}

/// Runs the (fenced) upsert of an instance record; whether it wrote a row.
async fn upsert_instance<B: SqlBackend>(store: &B, i: &Instance) -> Result<bool, StoreError> {
    store
        .stmt(&store.sql().instance_upsert)
        .bind(i.user.as_str())
        .bind(i.role.as_str())
        .bind(&i.id)
        .bind(i.status.as_str())
        .bind(&i.node)
        .bind(i.epoch)
        .bind(i.port.map(i64::from))
        .bind(i.pid.map(i64::from))
        .bind(&i.folder)
        .bind(i.started_at)
        .bind(i.ready)
        .bind(i64::from(i.restarts))
        .bind(i.last_error.as_deref())
        .bind(i.exit_code.map(i64::from))
        .bind(i.last_active)
        .bind(i.runtime_ref.as_ref().map(|r| r.as_str()))
        .bind(i.hibernated_at)
        .execute_or_sqlx_error()
        .await
        .map(|written| written > 0)
        .map_err(|e| match &e {
            sqlx::Error::Database(db) if db.kind() == sqlx::error::ErrorKind::UniqueViolation => {
                StoreError::Query(format!(
                    "port {} on node {:?} is already recorded for another live instance \
                     (putting {} {}): {e}",
                    i.port.map_or_else(|| "-".to_owned(), |p| p.to_string()),
                    i.node,
                    i.user,
                    i.role
                ))
            }
            _ => store.err(e),
        })
}

/// One conditional claim statement (`sql` binds user, node and TTL, and
/// for an ordinary claim whether evidence allows a takeover), judged by
/// whether a row came back; when none did, says who holds the lease.
async fn conditional_claim<B: SqlBackend>(
    store: &B,
    sql: &str,
    user: &UserId,
    node: &str,
    ttl: Duration,
    evidence: Option<bool>,
) -> Result<ClaimOutcome, StoreError> {
    store
        .stmt(&store.sql().lease_row)
        .bind(user.as_str())
        .execute()
        .await?;
    let mut claim = store
        .stmt(sql)
        .bind(user.as_str())
        .bind(node)
        .bind(ttl_ms(ttl));
    if let Some(evidence) = evidence {
        claim = claim.bind(evidence);
    }
    if let Some(row) = claim.fetch_optional().await? {
        return Ok(ClaimOutcome::Claimed {
            epoch: get(&row, "epoch")?,
        });
    }
    match store.get_lease(user).await? {
        Some(LeaseRecord {
            holder: Some(holder),
            expired,
            ..
        }) => Ok(ClaimOutcome::Busy { holder, expired }),
        // Rows are never deleted and holders never cleared, so a claim that
        // failed always leaves a holder to name.
        _ => Err(StoreError::Query(format!(
            "lease of {user} refused the claim but names no holder"
        ))),
    }
}
