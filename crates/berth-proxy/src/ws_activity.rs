//! Which bytes a WebSocket client sends are the user's activity.
//!
//! Browsers answer every WebSocket ping with a pong on their own, open tab
//! in the background or not (Jupyter Server pings every 30 s). Counting
//! every byte the client sends as activity therefore keeps an instance
//! that only pushes to a background tab awake forever. The definition of
//! activity (README, "Hibernation") counts the client's *data* frames
//! only: continuation, text and binary. Control frames (close, ping,
//! pong) are the browser's and the protocol's, not the user's.
//!
//! [`ClientFrames`] follows the client-to-server frame stream of RFC 6455
//! §5.2 as it passes through the tunnel, one read at a time, and says of
//! each chunk whether any of its bytes belonged to a data frame. It never
//! copies or buffers the stream: a header that straddles two reads is
//! carried over in a few bytes of state, and a payload is skipped by
//! counting its length down. When the stream stops making sense (a
//! reserved opcode, a 64-bit length with its top bit set, an unmasked
//! frame, a control frame longer than 125 bytes or fragmented) it gives
//! up and reports every byte from then on as activity: a mistake must
//! never put a busy user's instance to sleep.
//!
//! Written by hand because nothing in the tree follows a stream
//! passively: hyper hands over the upgraded connection without framing,
//! and tungstenite's codec must own the stream and buffer whole frames
//! (its `FrameHeader::parse` reads one complete header from a contiguous
//! buffer, which would still leave straddled headers and payload skipping
//! to us). The frame header is a handful of bit fields; the state machine
//! that follows it across reads is what this module is.

/// Opcodes (RFC 6455 §5.2): 0x0–0x2 data, 0x8–0xA control, the rest
/// reserved.
const CONTINUATION: u8 = 0x0;
const BINARY: u8 = 0x2;
const CLOSE: u8 = 0x8;
const PONG: u8 = 0xA;

/// Longest payload a control frame may carry (RFC 6455 §5.5).
const MAX_CONTROL_PAYLOAD: u64 = 125;

/// Where in the frame stream the next byte falls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The first header byte: FIN, RSV1–3, opcode.
    Opcode,
    /// The second: MASK and the 7-bit length.
    Length { data: bool, control: bool },
    /// `left` more bytes of a 16- or 64-bit big-endian length.
    ExtendedLength {
        data: bool,
        control: bool,
        left: u8,
        length: u64,
    },
    /// `left` more bytes of the masking key, then `length` bytes of
    /// payload.
    MaskingKey { data: bool, left: u8, length: u64 },
    /// `left` more payload bytes.
    Payload { data: bool, left: u64 },
    /// The stream could not be followed: every byte is activity.
    Opaque,
}

/// Follows a client's WebSocket frames across reads; see the module doc.
#[derive(Debug, Clone)]
pub struct ClientFrames {
    step: Step,
}

impl Default for ClientFrames {
    fn default() -> Self {
        Self::new()
    }
}

impl ClientFrames {
    /// At the start of the stream, right after the handshake.
    pub fn new() -> Self {
        Self { step: Step::Opcode }
    }

    /// Whether the scanner gave up on the stream (and now counts every
    /// byte as activity).
    pub fn is_opaque(&self) -> bool {
        self.step == Step::Opaque
    }

    /// Takes the next chunk the client sent; true when any of its bytes
    /// belonged to a data frame (its header or its payload), or when the
    /// stream cannot be followed.
    pub fn feed(&mut self, chunk: &[u8]) -> bool {
        let mut data_seen = false;
        let mut rest = chunk;
        while !rest.is_empty() {
            match self.step {
                Step::Opaque => return true,
                Step::Payload { data, left } => {
                    // Skipped, not read: one step per frame, whatever its
                    // size.
                    let here = rest.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    data_seen |= data;
                    rest = &rest[here..];
                    let left = left - here as u64;
                    self.step = if left == 0 {
                        Step::Opcode
                    } else {
                        Step::Payload { data, left }
                    };
                }
                step => {
                    let (byte, tail) = (rest[0], &rest[1..]);
                    rest = tail;
                    self.step = header_byte(step, byte);
                    data_seen |= match self.step {
                        Step::Length { data, .. }
                        | Step::ExtendedLength { data, .. }
                        | Step::MaskingKey { data, .. }
                        | Step::Payload { data, .. } => data,
                        // A data frame whose header ended this byte with an
                        // empty payload: `step` said which kind it was.
                        Step::Opcode => matches!(step, Step::MaskingKey { data: true, .. }),
                        Step::Opaque => true,
                    };
                }
            }
        }
        data_seen
    }
}

/// The step after one more header byte.
fn header_byte(step: Step, byte: u8) -> Step {
    match step {
        Step::Opcode => {
            // RSV1–3 are left alone: an extension (permessage-deflate sets
            // RSV1) gives them meaning without changing the framing.
            let fin = byte & 0x80 != 0;
            match byte & 0x0F {
                CONTINUATION..=BINARY => Step::Length {
                    data: true,
                    control: false,
                },
                CLOSE..=PONG if fin => Step::Length {
                    data: false,
                    control: true,
                },
                // A fragmented control frame, or a reserved opcode.
                _ => Step::Opaque,
            }
        }
        Step::Length { data, control } => {
            // Every frame a client sends is masked (RFC 6455 §5.1).
            if byte & 0x80 == 0 {
                return Step::Opaque;
            }
            match byte & 0x7F {
                126 => Step::ExtendedLength {
                    data,
                    control,
                    left: 2,
                    length: 0,
                },
                127 => Step::ExtendedLength {
                    data,
                    control,
                    left: 8,
                    length: 0,
                },
                short => masking_key(data, control, u64::from(short)),
            }
        }
        Step::ExtendedLength {
            data,
            control,
            left,
            length,
        } => {
            // The most significant bit of a 64-bit length must be 0: the
            // first of its 8 bytes says so.
            if left == 8 && byte & 0x80 != 0 {
                return Step::Opaque;
            }
            let length = (length << 8) | u64::from(byte);
            if left > 1 {
                Step::ExtendedLength {
                    data,
                    control,
                    left: left - 1,
                    length,
                }
            } else {
                masking_key(data, control, length)
            }
        }
        Step::MaskingKey { data, left, length } => {
            if left > 1 {
                Step::MaskingKey {
                    data,
                    left: left - 1,
                    length,
                }
            } else if length == 0 {
                Step::Opcode
            } else {
                Step::Payload { data, left: length }
            }
        }
        // Not header bytes: `feed` handles these itself.
        Step::Payload { .. } | Step::Opaque => step,
    }
}

/// After the length: the 4-byte masking key, unless a control frame claims
/// more payload than it may have.
fn masking_key(data: bool, control: bool, length: u64) -> Step {
    if control && length > MAX_CONTROL_PAYLOAD {
        return Step::Opaque;
    }
    Step::MaskingKey {
        data,
        left: 4,
        length,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: u8 = 0x1;
    const PING: u8 = 0x9;

    /// A masked client frame with `payload_len` bytes of payload (zeros:
    /// the scanner never looks at them), with the shortest length
    /// encoding unless `force_64` asks for the 64-bit one.
    fn frame(fin: bool, opcode: u8, payload_len: usize, force_64: bool) -> Vec<u8> {
        let mut out = vec![if fin { 0x80 } else { 0 } | opcode];
        let len = payload_len as u64;
        if force_64 || len > 0xFFFF {
            out.push(0x80 | 127);
            out.extend_from_slice(&len.to_be_bytes());
        } else if len >= 126 {
            out.push(0x80 | 126);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            out.push(0x80 | len as u8);
        }
        out.extend_from_slice(&[0x37, 0xFA, 0x21, 0x3D]);
        out.resize(out.len() + payload_len, 0);
        out
    }

    fn concat(frames: &[Vec<u8>]) -> Vec<u8> {
        frames.concat()
    }

    /// Feeds `stream` in pieces cut at `cuts`; which pieces were activity.
    fn feed_split(stream: &[u8], cuts: &[usize]) -> (Vec<bool>, ClientFrames) {
        let mut scanner = ClientFrames::new();
        let mut answers = Vec::new();
        let mut from = 0;
        for &cut in cuts.iter().chain(std::iter::once(&stream.len())) {
            answers.push(scanner.feed(&stream[from..cut]));
            from = cut;
        }
        (answers, scanner)
    }

    /// Which byte ranges of `frames` (concatenated) are data frames.
    fn data_bytes(frames: &[Vec<u8>]) -> Vec<bool> {
        frames
            .iter()
            .flat_map(|f| {
                let data = f[0] & 0x0F <= BINARY;
                std::iter::repeat_n(data, f.len())
            })
            .collect()
    }

    /// Every way to cut `frames` in two (and in three, around each byte)
    /// gives each piece the answer "does it hold a data frame's byte", and
    /// the scanner ends in step with the stream.
    fn check_every_split(frames: &[Vec<u8>]) {
        let stream = concat(frames);
        let data = data_bytes(frames);
        let expect = |from: usize, to: usize| data[from..to].iter().any(|d| *d);
        for a in 0..=stream.len() {
            let (answers, scanner) = feed_split(&stream, &[a]);
            assert_eq!(
                answers,
                [expect(0, a), expect(a, stream.len())],
                "cut at {a} of {frames:?}"
            );
            assert_eq!(scanner.step, Step::Opcode, "cut at {a}");
            for b in a..=stream.len() {
                let (answers, _) = feed_split(&stream, &[a, b]);
                assert_eq!(
                    answers,
                    [expect(0, a), expect(a, b), expect(b, stream.len())],
                    "cuts at {a}, {b}"
                );
            }
        }
        // Byte by byte.
        let cuts: Vec<usize> = (1..stream.len()).collect();
        let (answers, scanner) = feed_split(&stream, &cuts);
        assert_eq!(answers, data, "byte by byte");
        assert!(!scanner.is_opaque());
    }

    #[test]
    fn pongs_pings_and_closes_are_not_activity() {
        for opcode in [PING, PONG, CLOSE] {
            for len in [0, 2, 125] {
                let stream = frame(true, opcode, len, false);
                check_every_split(std::slice::from_ref(&stream));
                assert!(!ClientFrames::new().feed(&stream), "{opcode:#x} {len}");
            }
        }
        // Many in one read, as a backlog of pongs arrives.
        let pongs: Vec<Vec<u8>> = (0..50).map(|i| frame(true, PONG, i % 4, false)).collect();
        assert!(!ClientFrames::new().feed(&concat(&pongs)));
    }

    #[test]
    fn text_binary_and_empty_data_frames_are_activity() {
        for opcode in [TEXT, BINARY] {
            for len in [0, 1, 125] {
                check_every_split(&[frame(true, opcode, len, false)]);
            }
        }
        let mut scanner = ClientFrames::new();
        assert!(scanner.feed(&frame(true, TEXT, 0, false)));
        assert!(!scanner.feed(&frame(true, PONG, 0, false)));
    }

    #[test]
    fn extended_lengths_are_followed() {
        // 16-bit lengths at their edges, a 64-bit one, and a 64-bit
        // encoding of a short length (legal, if wasteful).
        for (len, force_64) in [(126, false), (127, false), (65_535, false), (65_536, false)] {
            let frames = [
                frame(true, PONG, 4, false),
                frame(true, BINARY, len, force_64),
                frame(true, PING, 0, false),
            ];
            let stream = concat(&frames);
            let data = data_bytes(&frames);
            // Every cut through the headers, and a few through the payload.
            let header_end = frames[0].len() + 14;
            let cuts = (0..=header_end).chain([stream.len() / 2, stream.len() - 7]);
            for a in cuts {
                let (answers, scanner) = feed_split(&stream, &[a]);
                let expect = |from: usize, to: usize| data[from..to].iter().any(|d| *d);
                assert_eq!(
                    answers,
                    [expect(0, a), expect(a, stream.len())],
                    "{len} at {a}"
                );
                assert_eq!(scanner.step, Step::Opcode);
            }
        }
        check_every_split(&[frame(true, TEXT, 3, true), frame(true, PONG, 1, false)]);
    }

    #[test]
    fn a_payload_spread_over_many_reads_is_activity_in_each() {
        let stream = frame(true, BINARY, 100_000, false);
        let cuts: Vec<usize> = (1..stream.len() / 4096).map(|i| i * 4096).collect();
        let (answers, scanner) = feed_split(&stream, &cuts);
        assert!(answers.iter().all(|a| *a), "{answers:?}");
        assert_eq!(scanner.step, Step::Opcode);
    }

    #[test]
    fn control_frames_between_fragments_are_told_apart() {
        // A message in three fragments with a ping and a pong between
        // them (RFC 6455 §5.4 lets control frames interleave).
        let frames = [
            frame(false, TEXT, 5, false),
            frame(true, PONG, 3, false),
            frame(false, CONTINUATION, 130, false),
            frame(true, PING, 0, false),
            frame(true, CONTINUATION, 1, false),
            frame(true, CLOSE, 2, false),
        ];
        check_every_split(&frames);
        let stream = concat(&frames);
        let (a, b) = (frames[0].len(), frames[0].len() + frames[1].len());
        let (answers, _) = feed_split(&stream, &[a, b]);
        assert_eq!(answers, [true, false, true]);
    }

    #[test]
    fn the_unfollowable_counts_every_byte_from_then_on() {
        let pong = frame(true, PONG, 0, false);
        let unmasked = {
            let mut f = frame(true, TEXT, 0, false);
            f[1] &= 0x7F;
            f.truncate(2);
            f
        };
        let top_bit_length = {
            let mut f = frame(true, BINARY, 0, true);
            f[2] = 0x80;
            f
        };
        let long_ping = {
            let mut f = vec![0x80 | PING, 0x80 | 126, 0, 126];
            f.extend_from_slice(&[0; 4 + 126]);
            f
        };
        let cases = [
            ("reserved data opcode", vec![0x83, 0x80]),
            ("reserved control opcode", vec![0x8B, 0x80]),
            ("fragmented ping", vec![0x09, 0x80]),
            ("unmasked frame", unmasked),
            ("64-bit length with its top bit set", top_bit_length),
            ("control frame over 125 bytes", long_ping),
        ];
        for (what, bad) in cases {
            let mut scanner = ClientFrames::new();
            assert!(!scanner.feed(&pong), "{what}");
            assert!(scanner.feed(&bad), "{what}");
            assert!(scanner.is_opaque(), "{what}");
            // From now on, even what looks like a pong is activity.
            assert!(scanner.feed(&pong), "{what}");
            assert!(!scanner.feed(&[]), "an empty read is nothing: {what}");
        }
    }

    #[test]
    fn rsv_bits_of_a_compressed_message_do_not_matter() {
        // permessage-deflate sets RSV1 on a compressed message's first
        // frame.
        let mut compressed = frame(true, TEXT, 10, false);
        compressed[0] |= 0x40;
        check_every_split(&[compressed, frame(true, PONG, 0, false)]);
    }
}
