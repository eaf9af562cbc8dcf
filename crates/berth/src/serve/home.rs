//! A signed-in user's home page at `/` on the berth host: static HTML, CSS
//! and script compiled into the binary, like the admin page. The page
//! holds no data; it reads everything through the API with the session
//! berth set at sign-in. Without a session, `/` sends the browser to sign
//! in; without sign-in configured, there is no home page.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::admin::asset;
use super::api::ApiState;
use super::login::LOGIN_PATH;

const INDEX_HTML: &str = include_str!("../../assets/home/index.html");
const HOME_JS: &str = include_str!("../../assets/home/home.js");
const HOME_CSS: &str = include_str!("../../assets/home/home.css");

/// The page's routes; the API router merges them.
pub fn routes() -> Router<Arc<ApiState>> {
    Router::new()
        .route("/", get(index))
        .route(
            "/home/home.js",
            get(|| async { asset("text/javascript; charset=utf-8", HOME_JS) }),
        )
        .route(
            "/home/home.css",
            get(|| async { asset("text/css; charset=utf-8", HOME_CSS) }),
        )
}

async fn index(State(state): State<Arc<ApiState>>, headers: HeaderMap) -> Response {
    if state.login.is_none() {
        return StatusCode::NOT_FOUND.into_response();
    }
    match state.auth.session(&Method::GET, &headers).await {
        Ok(session) if session.owner.user.is_some() => {
            asset("text/html; charset=utf-8", INDEX_HTML)
        }
        _ => (
            StatusCode::SEE_OTHER,
            [
                (header::LOCATION, format!("{LOGIN_PATH}?next=/")),
                (header::CACHE_CONTROL, "no-store".to_owned()),
            ],
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_its_own_assets_and_stores_nothing() {
        assert!(INDEX_HTML.contains(r#"src="/home/home.js""#));
        for inline in ["<script>", "<style", " style=", " onclick="] {
            assert!(!INDEX_HTML.contains(inline), "{inline}");
        }
        for forbidden in [
            "localStorage.",
            "sessionStorage.",
            "document.cookie",
            "innerHTML",
            "insertAdjacentHTML",
            "document.write",
        ] {
            assert!(!HOME_JS.contains(forbidden), "{forbidden}");
        }
    }
}
