//! The launch-token scanner: the shim cuts a program's output into lines
//! (`take_pieces`, fed reads of sizes the input chooses), each line is
//! checked for the ready line (`ready_token`) with the `ready_token_regex`
//! of a shipped example, and the token found is blanked from what the
//! proxy passes back (`credential::Scrubber`, over chunks) and from log
//! lines (`credential::scrub_text`).
//!
//! Checks that the lines, joined, are the output byte for byte, each
//! ending at a newline or at the piece cap; that a token is part of its
//! line; that scrubbing a stream leaves no copy of the token, whatever
//! the chunks, and agrees with scrubbing it whole.

#![no_main]

use std::sync::LazyLock;

use berth_local::fuzzing::{MAX_PIECE, ready_token, take_pieces};
use berth_proxy::credential::{Scrubber, scrub_text};
use libfuzzer_sys::fuzz_target;
use regex::Regex;

/// Every shipped example's `ready_token_regex`, read from the examples
/// themselves so that the target follows them.
static PATTERNS: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    [
        include_str!("../../examples/demo.toml"),
        include_str!("../../examples/dsh.toml"),
        include_str!("../../examples/jupyter.toml"),
        include_str!("../../examples/kubernetes.toml"),
    ]
    .iter()
    .flat_map(|example| example.lines())
    .filter_map(|line| line.strip_prefix("ready_token_regex = '"))
    .map(|rest| Regex::new(rest.trim_end().trim_end_matches('\'')).unwrap())
    .collect()
});

/// Chunk lengths 1–32 from a xorshift seeded by the input, now and then
/// everything left.
struct Cuts(u32);

impl Cuts {
    fn next(&mut self, left: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 17;
        self.0 ^= self.0 << 5;
        match self.0 % 8 {
            0 => left,
            _ => (self.0 >> 8) as usize % 32 + 1,
        }
        .min(left)
    }
}

fuzz_target!(|data: &[u8]| {
    assert_eq!(PATTERNS.len(), 4, "an example lost its ready_token_regex");
    let Some((&choice, output)) = data.split_first() else {
        return;
    };
    let pattern = &PATTERNS[usize::from(choice) % PATTERNS.len()];
    let mut cuts = Cuts(u32::from(choice) | 0x100);

    // What the shim's pump does with the program's reads.
    let mut pending = Vec::new();
    let mut pieces = Vec::new();
    let mut at = 0;
    while at < output.len() {
        let end = at + cuts.next(output.len() - at);
        pending.extend_from_slice(&output[at..end]);
        pieces.extend(take_pieces(&mut pending));
        at = end;
    }
    assert!(!pending.contains(&b'\n') && pending.len() < MAX_PIECE);
    for piece in &pieces {
        assert!(piece.ends_with(b"\n") || piece.len() == MAX_PIECE);
    }
    if !pending.is_empty() {
        pieces.push(pending);
    }
    assert_eq!(pieces.concat(), output, "the lines are not the output");

    let Some(token) = pieces
        .iter()
        .filter_map(|piece| Some((piece, ready_token(pattern, piece)?)))
        .find_map(|(piece, token)| {
            let token = token?;
            let line = String::from_utf8_lossy(piece);
            assert!(line.contains(&token), "{token:?} is not in {line:?}");
            Some(token)
        })
    else {
        return;
    };
    assert!(!token.is_empty(), "an empty token in {pattern}");

    let mut scrubber = Scrubber::new(&token).unwrap();
    let mut scrubbed = Vec::new();
    let mut at = 0;
    while at < output.len() {
        let end = at + cuts.next(output.len() - at);
        scrubbed.extend_from_slice(&scrubber.push(&output[at..end]));
        at = end;
    }
    scrubbed.extend_from_slice(&scrubber.finish());
    assert!(
        !scrubbed.windows(token.len()).any(|w| w == token.as_bytes()),
        "{token:?} passes the scrubber"
    );
    if let Ok(text) = std::str::from_utf8(output) {
        assert_eq!(scrubbed, scrub_text(text, &token).into_bytes());
    }
});
