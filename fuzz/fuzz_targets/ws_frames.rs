//! The WebSocket frame scanner: `berth_proxy::ws_activity::ClientFrames`,
//! fed a client's byte stream cut into chunks the input chooses.
//!
//! Checks it against a plain reading of RFC 6455 §5.2 over the whole
//! stream at once: each chunk is activity exactly when one of its bytes
//! belongs to a data frame (continuation, text, binary: header or payload)
//! or lies at or after the point where the stream stops making sense, and
//! the scanner gives up exactly there. However the stream is cut, the
//! answers agree; a header or payload that straddles chunks is followed.

#![no_main]

use berth_proxy::ws_activity::ClientFrames;
use libfuzzer_sys::fuzz_target;

/// What one byte of the stream is, read with the whole stream in view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Byte {
    /// Of a data frame: activity.
    Data,
    /// Of a control frame (close, ping, pong): not activity.
    Control,
    /// At or after the point where the stream stops making sense.
    Lost,
}

/// Each byte's kind, by a frame-at-a-time reading of `stream` with
/// nothing carried across reads (there are none).
fn classify(stream: &[u8]) -> Vec<Byte> {
    let mut kinds = Vec::with_capacity(stream.len());
    let mut at = 0;
    let lost = |kinds: &mut Vec<Byte>| kinds.resize(stream.len(), Byte::Lost);
    while at < stream.len() {
        let first = stream[at];
        let fin = first & 0x80 != 0;
        let kind = match first & 0x0F {
            0x0..=0x2 => Byte::Data,
            0x8..=0xA if fin => Byte::Control,
            _ => {
                lost(&mut kinds);
                return kinds;
            }
        };
        let mut header = 1;
        // The second byte: MASK (clients always mask) and the 7-bit length.
        let Some(&second) = stream.get(at + 1) else {
            kinds.resize(stream.len(), kind);
            return kinds;
        };
        header += 1;
        if second & 0x80 == 0 {
            kinds.push(kind);
            lost(&mut kinds);
            return kinds;
        }
        let (extended, short) = match second & 0x7F {
            126 => (2, None),
            127 => (8, None),
            n => (0, Some(u64::from(n))),
        };
        let length = match short {
            Some(n) => n,
            None => {
                let bytes = stream.get(at + 2..at + 2 + extended);
                let Some(bytes) = bytes else {
                    // The stream ends inside the extended length; a 64-bit
                    // one whose top bit is set is lost at its first byte.
                    if extended == 8 && stream.get(at + 2).is_some_and(|b| b & 0x80 != 0) {
                        kinds.resize(at + 2, kind);
                        lost(&mut kinds);
                        return kinds;
                    }
                    kinds.resize(stream.len(), kind);
                    return kinds;
                };
                if extended == 8 && bytes[0] & 0x80 != 0 {
                    kinds.resize(at + 2, kind);
                    lost(&mut kinds);
                    return kinds;
                }
                header += extended;
                bytes.iter().fold(0u64, |n, &b| (n << 8) | u64::from(b))
            }
        };
        if kind == Byte::Control && length > 125 {
            // The byte that completes the length gives the frame away.
            kinds.resize(at + header - 1, kind);
            lost(&mut kinds);
            return kinds;
        }
        header += 4;
        let end = (at as u64)
            .saturating_add(header as u64)
            .saturating_add(length);
        let end = usize::try_from(end).unwrap_or(usize::MAX).min(stream.len());
        kinds.resize(end, kind);
        at = end;
    }
    kinds
}

fuzz_target!(|data: &[u8]| {
    // The first two bytes choose where the stream is cut; the rest is it.
    let (cuts, stream) = data.split_at(data.len().min(2));
    let mut seed = cuts
        .iter()
        .fold(1u32, |s, &b| s.wrapping_mul(31) ^ u32::from(b));
    let kinds = classify(stream);
    assert_eq!(kinds.len(), stream.len());

    let mut scanner = ClientFrames::new();
    let mut at = 0;
    while at < stream.len() {
        // xorshift: chunk lengths 1–16, now and then the rest at once.
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        let len = match seed % 8 {
            0 => stream.len() - at,
            n => usize::try_from(n * 2 + (seed >> 8) % 2).unwrap_or(1),
        };
        let end = (at + len).min(stream.len());
        let active = scanner.feed(&stream[at..end]);
        let expected = kinds[at..end].iter().any(|k| *k != Byte::Control);
        assert_eq!(
            active,
            expected,
            "bytes {at}..{end} of {stream:02x?} read as {:?}",
            &kinds[at..end]
        );
        let lost = kinds[end - 1] == Byte::Lost;
        assert_eq!(scanner.is_opaque(), lost, "after byte {end}");
        at = end;
    }
    assert!(!scanner.feed(&[]), "an empty read is no activity");
});
