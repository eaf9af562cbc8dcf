//! Reading the name a connection asks for from its first bytes.
//!
//! The proxy decides where a connection may go before it forwards a single
//! byte, so it peeks at what the client sends first: a TLS ClientHello
//! carries the server name in its SNI extension, an HTTP/1 request carries
//! it in its `Host` header. [`sniff`] is a pure function over those bytes;
//! the caller reads, calls it, and reads more while it answers
//! [`Sniffed::NeedMore`].
//!
//! Whatever [`sniff`] cannot read with certainty is [`Sniffed::Nothing`]:
//! the proxy closes such a connection, so being strict here only ever
//! refuses, it never lets a connection through under a name it did not
//! really ask for.

/// What the first bytes of a connection ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniffed {
    /// A TLS ClientHello's server_name (SNI, host_name type), or an
    /// HTTP/1.x request's Host header (port stripped), lowercased, without
    /// a trailing dot.
    Name {
        /// The DNS host name asked for.
        name: String,
        /// Which protocol carried it.
        protocol: Protocol,
    },
    /// Not enough bytes yet to decide; read more (up to
    /// [`MAX_SNIFF_BYTES`]).
    NeedMore,
    /// Neither a TLS ClientHello with a server name nor an HTTP/1 request
    /// with a Host header (includes: ClientHello without SNI, SNI that is
    /// an IP literal, HTTP without Host, Host that is an IP literal or has
    /// an empty/invalid name, garbage, anything past [`MAX_SNIFF_BYTES`]
    /// still incomplete).
    Nothing,
}

/// The protocol a sniffed name came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// The server_name extension of a TLS ClientHello.
    Tls,
    /// The `Host` header of an HTTP/1.x request.
    Http,
}

/// How many bytes the caller reads, at most, before giving up on a name:
/// a prefix this long that is still incomplete is [`Sniffed::Nothing`].
pub const MAX_SNIFF_BYTES: usize = 16 * 1024;

/// Reads the name the first bytes of a connection ask for.
///
/// `prefix` is everything the client has sent so far. The first byte picks
/// the protocol: `0x16` (a TLS handshake record) is read as a ClientHello,
/// an ASCII uppercase letter (the start of a method) as an HTTP/1 request,
/// anything else is [`Sniffed::Nothing`].
///
/// Only the first TLS record is read: a ClientHello split across records
/// (legal, but no client does it for hellos of ordinary size) is
/// [`Sniffed::Nothing`].
pub fn sniff(prefix: &[u8]) -> Sniffed {
    match prefix.first() {
        None => Sniffed::NeedMore,
        Some(&TLS_HANDSHAKE_RECORD) => sniff_tls(prefix),
        Some(first) if first.is_ascii_uppercase() => sniff_http(prefix),
        Some(_) => Sniffed::Nothing,
    }
}

const TLS_HANDSHAKE_RECORD: u8 = 22;
const TLS_RECORD_HEADER_LEN: usize = 5;
const TLS_MAJOR_VERSION: u8 = 3;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const EXTENSION_SERVER_NAME: u16 = 0;
const SERVER_NAME_HOST_NAME: u8 = 0;
const MAX_SESSION_ID_LEN: usize = 32;
const TLS_RANDOM_LEN: usize = 32;

fn sniff_tls(prefix: &[u8]) -> Sniffed {
    // Reject what is visibly not a ClientHello record as soon as its bytes
    // are there, rather than waiting for a length's worth of garbage.
    if prefix
        .get(1)
        .is_some_and(|&major| major != TLS_MAJOR_VERSION)
    {
        return Sniffed::Nothing;
    }
    if prefix
        .get(TLS_RECORD_HEADER_LEN)
        .is_some_and(|&handshake_type| handshake_type != HANDSHAKE_CLIENT_HELLO)
    {
        return Sniffed::Nothing;
    }
    let mut header = Cursor::new(prefix);
    let (Some(_content_type), Some(_version), Some(record_len)) =
        (header.u8(), header.u16(), header.u16())
    else {
        return Sniffed::NeedMore;
    };
    let record_end = TLS_RECORD_HEADER_LEN + usize::from(record_len);
    if record_end > MAX_SNIFF_BYTES {
        return Sniffed::Nothing;
    }
    // The whole record is the unit read: until it is complete no field in
    // it can be trusted to be final.
    let Some(record) = prefix.get(TLS_RECORD_HEADER_LEN..record_end) else {
        return Sniffed::NeedMore;
    };
    match client_hello_server_name(record).and_then(host_name) {
        Some(name) => Sniffed::Name {
            name,
            protocol: Protocol::Tls,
        },
        None => Sniffed::Nothing,
    }
}

/// The raw host_name of the ClientHello that starts `record` (a complete
/// handshake record's body), or `None` if it is malformed, has no
/// server_name, or has one the server could read differently.
fn client_hello_server_name(record: &[u8]) -> Option<&[u8]> {
    let mut handshake = Cursor::new(record);
    if handshake.u8()? != HANDSHAKE_CLIENT_HELLO {
        return None;
    }
    let hello_len = handshake.u24()?;
    // A hello longer than this record continues in the next one; only the
    // first record is read.
    let mut hello = Cursor::new(handshake.take(hello_len)?);

    let (major, _minor) = (hello.u8()?, hello.u8()?);
    if major != TLS_MAJOR_VERSION {
        return None;
    }
    hello.take(TLS_RANDOM_LEN)?;
    if hello.u8_prefixed()?.len() > MAX_SESSION_ID_LEN {
        return None;
    }
    let cipher_suites = hello.u16_prefixed()?;
    if cipher_suites.is_empty() || cipher_suites.len() % 2 != 0 {
        return None;
    }
    if hello.u8_prefixed()?.is_empty() {
        return None;
    }
    if hello.is_empty() {
        // A hello may end before the extensions: then it names nothing.
        return None;
    }
    let mut extensions = Cursor::new(hello.u16_prefixed()?);
    if !hello.is_empty() {
        return None;
    }

    let mut server_name = None;
    while !extensions.is_empty() {
        let extension_type = extensions.u16()?;
        let data = extensions.u16_prefixed()?;
        if extension_type != EXTENSION_SERVER_NAME {
            continue;
        }
        // A server refuses a hello that repeats an extension; a proxy that
        // picked one of the two could disagree with what the server reads.
        if server_name.is_some() {
            return None;
        }
        server_name = Some(host_name_entry(data)?);
    }
    server_name
}

/// The host_name entry of a server_name extension's data.
fn host_name_entry(data: &[u8]) -> Option<&[u8]> {
    let mut extension = Cursor::new(data);
    let mut list = Cursor::new(extension.u16_prefixed()?);
    if !extension.is_empty() || list.is_empty() {
        return None;
    }
    let mut host_name = None;
    while !list.is_empty() {
        let name_type = list.u8()?;
        let name = list.u16_prefixed()?;
        if name_type != SERVER_NAME_HOST_NAME {
            continue;
        }
        // Two host names are forbidden for the same reason as two
        // server_name extensions: which one counts would be a guess.
        if host_name.is_some() {
            return None;
        }
        host_name = Some(name);
    }
    host_name
}

/// Reads big-endian, length-prefixed TLS fields off the front of a byte
/// slice; every read fails with `None` instead of running past the end.
struct Cursor<'a> {
    rest: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }

    fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }

    fn take(&mut self, len: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.rest.split_at_checked(len)?;
        self.rest = tail;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        let (&byte, tail) = self.rest.split_first()?;
        self.rest = tail;
        Some(byte)
    }

    fn u16(&mut self) -> Option<u16> {
        let bytes = self.take(2)?;
        Some(u16::from_be_bytes([*bytes.first()?, *bytes.get(1)?]))
    }

    fn u24(&mut self) -> Option<usize> {
        let bytes = self.take(3)?;
        let value = u32::from_be_bytes([0, *bytes.first()?, *bytes.get(1)?, *bytes.get(2)?]);
        usize::try_from(value).ok()
    }

    fn u8_prefixed(&mut self) -> Option<&'a [u8]> {
        let len = self.u8()?;
        self.take(usize::from(len))
    }

    fn u16_prefixed(&mut self) -> Option<&'a [u8]> {
        let len = self.u16()?;
        self.take(usize::from(len))
    }
}

/// Enough for any real request head; one with more headers is refused.
const MAX_HTTP_HEADERS: usize = 128;

fn sniff_http(prefix: &[u8]) -> Sniffed {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HTTP_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(prefix) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) if prefix.len() < MAX_SNIFF_BYTES => {
            return Sniffed::NeedMore;
        }
        Ok(httparse::Status::Partial) | Err(_) => return Sniffed::Nothing,
    }
    // CONNECT asks a forward proxy to open a tunnel; this proxy is
    // transparent and only forwards to the destination the request names.
    if request
        .method
        .is_none_or(|method| method.eq_ignore_ascii_case("CONNECT"))
    {
        return Sniffed::Nothing;
    }
    let mut hosts = request
        .headers
        .iter()
        .filter(|header| header.name.eq_ignore_ascii_case("host"));
    let (Some(host), None) = (hosts.next(), hosts.next()) else {
        // No Host, or several: a server answers both with 400, and which of
        // several a server would pick is not ours to guess.
        return Sniffed::Nothing;
    };
    match host_without_port(host.value).and_then(host_name) {
        Some(name) => Sniffed::Name {
            name,
            protocol: Protocol::Http,
        },
        None => Sniffed::Nothing,
    }
}

/// The host part of a `Host` header value (`host` or `host:port`), or
/// `None` for a bracketed IP literal or a malformed port.
fn host_without_port(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    if value.first() == Some(&b'[') {
        return None;
    }
    match value.iter().position(|&byte| byte == b':') {
        None => Some(value),
        Some(colon) => {
            let (host, port) = (value.get(..colon)?, value.get(colon + 1..)?);
            port.iter().all(u8::is_ascii_digit).then_some(host)
        }
    }
}

const MAX_HOST_NAME_LEN: usize = 253;
const MAX_LABEL_LEN: usize = 63;

/// `raw` as a lowercase DNS host name without a trailing dot, or `None` if
/// it is not a host name or is an address in disguise.
fn host_name(raw: &[u8]) -> Option<String> {
    let name = raw.strip_suffix(b".").unwrap_or(raw);
    if name.is_empty() || name.len() > MAX_HOST_NAME_LEN {
        return None;
    }
    let name = std::str::from_utf8(name).ok()?.to_ascii_lowercase();
    let labels_valid = name.split('.').all(|label| {
        (1..=MAX_LABEL_LEN).contains(&label.len())
            && label
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || byte == b'-')
    });
    if !labels_valid {
        return None;
    }
    // An IPv6 literal has already failed the label check (':'). An IPv4
    // literal, and the shorthand forms the resolver the proxy hands the name
    // to may also read as an address ("127.1", "0x7f000001"), all end in a
    // label that starts with a digit; no top-level domain does, so such a
    // name is taken for an address and refused.
    let last_label_starts_with_digit = name
        .rsplit('.')
        .next()
        .and_then(|label| label.bytes().next())
        .is_some_and(|byte| byte.is_ascii_digit());
    if last_label_starts_with_digit {
        return None;
    }
    Some(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // Captured on this machine, no network: a Python listener on 127.0.0.1
    // saved the first TLS record of what
    // `openssl s_client -connect 127.0.0.1:PORT -servername allowed.example`
    // (OpenSSL 3.0.19) sent.
    const OPENSSL_HELLO: &str = concat!(
        "160301013c010001380303193539cb37d68f7cbcc9cb7a5cd3f5e39e5b7bd4e4",
        "23bf9bf519fb07861876b2202cbba67d74ec071c738c57463a4e5015592c17cb",
        "9f5f6ce6a206f434c23a9499003e130213031301c02cc030009fcca9cca8ccaa",
        "c02bc02f009ec024c028006bc023c0270067c00ac0140039c009c0130033009d",
        "009c003d003c0035002f00ff010000b100000014001200000f616c6c6f776564",
        "2e6578616d706c65000b000403000102000a00160014001d0017001e00190018",
        "01000101010201030104002300000016000000170000000d002a002804030503",
        "0603080708080809080a080b0804080508060401050106010303030103020402",
        "05020602002b0009080304030303020301002d00020101003300260024001d00",
        "206379c8c8a706c2bfcc9a87fb28b371e38eda170cce754eaab1c32d0183df37",
        "53",
    );

    // The same, with `-tls1_2` added: a TLS 1.2-only hello (no
    // supported_versions or key_share extensions).
    const OPENSSL_TLS12_HELLO: &str = concat!(
        "16030100cf010000cb0303c9517f65b70fa826d66af0a47648416ce4e273c12f",
        "9ab46c4d99f66f0007b0c1000038c02cc030009fcca9cca8ccaac02bc02f009e",
        "c024c028006bc023c0270067c00ac0140039c009c0130033009d009c003d003c",
        "0035002f00ff0100006a00000014001200000f616c6c6f7765642e6578616d70",
        "6c65000b000403000102000a000c000a001d0017001e00190018002300000016",
        "000000170000000d002a0028040305030603080708080809080a080b08040805",
        "0806040105010601030303010302040205020602",
    );

    // The same, with `-noservername` instead of `-servername ...`.
    const OPENSSL_HELLO_WITHOUT_SNI: &str = concat!(
        "160301012401000120030342bcaed5e04d62aba247436790960eb7f34a4f480a",
        "a758d8b9e8bdb710f29650208e07e86f52ff79c08b1c100607ae9e7fb25e7808",
        "1631650c438f7cd5917956ef003e130213031301c02cc030009fcca9cca8ccaa",
        "c02bc02f009ec024c028006bc023c0270067c00ac0140039c009c0130033009d",
        "009c003d003c0035002f00ff01000099000b000403000102000a00160014001d",
        "0017001e0019001801000101010201030104002300000016000000170000000d",
        "002a0028040305030603080708080809080a080b080408050806040105010601",
        "030303010302040205020602002b0009080304030303020301002d0002010100",
        "3300260024001d0020e8b981c6f5b39ce8627d5fae2d137d5c4d4386126f9b6c",
        "76a837e9cc40301e2d",
    );

    fn from_hex(hex: &str) -> Vec<u8> {
        (0..hex.len())
            .step_by(2)
            .map(|at| u8::from_str_radix(&hex[at..at + 2], 16).unwrap())
            .collect()
    }

    fn tls_name(name: &str) -> Sniffed {
        Sniffed::Name {
            name: name.to_owned(),
            protocol: Protocol::Tls,
        }
    }

    fn http_name(name: &str) -> Sniffed {
        Sniffed::Name {
            name: name.to_owned(),
            protocol: Protocol::Http,
        }
    }

    fn u16_prefixed(body: &[u8]) -> Vec<u8> {
        let mut out = u16::try_from(body.len()).unwrap().to_be_bytes().to_vec();
        out.extend_from_slice(body);
        out
    }

    fn extension(extension_type: u16, data: &[u8]) -> Vec<u8> {
        let mut out = extension_type.to_be_bytes().to_vec();
        out.extend(u16_prefixed(data));
        out
    }

    fn server_name_extension(names: &[(u8, &[u8])]) -> Vec<u8> {
        let mut list = Vec::new();
        for (name_type, name) in names {
            list.push(*name_type);
            list.extend(u16_prefixed(name));
        }
        extension(EXTENSION_SERVER_NAME, &u16_prefixed(&list))
    }

    /// A ClientHello in one handshake record, with the given extensions
    /// between two that carry no name (supported_groups before,
    /// supported_versions after), as a real client surrounds server_name.
    fn client_hello(extensions: &[Vec<u8>]) -> Vec<u8> {
        let mut all_extensions = extension(10, &[0, 2, 0, 29]);
        for one in extensions {
            all_extensions.extend_from_slice(one);
        }
        all_extensions.extend(extension(43, &[2, 3, 4]));

        let mut hello = vec![3, 3];
        hello.extend_from_slice(&[0xab; TLS_RANDOM_LEN]);
        hello.push(32);
        hello.extend_from_slice(&[0xcd; 32]);
        hello.extend(u16_prefixed(&[0x13, 0x01, 0xc0, 0x2f]));
        hello.extend_from_slice(&[1, 0]);
        hello.extend(u16_prefixed(&all_extensions));

        let mut handshake = vec![HANDSHAKE_CLIENT_HELLO];
        handshake.extend_from_slice(&u32::try_from(hello.len()).unwrap().to_be_bytes()[1..]);
        handshake.extend(hello);

        let mut record = vec![TLS_HANDSHAKE_RECORD, 3, 1];
        record.extend(u16_prefixed(&handshake));
        record
    }

    fn client_hello_for(name: &str) -> Vec<u8> {
        client_hello(&[server_name_extension(&[(
            SERVER_NAME_HOST_NAME,
            name.as_bytes(),
        )])])
    }

    /// Whether `name` is what `sniff` may return: checked here without the
    /// code under test.
    fn is_valid_sniffed_name(name: &str) -> bool {
        let labels: Vec<&str> = name.split('.').collect();
        !name.is_empty()
            && name.len() <= 253
            && labels.iter().all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            })
            && labels
                .last()
                .and_then(|label| label.chars().next())
                .is_some_and(|c| !c.is_ascii_digit())
    }

    #[test]
    fn openssl_hello_yields_its_server_name() {
        assert_eq!(sniff(&from_hex(OPENSSL_HELLO)), tls_name("allowed.example"));
    }

    #[test]
    fn openssl_tls12_only_hello_yields_its_server_name() {
        assert_eq!(
            sniff(&from_hex(OPENSSL_TLS12_HELLO)),
            tls_name("allowed.example")
        );
    }

    #[test]
    fn bytes_after_the_hello_record_do_not_matter() {
        let mut bytes = from_hex(OPENSSL_HELLO);
        bytes.extend_from_slice(&[0x17, 3, 3, 0, 5, 1, 2, 3]);
        assert_eq!(sniff(&bytes), tls_name("allowed.example"));
    }

    #[test]
    fn openssl_hello_without_sni_is_nothing() {
        assert_eq!(
            sniff(&from_hex(OPENSSL_HELLO_WITHOUT_SNI)),
            Sniffed::Nothing
        );
    }

    #[test]
    fn every_truncation_of_a_real_hello_needs_more() {
        for hex in [
            OPENSSL_HELLO,
            OPENSSL_TLS12_HELLO,
            OPENSSL_HELLO_WITHOUT_SNI,
        ] {
            let hello = from_hex(hex);
            for len in 0..hello.len() {
                assert_eq!(
                    sniff(&hello[..len]),
                    Sniffed::NeedMore,
                    "prefix of {len} bytes"
                );
            }
        }
    }

    #[test]
    fn hello_truncated_inside_a_complete_record_is_nothing() {
        // The record header claims only as many bytes as are there, so the
        // record is complete but the hello inside it is cut short: a parser
        // that trusted the inner lengths would read past the record.
        let hello = from_hex(OPENSSL_HELLO);
        for len in TLS_RECORD_HEADER_LEN..hello.len() {
            let mut cut = hello[..len].to_vec();
            let record_len = u16::try_from(len - TLS_RECORD_HEADER_LEN).unwrap();
            cut[3..5].copy_from_slice(&record_len.to_be_bytes());
            assert_eq!(
                sniff(&cut),
                Sniffed::Nothing,
                "record of {record_len} bytes"
            );
        }
    }

    #[test]
    fn built_hello_yields_its_name_lowercased_without_trailing_dot() {
        assert_eq!(
            sniff(&client_hello_for("Api.Allowed.Example.")),
            tls_name("api.allowed.example")
        );
    }

    #[test]
    fn hello_naming_an_address_is_nothing() {
        for address in [
            "10.0.0.1",
            "127.1",
            "0x7f000001",
            "::1",
            "[::1]",
            "1.2.3.4.",
        ] {
            assert_eq!(
                sniff(&client_hello_for(address)),
                Sniffed::Nothing,
                "{address}"
            );
        }
    }

    #[test]
    fn hello_naming_an_invalid_host_name_is_nothing() {
        let long_label = format!("{}.example", "a".repeat(64));
        let long_name = format!("{}example", "abcdefghi.".repeat(25));
        for name in [
            "",
            ".",
            "a..example",
            ".example",
            "under_score.example",
            "space .example",
            "nul\0.example",
            "ümlaut.example",
            &long_label,
            &long_name,
        ] {
            assert_eq!(sniff(&client_hello_for(name)), Sniffed::Nothing, "{name:?}");
        }
    }

    #[test]
    fn longest_valid_names_are_accepted() {
        let label = format!("{}.example", "a".repeat(63));
        assert_eq!(sniff(&client_hello_for(&label)), tls_name(&label));
        let name = format!("{}example", "abcdefghi.".repeat(24));
        assert_eq!(name.len(), 247);
        assert_eq!(sniff(&client_hello_for(&name)), tls_name(&name));
    }

    #[test]
    fn two_server_names_are_nothing() {
        let twice = server_name_extension(&[
            (SERVER_NAME_HOST_NAME, b"allowed.example"),
            (SERVER_NAME_HOST_NAME, b"evil.example"),
        ]);
        assert_eq!(sniff(&client_hello(&[twice])), Sniffed::Nothing);

        let one = server_name_extension(&[(SERVER_NAME_HOST_NAME, b"allowed.example")]);
        let other = server_name_extension(&[(SERVER_NAME_HOST_NAME, b"evil.example")]);
        assert_eq!(sniff(&client_hello(&[one, other])), Sniffed::Nothing);
    }

    #[test]
    fn server_name_of_another_type_is_skipped() {
        let names =
            server_name_extension(&[(7, b"ignored"), (SERVER_NAME_HOST_NAME, b"allowed.example")]);
        assert_eq!(sniff(&client_hello(&[names])), tls_name("allowed.example"));
        let only_other = server_name_extension(&[(7, b"allowed.example")]);
        assert_eq!(sniff(&client_hello(&[only_other])), Sniffed::Nothing);
    }

    #[test]
    fn record_that_cannot_fit_in_the_sniff_limit_is_nothing() {
        let too_long = u16::try_from(MAX_SNIFF_BYTES).unwrap().to_be_bytes();
        let header = [TLS_HANDSHAKE_RECORD, 3, 1, too_long[0], too_long[1], 1];
        assert_eq!(sniff(&header), Sniffed::Nothing);
    }

    #[test]
    fn not_a_client_hello_record_is_nothing() {
        // SSL 2 major version, then a ServerHello handshake type.
        assert_eq!(sniff(&[TLS_HANDSHAKE_RECORD, 2]), Sniffed::Nothing);
        assert_eq!(
            sniff(&[TLS_HANDSHAKE_RECORD, 3, 3, 0, 40, 2]),
            Sniffed::Nothing
        );
    }

    #[test]
    fn http_request_yields_its_host_without_port() {
        let request = b"GET /path HTTP/1.1\r\nUser-Agent: t\r\nHost: Allowed.Example:8080\r\n\r\n";
        assert_eq!(sniff(request), http_name("allowed.example"));
        let request = b"POST / HTTP/1.0\r\nhost: allowed.example.\r\nContent-Length: 3\r\n\r\nabc";
        assert_eq!(sniff(request), http_name("allowed.example"));
    }

    #[test]
    fn http_host_that_is_an_address_is_nothing() {
        for host in ["10.1.2.3", "10.1.2.3:80", "[::1]", "[::1]:8080", "127.1"] {
            let request = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
            assert_eq!(sniff(request.as_bytes()), Sniffed::Nothing, "{host}");
        }
    }

    #[test]
    fn http_host_that_is_not_a_name_is_nothing() {
        for host in [
            "",
            ":80",
            "allowed.example:http",
            "a:b:c",
            "bad_name.example",
            "a..b",
        ] {
            let request = format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n");
            assert_eq!(sniff(request.as_bytes()), Sniffed::Nothing, "{host:?}");
        }
    }

    #[test]
    fn http_without_exactly_one_host_is_nothing() {
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n"),
            Sniffed::Nothing
        );
        let two = b"GET / HTTP/1.1\r\nHost: allowed.example\r\nHost: evil.example\r\n\r\n";
        assert_eq!(sniff(two), Sniffed::Nothing);
    }

    #[test]
    fn http_connect_is_nothing() {
        let request = b"CONNECT allowed.example:443 HTTP/1.1\r\nHost: allowed.example:443\r\n\r\n";
        assert_eq!(sniff(request), Sniffed::Nothing);
    }

    #[test]
    fn partial_http_head_needs_more() {
        let request = b"GET / HTTP/1.1\r\nHost: allowed.example\r\n\r\n";
        for len in 1..request.len() {
            assert_eq!(
                sniff(&request[..len]),
                Sniffed::NeedMore,
                "prefix of {len} bytes"
            );
        }
    }

    #[test]
    fn http_head_still_partial_at_the_sniff_limit_is_nothing() {
        let mut request = b"GET / HTTP/1.1\r\nX-Padding: ".to_vec();
        request.resize(MAX_SNIFF_BYTES, b'a');
        assert_eq!(sniff(&request), Sniffed::Nothing);
        assert_eq!(sniff(&request[..MAX_SNIFF_BYTES - 1]), Sniffed::NeedMore);
    }

    #[test]
    fn garbage_is_nothing() {
        assert_eq!(sniff(b"\x00\x01\x02"), Sniffed::Nothing);
        assert_eq!(sniff(b"ssh-2.0-OpenSSH\r\n"), Sniffed::Nothing);
        assert_eq!(sniff(b"GET\x00/ HTTP/1.1\r\n"), Sniffed::Nothing);
        assert_eq!(sniff(b"SSH-2.0-OpenSSH_9.6\r\n"), Sniffed::Nothing);
    }

    #[test]
    fn empty_input_needs_more() {
        assert_eq!(sniff(b""), Sniffed::NeedMore);
    }

    fn host_name_strategy() -> impl Strategy<Value = String> {
        let label = "[a-zA-Z0-9-]{1,63}";
        let last_label = "[a-zA-Z][a-zA-Z0-9-]{0,62}";
        (prop::collection::vec(label, 0..4), last_label)
            .prop_map(|(mut labels, last)| {
                labels.push(last);
                labels.join(".")
            })
            .prop_filter("a host name is at most 253 bytes", |name| name.len() <= 253)
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_and_name_only_valid_hosts(
            bytes in prop::collection::vec(any::<u8>(), 0..600),
        ) {
            if let Sniffed::Name { name, .. } = sniff(&bytes) {
                prop_assert!(is_valid_sniffed_name(&name), "{name:?}");
            }
        }

        #[test]
        fn corrupted_real_hello_never_panics_and_names_only_valid_hosts(
            corruptions in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
            keep in any::<prop::sample::Index>(),
        ) {
            let mut hello = from_hex(OPENSSL_HELLO);
            for (at, byte) in corruptions {
                let at = at.index(hello.len());
                hello[at] = byte;
            }
            let kept = keep.index(hello.len() + 1);
            if let Sniffed::Name { name, .. } = sniff(&hello[..kept]) {
                prop_assert!(is_valid_sniffed_name(&name), "{name:?}");
            }
        }

        #[test]
        fn generated_host_name_round_trips(
            name in host_name_strategy(),
            trailing_dot in any::<bool>(),
            port in prop::option::of(any::<u16>()),
        ) {
            let sent = if trailing_dot { format!("{name}.") } else { name.clone() };
            let expected = name.to_ascii_lowercase();

            prop_assert_eq!(sniff(&client_hello_for(&sent)), tls_name(&expected));

            let host = match port {
                Some(port) => format!("{sent}:{port}"),
                None => sent,
            };
            let request = format!("GET / HTTP/1.1\r\nAccept: */*\r\nHost: {host}\r\n\r\n");
            prop_assert_eq!(sniff(request.as_bytes()), http_name(&expected));
        }
    }
}
