//! The admin page at `/admin/`: static HTML, CSS and script compiled
//! into the binary, so nothing is built or installed beside it.
//!
//! The page holds no data. Everything it shows comes from API calls it
//! makes once signed in (the admin session in host mode, the admin token
//! as Bearer in path mode: see `assets/admin/admin.js`), so serving it to
//! anyone leaks nothing. Its headers keep it to its own scripts and
//! styles, its own origin's API, and out of frames.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use berth_proxy::respond::{html_document, html_escape};

use super::api::ApiState;
use super::auth::Caller;
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const INDEX_HTML: &str = include_str!("../../assets/admin/index.html");
const ADMIN_JS: &str = include_str!("../../assets/admin/admin.js");
const ADMIN_CSS: &str = include_str!("../../assets/admin/admin.css");

/// Only this origin's scripts, styles and API; no frames, plugins or
/// foreign form targets. Links to users' apps are navigations, which the
/// policy does not restrict.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; \
     form-action 'self'; frame-ancestors 'none'";

/// The page's routes; the API router merges them.
pub fn routes() -> Router<Arc<ApiState>> {
    Router::new()
        // Relative, so a prefix a reverse proxy adds is kept.
        .route(
            "/admin",
            get(|| async {
                (
                    StatusCode::PERMANENT_REDIRECT,
                    [(header::LOCATION, "admin/")],
                )
            }),
        )
        .route("/admin/", get(index))
        .route(
            "/admin/admin.js",
            get(|| async { asset("text/javascript; charset=utf-8", ADMIN_JS) }),
        )
        .route(
            "/admin/admin.css",
            get(|| async { asset("text/css; charset=utf-8", ADMIN_CSS) }),
        )
}

/// The page, unless the browser is signed in as a user outside the admin
/// group: they get a plain refusal rather than a page whose every call
/// would fail.
async fn index(State(state): State<Arc<ApiState>>, headers: HeaderMap) -> Response {
    if let Ok(session) = state.auth.session(&Method::GET, &headers).await
        && let (Some(user), Caller::User { .. }) = (&session.owner.user, session.caller())
    {
        let body = html_document(
            "Not an admin",
            &format!(
                "<h1>Not an admin</h1>\n<p>You are signed in as <b>{}</b>, who is not in the admin \
                 group. <a href=\"/\">Your home page</a>.</p>",
                html_escape(user.as_str())
            ),
        );
        let mut response = (StatusCode::FORBIDDEN, body).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        return response;
    }
    asset("text/html; charset=utf-8", INDEX_HTML)
}

pub(super) fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // Revalidated on every load, so an upgraded berth serves its own page.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_its_own_assets() {
        assert!(INDEX_HTML.contains(r#"src="admin.js""#));
        assert!(INDEX_HTML.contains(r#"href="admin.css""#));
        // No inline script or style: the policy would refuse them.
        assert!(!INDEX_HTML.contains("<script>"));
        assert!(!INDEX_HTML.contains("<style"));
        assert!(!INDEX_HTML.contains(" style="));
        assert!(!INDEX_HTML.contains(" onclick="));
    }

    #[test]
    fn the_script_never_stores_a_credential() {
        // The admin token lives in the page's memory only (admin.js says
        // why); nothing is written where another page of the origin reads.
        for storage in [
            "localStorage.",
            "sessionStorage.",
            "document.cookie",
            "indexedDB.",
        ] {
            assert!(!ADMIN_JS.contains(storage), "{storage}");
        }
        // Data reaches the page as text, never as markup.
        assert!(!ADMIN_JS.contains("innerHTML"));
        assert!(!ADMIN_JS.contains("insertAdjacentHTML"));
        assert!(!ADMIN_JS.contains("document.write"));
    }
}
