//! Who a request is from, and what that allows.

use berth_core::UserId;

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The holder of the admin token.
    Admin,
    /// The holder of user token `token_id` (its public id).
    User {
        /// The user the token belongs to.
        user: UserId,
        /// The token's public id, never its secret.
        token_id: String,
    },
}

impl Caller {
    /// May this caller act on `user`'s own resources?
    pub fn may_act_for(&self, user: &UserId) -> bool {
        match self {
            Caller::Admin => true,
            Caller::User { user: own, .. } => own == user,
        }
    }
}

/// What a token allows on a given user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The admin token: everything, where the admin token is accepted.
    Admin,
    /// A token of the user themself.
    Allowed,
    /// A valid token of another user.
    Forbidden,
    /// No valid token.
    Unauthenticated,
}

/// The credential that let a request through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Credential {
    /// A token in `Authorization: Bearer …`.
    Bearer,
    /// The user cookie.
    Cookie,
    /// `X-Forwarded-User` from a trusted SSO proxy, in header mode.
    ForwardedUser,
    /// Another node of the cluster forwarded the request for the user it
    /// names; such a request is never forwarded again.
    Cluster,
}
