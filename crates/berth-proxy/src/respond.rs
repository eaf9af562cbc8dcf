//! Responses the proxy answers itself: JSON errors for API clients (an
//! [`ErrorBody`], as the API writes them), small HTML pages for browser
//! navigations, redirects.

use berth_core::{ErrorBody, ErrorCode, SpawnError, UserId, unix_millis_now};
use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Response, StatusCode};

use crate::pool::ForwardedBody;

/// The body of every proxy response: the upstream's, streamed, or a small
/// one of our own.
pub type ProxyBody = Either<ForwardedBody, Full<Bytes>>;

/// A response with a body of our own.
pub fn full(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<ProxyBody> {
    let mut response = Response::new(Either::Right(Full::new(body.into())));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // Answers about starting instances and credentials must never be
    // replayed from a cache.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// Did a browser navigate here (rather than a script or an API client)?
pub fn is_navigation(headers: &HeaderMap) -> bool {
    // A `HeaderName`, not a `&str`: a string key is parsed on every lookup.
    static SEC_FETCH_MODE: HeaderName = HeaderName::from_static("sec-fetch-mode");
    if let Some(mode) = headers.get(&SEC_FETCH_MODE) {
        return mode.as_bytes().eq_ignore_ascii_case(b"navigate");
    }
    headers
        .get_all(header::ACCEPT)
        .iter()
        .any(|v| v.to_str().is_ok_and(|v| v.contains("text/html")))
}

/// The error response of an [`ErrorCode`] that carries only a message.
pub fn code_error(code: ErrorCode, message: &str) -> Response<ProxyBody> {
    body_error(&ErrorBody::new(code, message))
}

/// A spawner error as the API would answer it, with `Retry-After` when the
/// client should come back later.
pub fn spawn_error(error: &SpawnError) -> Response<ProxyBody> {
    body_error(&ErrorBody::from_spawn_error(error, unix_millis_now()))
}

/// `body` with its code's status, and `Retry-After` when it says when to
/// come back.
pub fn body_error(body: &ErrorBody) -> Response<ProxyBody> {
    let status =
        StatusCode::from_u16(body.error.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = json_response(status, body);
    if let Some(ms) = body.retry_after_ms {
        set_retry_after(&mut response, ms);
    }
    response
}

fn json_response(status: StatusCode, body: &impl serde::Serialize) -> Response<ProxyBody> {
    // Serializing these plain structs cannot fail; were it to, the client
    // still gets the status and a body that parses.
    let mut text = serde_json::to_vec(body)
        .unwrap_or_else(|_| br#"{"error":"internal","message":""}"#.to_vec());
    text.push(b'\n');
    full(status, "application/json", text)
}

/// Sets `Retry-After` to `ms` in whole seconds, rounded up and at least
/// one.
pub fn set_retry_after(response: &mut Response<ProxyBody>, ms: u64) {
    let secs = ms.div_ceil(1000).max(1);
    if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
        response.headers_mut().insert(header::RETRY_AFTER, v);
    }
}

/// 401: no valid credential.
pub fn unauthorized(navigation: bool) -> Response<ProxyBody> {
    let mut response = if navigation {
        page(
            StatusCode::UNAUTHORIZED,
            "Sign-in required",
            "<h1>Unauthorized</h1>\n<p>You need a berth token to open this page. Open the link \
             you were given (it carries <code>?berth_token=…</code>) or ask your administrator \
             for one.</p>",
        )
    } else {
        code_error(
            ErrorCode::Unauthorized,
            "a valid token is required (Authorization: Bearer <token>, the berth_token cookie, or ?berth_token=)",
        )
    };
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// 401 with a reason of its own, as a page or as JSON.
pub fn unauthorized_because(navigation: bool, message: &str) -> Response<ProxyBody> {
    let mut response = if navigation {
        page(
            StatusCode::UNAUTHORIZED,
            "Sign-in required",
            &format!("<h1>Sign-in required</h1>\n<p>{}</p>", html_escape(message)),
        )
    } else {
        code_error(ErrorCode::Unauthorized, message)
    };
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// 403: a valid credential of someone else.
pub fn forbidden(navigation: bool) -> Response<ProxyBody> {
    if navigation {
        page(
            StatusCode::FORBIDDEN,
            "Forbidden",
            "<h1>Forbidden</h1>\n<p>Your token belongs to another user.</p>",
        )
    } else {
        code_error(ErrorCode::Forbidden, "this token may not reach this user")
    }
}

/// 403 with a reason of its own, as a page or as JSON.
pub fn forbidden_because(navigation: bool, message: &str) -> Response<ProxyBody> {
    if navigation {
        page(
            StatusCode::FORBIDDEN,
            "Forbidden",
            &format!("<h1>Forbidden</h1>\n<p>{}</p>", html_escape(message)),
        )
    } else {
        code_error(ErrorCode::Forbidden, message)
    }
}

/// A redirect, optionally setting a cookie.
pub fn redirect(
    status: StatusCode,
    location: HeaderValue,
    cookie: Option<HeaderValue>,
) -> Response<ProxyBody> {
    let mut response = full(status, "text/plain; charset=utf-8", Bytes::new());
    response.headers_mut().insert(header::LOCATION, location);
    if let Some(cookie) = cookie {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

/// The page a browser sees while its instance starts. It follows the
/// progress stream (when there is one) and reloads once the instance is
/// ready; without one it reloads every two seconds.
pub fn starting_page(user: &UserId, progress_url: Option<&str>) -> Response<ProxyBody> {
    let user = html_escape(user.as_str());
    let progress_meta = progress_url
        .map(|url| {
            format!(
                "<meta name=\"berth-progress\" content=\"{}\">\n",
                html_escape(url)
            )
        })
        .unwrap_or_default();
    let body = format!(
        r#"<!doctype html>
<html>
<head>
<meta charset="utf-8">
<title>Starting…</title>
{progress_meta}<noscript><meta http-equiv="refresh" content="2"></noscript>
<style>body {{ font-family: system-ui, sans-serif; max-width: 36rem; margin: 4rem auto; }}</style>
</head>
<body>
<h1>Starting the workspace of {user}…</h1>
<p id="status">starting</p>
<script>
(function () {{
  var meta = document.querySelector('meta[name="berth-progress"]');
  var status = document.getElementById('status');
  var reload = function () {{ location.reload(); }};
  if (!meta || !window.EventSource) {{ setTimeout(reload, 2000); return; }}
  var events = new EventSource(meta.content);
  events.addEventListener('status', function (e) {{
    var s;
    try {{ s = JSON.parse(e.data); }} catch (_) {{ return; }}
    status.textContent = s.status + (s.message ? ': ' + s.message : '');
    if (s.status === 'running' && s.ready) {{ events.close(); reload(); }}
    else if (s.status === 'failed' || s.status === 'stopped') {{
      events.close();
      status.textContent = 'The workspace could not start' + (s.message ? ': ' + s.message : '') + '. Reload to try again.';
    }}
  }});
  events.onerror = function () {{ events.close(); setTimeout(reload, 2000); }};
}})();
</script>
</body>
</html>
"#
    );
    let mut response = full(StatusCode::ACCEPTED, "text/html; charset=utf-8", body);
    set_retry_after(&mut response, 2000);
    response
}

fn page(status: StatusCode, title: &str, body: &str) -> Response<ProxyBody> {
    full(
        status,
        "text/html; charset=utf-8",
        html_document(title, body),
    )
}

/// The plain page berth answers a browser with: `title` and `body` are
/// HTML already (escape what came from elsewhere with [`html_escape`]).
pub fn html_document(title: &str, body: &str) -> String {
    format!(
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>{title}</title>\n\
         <style>body {{ font-family: system-ui, sans-serif; max-width: 36rem; margin: 4rem auto; padding: 0 1rem; }}</style>\n\
         </head>\n<body>\n{body}\n</body>\n</html>\n"
    )
}

/// `s` with HTML's special characters escaped, safe in text and in
/// quoted attribute values.
pub fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn text(response: Response<ProxyBody>) -> String {
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[test]
    fn navigation_is_detected() {
        let mut h = HeaderMap::new();
        assert!(!is_navigation(&h));
        h.insert(
            header::ACCEPT,
            HeaderValue::from_static("text/html,application/xhtml+xml"),
        );
        assert!(is_navigation(&h));
        h.insert("sec-fetch-mode", HeaderValue::from_static("cors"));
        assert!(
            !is_navigation(&h),
            "fetch() from a page is not a navigation"
        );
        h.insert("sec-fetch-mode", HeaderValue::from_static("navigate"));
        assert!(is_navigation(&h));
    }

    #[tokio::test]
    async fn errors_are_json_with_retry_after() {
        let e = SpawnError::CircuitOpen {
            user: UserId::parse("a").unwrap(),
            opens: 2,
            retry_at: unix_millis_now() + 10_500,
        };
        let r = spawn_error(&e);
        assert_eq!(r.status(), 503);
        let secs: u64 = r.headers()[header::RETRY_AFTER]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((10..=11).contains(&secs), "{secs}");
        let body = text(r).await;
        assert!(
            body.starts_with(r#"{"error":"instance_circuit_open","message":"#),
            "{body}"
        );
        assert!(body.contains(r#""opens":2"#), "{body}");
    }

    #[tokio::test]
    async fn errors_are_the_apis_body() {
        let e = SpawnError::LeaseBusy {
            user: UserId::parse("a").unwrap(),
            holder: "node-b".into(),
            expired: true,
        };
        let r = spawn_error(&e);
        assert_eq!(r.status(), 409);
        assert!(r.headers().get(header::RETRY_AFTER).is_none());
        let body: ErrorBody = serde_json::from_str(&text(r).await).unwrap();
        assert_eq!(body.holder.as_deref(), Some("node-b"));
        assert_eq!(body.expired, Some(true));
        assert_eq!(body.into_spawn_error(), Some(e));
        let message = "a \"quoted\" <b>\n";
        let r = code_error(ErrorCode::BadGateway, message);
        assert_eq!(r.status(), 502);
        let body: ErrorBody = serde_json::from_str(&text(r).await).unwrap();
        assert_eq!(body, ErrorBody::new(ErrorCode::BadGateway, message));
    }

    #[tokio::test]
    async fn pages_escape_the_user() {
        let user = UserId::parse("<x>&\"").unwrap();
        let body = text(starting_page(
            &user,
            Some("/api/v1/users/%3Cx%3E/instance/progress"),
        ))
        .await;
        assert!(body.contains("&lt;x&gt;&amp;&quot;"));
        assert!(!body.contains("<x>"));
        assert!(body.contains(
            r#"<meta name="berth-progress" content="/api/v1/users/%3Cx%3E/instance/progress">"#
        ));
        let body = text(unauthorized(true)).await;
        assert!(body.contains("Unauthorized"));
    }
}
