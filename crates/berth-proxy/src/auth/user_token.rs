//! What the store knows of a user token: the answer of
//! [`TokenStore::lookup`](super::TokenStore::lookup), from which the
//! user-token cache fills its entries. A leaf shared by `tokens.rs` and
//! `cache.rs`.

use std::time::Duration;

use berth_core::UserId;

/// A live user token, as the store knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserTokenInfo {
    /// The user the token belongs to.
    pub user: UserId,
    /// The token's public id.
    pub id: String,
    /// How long it has left, by the store's clock.
    pub expires_in: Duration,
}
