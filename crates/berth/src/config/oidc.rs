//! What berth's OpenID Connect sign-in fixes and its configuration must
//! agree with: where the provider sends the browser back, and which claims
//! can name a user. Here, not in `serve::login`, so that the configuration
//! (checked on its own by `berth config check`) depends on nothing that
//! serves.

/// Where the provider sends the browser back.
pub const CALLBACK_PATH: &str = "/login/callback";

/// Standard claims that do not name a user (or are localized, or are about
/// the token itself), so cannot be `user_claim`.
const CLAIMS_NOT_NAMING_A_USER: &[&str] = &[
    "name",
    "given_name",
    "family_name",
    "middle_name",
    "nickname",
    "profile",
    "picture",
    "website",
    "gender",
    "birthdate",
    "zoneinfo",
    "locale",
    "phone_number",
    "phone_number_verified",
    "email_verified",
    "address",
    "updated_at",
    "iss",
    "aud",
    "exp",
    "iat",
    "auth_time",
    "nonce",
    "acr",
    "amr",
    "azp",
    "at_hash",
    "c_hash",
];

/// Whether `name` can be the claim that names the user.
pub fn user_claim_supported(name: &str) -> bool {
    !name.is_empty() && !CLAIMS_NOT_NAMING_A_USER.contains(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_claims_that_can_name_a_user_are_accepted() {
        for ok in ["sub", "email", "preferred_username", "upn", "employee_id"] {
            assert!(user_claim_supported(ok), "{ok}");
        }
        for bad in ["", "name", "nickname", "aud", "nonce"] {
            assert!(!user_claim_supported(bad), "{bad}");
        }
    }
}
