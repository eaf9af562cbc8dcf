//! Progress of the client's long waits (`start` waiting for ready,
//! `restart-all`), on a terminal: one status line on standard error,
//! redrawn in place as news arrives and as the seconds pass, and erased
//! when the wait ends. Standard output only ever gets the answer, so a
//! pipe or `--json` reads the same with or without it.

use std::future::Future;
use std::io::Write;
use std::time::{Duration, Instant};

use futures_util::{Stream, StreamExt};

/// How often the elapsed time is redrawn.
const REDRAW: Duration = Duration::from_millis(250);

/// Whether progress is shown: standard error is a terminal.
pub fn wanted() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
}

/// Runs `work` to its end; meanwhile, when `show`, draws `label`, the
/// latest text from `news` and the time so far. `news` is polled only
/// while `work` runs, and dropped with it.
pub async fn while_waiting<T>(
    show: bool,
    label: &str,
    work: impl Future<Output = T>,
    news: impl Stream<Item = String>,
) -> T {
    if !show {
        return work.await;
    }
    let started = Instant::now();
    let mut latest = String::new();
    let mut tick = tokio::time::interval(REDRAW);
    futures_util::pin_mut!(work);
    futures_util::pin_mut!(news);
    let mut news_done = false;
    let result = loop {
        tokio::select! {
            result = &mut work => break result,
            item = news.next(), if !news_done => match item {
                Some(text) => latest = text,
                None => news_done = true,
            },
            _ = tick.tick() => {}
        }
        draw(&line(label, &latest, started.elapsed()));
    };
    // Erase the line: what follows is the answer.
    draw("");
    result
}

/// The status line: `label… 3s · latest`.
pub fn line(label: &str, latest: &str, elapsed: Duration) -> String {
    let secs = elapsed.as_secs();
    // The news comes from the server: the line's own escapes only.
    let latest = crate::escape::text(latest);
    if latest.is_empty() {
        format!("{label}… {secs}s")
    } else {
        format!("{label}… {secs}s · {latest}")
    }
}

fn draw(text: &str) {
    let mut err = std::io::stderr().lock();
    // Carriage return and "erase line": the line is redrawn in place.
    let _ = write!(err, "\r\x1b[2K{text}");
    let _ = err.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_shows_label_time_and_news() {
        assert_eq!(
            line("starting alice", "", Duration::from_millis(2500)),
            "starting alice… 2s"
        );
        assert_eq!(
            line(
                "starting alice",
                "waiting for ready",
                Duration::from_secs(3)
            ),
            "starting alice… 3s · waiting for ready"
        );
    }

    #[tokio::test]
    async fn without_a_terminal_only_the_work_runs() {
        let news = futures_util::stream::pending::<String>();
        assert_eq!(while_waiting(false, "x", async { 7 }, news).await, 7);
    }
}
