//! Reading a Server-Sent Events stream: the API's progress and followed
//! logs, as the CLI (`berth logs -f`) and other nodes (a stream relayed
//! from the owner node) receive them.
//!
//! Only what berth's own streams use is read: `event:` and `data:` fields
//! (several `data:` lines joined with `\n`), comments (keep-alives), and
//! `\n` or `\r\n` line ends. An event is dispatched at its blank line; a
//! stream that ends mid-event drops that event, as the standard says.

use axum::body::Bytes;
use futures_util::{Stream, StreamExt};

/// The event of one stage in a progress stream (`…/instance/progress`);
/// its data is the instance's status as JSON.
pub const STAGE_EVENT: &str = "status";
/// The event of one line of a followed log (`…/instance/logs?follow=true`);
/// its data is the line as a JSON string, so any byte of it survives.
pub const LOG_LINE_EVENT: &str = "line";

/// Lines longer than this end the stream with an error: berth never sends
/// them, and a peer that does must not make the reader buffer without
/// bound.
const MAX_LINE: usize = 1024 * 1024;

/// One event: its type (`message` when unnamed) and data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

/// Why an event stream ended early.
#[derive(Debug, thiserror::Error)]
pub enum SseError<E> {
    #[error("the event stream broke: {0}")]
    Transport(E),
    #[error("the event stream sent a line longer than {MAX_LINE} bytes")]
    LineTooLong,
}

/// The events of a byte stream.
pub fn events<S, E>(bytes: S) -> impl Stream<Item = Result<SseEvent, SseError<E>>>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
{
    struct State<S> {
        bytes: S,
        parser: Parser,
        done: bool,
    }
    futures_util::stream::unfold(
        State {
            bytes,
            parser: Parser::default(),
            done: false,
        },
        |mut state| async move {
            loop {
                if state.done {
                    return None;
                }
                match state.parser.next_event() {
                    Ok(Some(event)) => return Some((Ok(event), state)),
                    Ok(None) => {}
                    Err(()) => {
                        state.done = true;
                        return Some((Err(SseError::LineTooLong), state));
                    }
                }
                match state.bytes.next().await {
                    Some(Ok(chunk)) => state.parser.feed(&chunk),
                    Some(Err(e)) => {
                        state.done = true;
                        return Some((Err(SseError::Transport(e)), state));
                    }
                    None => return None,
                }
            }
        },
    )
}

/// The incremental parser: bytes in, events out.
#[derive(Debug, Default)]
struct Parser {
    buffer: Vec<u8>,
    event: Option<String>,
    data: Option<String>,
}

impl Parser {
    fn feed(&mut self, chunk: &[u8]) {
        self.buffer.extend_from_slice(chunk);
    }

    /// The next complete event in the buffer; `Err` for an overlong line.
    fn next_event(&mut self) -> Result<Option<SseEvent>, ()> {
        loop {
            let Some(end) = self.buffer.iter().position(|&b| b == b'\n') else {
                return if self.buffer.len() > MAX_LINE {
                    Err(())
                } else {
                    Ok(None)
                };
            };
            let line: Vec<u8> = self.buffer.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line[..end]);
            let line = line.strip_suffix('\r').unwrap_or(&line);
            if line.is_empty() {
                if let Some(data) = self.data.take() {
                    let event = self.event.take().unwrap_or_else(|| "message".to_owned());
                    return Ok(Some(SseEvent { event, data }));
                }
                self.event = None;
                continue;
            }
            if line.starts_with(':') {
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "event" => self.event = Some(value.to_owned()),
                "data" => match &mut self.data {
                    Some(data) => {
                        data.push('\n');
                        data.push_str(value);
                    }
                    None => self.data = Some(value.to_owned()),
                },
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn parse(chunks: &[&str]) -> Vec<SseEvent> {
        let stream = futures_util::stream::iter(
            chunks
                .iter()
                .map(|c| Ok::<_, std::convert::Infallible>(Bytes::from(c.to_string())))
                .collect::<Vec<_>>(),
        );
        let events = events(stream);
        futures_util::pin_mut!(events);
        let mut out = Vec::new();
        while let Some(event) = events.next().await {
            out.push(event.unwrap());
        }
        out
    }

    fn ev(event: &str, data: &str) -> SseEvent {
        SseEvent {
            event: event.into(),
            data: data.into(),
        }
    }

    #[tokio::test]
    async fn events_across_chunks_with_comments_and_crlf() {
        let got = parse(&[
            ":keep-alive\n\nevent: status\nda",
            "ta: {\"a\":1}\n\r\n",
            "data: one\r\ndata:two\n\n",
            "event: line\ndata: \"x\"\n\nevent: cut\ndata: never",
        ])
        .await;
        assert_eq!(
            got,
            vec![
                ev("status", r#"{"a":1}"#),
                ev("message", "one\ntwo"),
                ev("line", "\"x\""),
            ]
        );
    }

    #[tokio::test]
    async fn an_endless_line_ends_the_stream() {
        let long = "x".repeat(MAX_LINE + 1);
        let stream = futures_util::stream::iter(vec![Ok::<_, std::convert::Infallible>(
            Bytes::from(format!("data: {long}")),
        )]);
        let events = events(stream);
        futures_util::pin_mut!(events);
        assert!(matches!(
            events.next().await,
            Some(Err(SseError::LineTooLong))
        ));
        assert!(events.next().await.is_none());
    }
}
