//! Trusted proxies and header mode: whose `X-Forwarded-*` headers berth
//! believes, and the SSO proxy's headers.

use std::net::IpAddr;
use std::str::FromStr;

use hyper::header::{HeaderMap, HeaderName};

use crate::conn::ConnInfo;

/// The header an SSO proxy names the user in (`auth = "header"`).
pub static FORWARDED_USER: HeaderName = HeaderName::from_static("x-forwarded-user");
/// The header an SSO proxy proves itself with, when `[proxy] header_secret`
/// is set.
pub static PROXY_SECRET: HeaderName = HeaderName::from_static("x-berth-proxy-secret");

/// A `trusted_proxies` entry that is not an IP address or CIDR block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an IP address or CIDR block")]
pub struct InvalidIpNet(pub String);

/// `10.0.0.0/8`, or a bare address (a /32 or /128).
fn parse_net(s: &str) -> Result<ipnet::IpNet, InvalidIpNet> {
    let s = s.trim();
    s.parse::<ipnet::IpNet>()
        .or_else(|_| s.parse::<IpAddr>().map(ipnet::IpNet::from))
        .map_err(|_| InvalidIpNet(s.to_owned()))
}

/// IPv4-mapped IPv6 peers (`::ffff:10.0.0.1`, from dual-stack listeners)
/// are their IPv4 address, so `10.0.0.0/8` matches them.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// How the proxy identifies callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AuthMode {
    /// Tokens only.
    #[default]
    Token,
    /// Tokens, and `X-Forwarded-User` from a trusted proxy.
    Header,
}

impl FromStr for AuthMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "token" => Ok(AuthMode::Token),
            "header" => Ok(AuthMode::Header),
            other => Err(format!(
                "{other:?} is not an auth mode (expected \"token\" or \"header\")"
            )),
        }
    }
}

/// The addresses whose `X-Forwarded-*` headers berth believes.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies(Vec<ipnet::IpNet>);

impl TrustedProxies {
    /// Reads `trusted_proxies` entries, each an IP address or a CIDR block.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, InvalidIpNet> {
        entries
            .iter()
            .map(|e| parse_net(e.as_ref()))
            .collect::<Result<_, _>>()
            .map(Self)
    }

    /// Whether `ip` is trusted. An IPv4-mapped IPv6 address counts as its
    /// IPv4 address.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.0.iter().any(|net| net.contains(&ip))
    }
}

/// Whether the client reached berth over https: said by a trusted proxy in
/// `X-Forwarded-Proto` (berth itself listens on plain HTTP).
pub fn is_https(headers: &HeaderMap, conn: &ConnInfo) -> bool {
    conn.trusted
        && headers
            .get("x-forwarded-proto")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trusted_proxies_match_addresses_and_blocks() {
        let trusted =
            TrustedProxies::parse(&["127.0.0.1", "fd00::/8", "10.0.0.0/8", " 192.168.1.7 "])
                .unwrap();
        assert!(trusted.contains("127.0.0.1".parse().unwrap()));
        assert!(trusted.contains("fd12::1".parse().unwrap()));
        assert!(trusted.contains("10.1.2.3".parse().unwrap()));
        assert!(
            trusted.contains("::ffff:10.1.2.3".parse().unwrap()),
            "v4-mapped"
        );
        assert!(trusted.contains("192.168.1.7".parse().unwrap()));
        assert!(!trusted.contains("127.0.0.2".parse().unwrap()));
        assert!(!trusted.contains("11.0.0.1".parse().unwrap()));
        let all = TrustedProxies::parse(&["0.0.0.0/0"]).unwrap();
        assert!(all.contains("192.168.0.1".parse().unwrap()));
        for bad in ["10.0.0.0/33", "x", "::1/129", "1.2.3.4/", ""] {
            assert_eq!(
                TrustedProxies::parse(&[bad]).unwrap_err(),
                InvalidIpNet(bad.trim().to_owned()),
                "{bad}"
            );
        }
    }
}
