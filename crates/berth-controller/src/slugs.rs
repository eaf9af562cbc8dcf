//! Users' recorded slugs: the store records one slug per user the first
//! time they are needed, and it names every file, directory and object of
//! theirs from then on, on every node. The controller resolves it and
//! hands it to the runtime in each [`InstanceSpec`]; the runtime never
//! derives a slug from an id.
//!
//! A user first recorded by this version may have a data root under the
//! slug an earlier berth derived (`UserId::legacy_slug`): if the runtime
//! keeps data under that slug here, and the store shows that the user ran
//! before (a lease row), that slug is recorded, so the user keeps their
//! files. Earlier slugs had 32 bits of hash: anyone can make an id that
//! shares another user's, so the data under one is never handed to an id
//! the store has not seen launched.
//!
//! [`InstanceSpec`]: berth_core::runtime::InstanceSpec

use std::sync::Arc;

use berth_core::{Slug, SpawnError, UserId};
use berth_store::StoreError;

use crate::Shared;
use crate::users::Slot;

impl Shared {
    /// The user's slot, created on first use with the slug the store
    /// records for the user (recording it first if need be). Only the first
    /// use of a user per process asks the store.
    pub(crate) async fn slot(&self, user: &UserId) -> Result<Arc<Slot>, SpawnError> {
        if let Some(slot) = self.users.existing(user) {
            return Ok(slot);
        }
        let slug = self.recorded_slug(user).await?;
        Ok(self.users.insert(user, slug))
    }

    /// The slug the store records for `user`, recorded now if none is.
    ///
    /// The first record chooses the slug [`Shared::first_slug`] names: an
    /// earlier slug the runtime keeps data under, else today's
    /// [`UserId::slug`]. If another user already holds that earlier slug
    /// (two ids that shared it under the old rule), the first to be
    /// recorded keeps the data and the other starts afresh under today's
    /// slug. The store decides every race, between this node's tasks or
    /// between nodes.
    pub(crate) async fn recorded_slug(&self, user: &UserId) -> Result<Slug, StoreError> {
        if let Some(slug) = self.store.user_slug(user).await? {
            return Ok(slug);
        }
        let today = user.slug();
        let first = self.first_slug(user).await?;
        if first != today {
            match self.store.record_user_slug(user, &first).await {
                Ok(slug) => {
                    if slug == first {
                        tracing::info!(%user, slug = %first, "kept the data of an earlier slug");
                    }
                    return Ok(slug);
                }
                Err(StoreError::SlugTaken { .. }) => {
                    tracing::warn!(%user, slug = %first,
                        "another user holds this earlier slug and its data; this user gets a new one");
                }
                Err(e) => return Err(e),
            }
        }
        self.store.record_user_slug(user, &today).await
    }

    /// The slug a first record of `user` made on this node asks for,
    /// without recording it: the user's legacy slug if the runtime keeps
    /// data under it here and the user has a lease row, else today's.
    ///
    /// The lease row is the evidence that the data may be this user's:
    /// every launch by an earlier berth claimed one, and this version
    /// records a user's slug before their first claim, so an id first seen
    /// after the upgrade has none when its slug is chosen. Without it, an
    /// id made to share another user's 32-bit legacy slug would be handed
    /// that user's files (and their logs, which `logs -f` follows here
    /// before a first launch).
    pub(crate) async fn first_slug(&self, user: &UserId) -> Result<Slug, StoreError> {
        let legacy = user.legacy_slug();
        if legacy == user.slug() || !self.runtime.has_data(&legacy).await {
            return Ok(user.slug());
        }
        if self.store.get_lease(user).await?.is_none() {
            tracing::warn!(%user, slug = %legacy,
                "data lies under this id's earlier slug, but the id never ran before: it may be \
                 another user's, so this one gets a new slug");
            return Ok(user.slug());
        }
        Ok(legacy)
    }

    /// The slug that names `user`'s files, if one is recorded (by this
    /// node's slot or in the store); asking records nothing.
    pub(crate) async fn known_slug(&self, user: &UserId) -> Result<Option<Slug>, StoreError> {
        match self.users.existing(user) {
            Some(slot) => Ok(Some(slot.slug.clone())),
            None => self.store.user_slug(user).await,
        }
    }

    /// At start, records the earlier slug of every user whose lease this
    /// node holds or held last (the sticky holder hint) and whose data is
    /// still here under that slug, before any node can give them a new
    /// one. Users recorded already are left alone. Best effort: the first
    /// launch of such a user makes the same choice.
    pub(crate) async fn keep_earlier_data(&self) {
        let ttl = self.fencer.config().ttl();
        let leases = match self.store.list_leases(false, ttl).await {
            Ok(leases) => leases,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list leases to find the data of earlier slugs");
                return;
            }
        };
        for lease in leases {
            let user = lease.user;
            let legacy = user.legacy_slug();
            if lease.holder.as_deref() != Some(self.node_id())
                || legacy == user.slug()
                || !self.runtime.has_data(&legacy).await
            {
                continue;
            }
            if let Err(e) = self.recorded_slug(&user).await {
                tracing::warn!(%user, error = %e, "cannot record the user's slug");
            }
        }
    }
}
