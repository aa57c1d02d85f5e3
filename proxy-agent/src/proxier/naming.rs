//! Names the netfilter proxiers give their chains: kube-proxy's hash of a service port (and
//! endpoint), so the same Service gets the same chain names as under kube-proxy.

use crate::model::{Protocol, ServicePortState};

/// Characters of RFC 4648 base32, as Go's `base32.StdEncoding`.
const BASE32: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

/// The first `len` (≤ 16) base32 characters of SHA-256(`text`), as kube-proxy's
/// `portProtoHash` and `servicePortEndpointChainName`.
pub fn hash(text: &str, len: usize) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, text.as_bytes());
    // 16 characters × 5 bits = 80 bits = the first 10 bytes.
    let bits = digest.as_ref()[..10]
        .iter()
        .fold(0u128, |acc, b| (acc << 8) | *b as u128);
    (0..len.min(16))
        .map(|i| BASE32[((bits >> (75 - 5 * i)) & 31) as usize] as char)
        .collect()
}

/// `tcp`, `udp`, `sctp`.
pub fn protocol(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// `ns/name:port` as kube-proxy's `ServicePortName.String()`.
pub fn port_name(state: &ServicePortState) -> String {
    format!("{}:{}", state.name.service, state.name.port)
}

/// What kube-proxy hashes for a service port's chains: name and protocol.
pub fn port_key(state: &ServicePortState) -> String {
    port_name(state) + protocol(state.name.protocol)
}

#[cfg(test)]
mod tests {
    #[test]
    fn hash_is_base32_of_sha256() {
        // SHA-256("") = e3b0c442 98fc1c14 9a..., base32: 4OYMIQUY7QOBJGX...
        assert_eq!(super::hash("", 16), "4OYMIQUY7QOBJGX3");
    }
}
