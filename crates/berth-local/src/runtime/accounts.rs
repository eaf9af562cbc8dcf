//! The isolation side of running a program, as the runtime uses it: whose
//! account a user's programs run under, and the port guard's grant of each
//! instance's own port. What the shim sets up before the program runs is in
//! [`crate::isolation`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use berth_core::egress::{EgressBook, EgressPolicy};
use berth_core::runtime::RuntimeError;
use berth_core::{Slug, UidRange};

use crate::isolation::{Account, Isolator};

/// Where the local runtime gets the host uid of a user's account (levels
/// `user` and `sandbox`). Allocated once, in the store, so that every node
/// gives one user the same uid and a user's files keep their owner; the
/// runtime knows nothing of the store, so the binary implements this over
/// it.
#[async_trait]
pub trait Accounts: Send + Sync + 'static {
    /// The uid of `slug`'s account, allocated from `range` on first use.
    async fn uid(&self, slug: &str, range: UidRange) -> Result<u32, String>;
    /// Every account allocated so far, as `(slug, uid)`.
    async fn all(&self) -> Result<Vec<(String, u32)>, String>;
    /// Every account whose user has an egress policy of their own, as
    /// `(uid, slug, policy)`.
    async fn all_egress(&self) -> Result<Vec<(u32, String, EgressPolicy)>, String>;
}

/// The runtime's isolation at levels `user` and `sandbox`.
pub(super) struct Isolated {
    pub isolator: Isolator,
    /// Each account's egress policy, which the egress proxy reads.
    pub book: Arc<EgressBook>,
    accounts: Arc<dyn Accounts>,
    uids: UidRange,
    /// Accounts already read, by slug.
    known: Mutex<HashMap<String, Account>>,
}

impl Isolated {
    pub fn new(
        isolator: Isolator,
        book: Arc<EgressBook>,
        accounts: Arc<dyn Accounts>,
        uids: UidRange,
    ) -> Self {
        Self {
            isolator,
            book,
            accounts,
            uids,
            known: Mutex::new(HashMap::new()),
        }
    }

    /// The account `slug`'s programs run under.
    pub async fn account(&self, slug: &Slug) -> Result<Account, RuntimeError> {
        let known = |m: &Mutex<HashMap<String, Account>>| {
            m.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(slug.as_str())
                .cloned()
        };
        if let Some(account) = known(&self.known) {
            return Ok(account);
        }
        let uid = self
            .accounts
            .uid(slug.as_str(), self.uids)
            .await
            .map_err(|e| RuntimeError::Failed(format!("cannot read the account of {slug}: {e}")))?;
        let account = Account::of(slug.as_str().to_owned(), uid);
        self.known
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(slug.as_str().to_owned())
            .or_insert(account.clone());
        Ok(account)
    }

    /// Reads every account at once: discovery does, so that adopting
    /// thousands of instances asks for none of their accounts one by one.
    /// On failure each is read when first needed, as without it.
    pub async fn read_all_accounts(&self) {
        let all = match self.accounts.all().await {
            Ok(all) => all,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the accounts; reading each when needed");
                return;
            }
        };
        let mut known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        for (slug, uid) in all {
            let account = Account::of(slug.clone(), uid);
            known.entry(slug).or_insert(account);
        }
    }

    /// Gives `account` its own egress `policy` (`None`: the node's), in
    /// the guard and then in the book the proxy reads.
    pub async fn set_egress(
        &self,
        account: &Account,
        policy: Option<EgressPolicy>,
    ) -> Result<(), RuntimeError> {
        self.isolator
            .guard
            .set_egress(account.uid, policy.as_ref())
            .await
            .map_err(|e| RuntimeError::Failed(e.to_string()))?;
        self.book.set(account.uid, &account.name, policy);
        Ok(())
    }

    /// Lets `account` connect to its own instance's `port` (the port guard
    /// refuses every other port of the range to instance accounts).
    pub async fn grant(&self, account: &Account, port: u16) -> Result<(), RuntimeError> {
        self.isolator
            .guard
            .grant(account.uid, port)
            .await
            .map_err(|e| RuntimeError::SpawnFailed(e.to_string()))
    }

    /// Takes back the port guard's pair on `port`, if any.
    pub async fn revoke(&self, port: u16) {
        if let Err(e) = self.isolator.guard.revoke(port).await {
            tracing::warn!(port, error = %e, "could not take back a port grant");
        }
    }
}
