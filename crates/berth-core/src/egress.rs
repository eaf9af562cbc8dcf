//! Where a program may connect, as every runtime's egress rules say it:
//! the public internet, nothing private, and never a cloud's metadata
//! service. The local runtime turns these lists into nftables rules, the
//! Kubernetes runtime into a NetworkPolicy.

/// Cloud metadata services and host agents, which hand out the host's
/// credentials: AWS's, GCP's and Azure's metadata (169.254.169.254), AWS
/// ECS's task credentials, Alibaba's metadata, Azure's wire server.
pub const METADATA_V4: &[&str] = &[
    "169.254.169.254/32",
    "169.254.170.2/32",
    "100.100.100.200/32",
    "168.63.129.16/32",
];
/// AWS's IPv6 metadata service.
pub const METADATA_V6: &[&str] = &["fd00:ec2::254/128"];
/// IPv4 ranges no program reaches unless allowed: RFC 1918, shared
/// address space (CGNAT, RFC 6598) and link-local.
pub const PRIVATE_V4: &[&str] = &[
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
];
/// IPv6 unique local and link-local ranges.
pub const PRIVATE_V6: &[&str] = &["fc00::/7", "fe80::/10"];
