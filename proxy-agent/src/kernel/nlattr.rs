//! The netlink framing the hand-written protocol clients share (conntrack netlink in
//! [`crate::kernel::conntrack::flows`], the IPVS generic netlink family in [`crate::proxier::ipvs::netlink`]):
//! attributes, nested attributes, and reading replies to one request. Both protocols put a
//! 4-byte family header (nfgenmsg, genlmsghdr) between the netlink header and the
//! attributes.

use anyhow::{bail, Context, Result};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr};

pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
pub const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
pub const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;

/// Appends one attribute (padded to 4 bytes). Callers keep payloads under 64 KiB (the
/// length is 16 bits); a longer one would be cut, so debug builds stop there.
pub fn attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    debug_assert!(
        len <= usize::from(u16::MAX),
        "a netlink attribute of {len} bytes"
    );
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// Appends a string attribute (NUL-terminated, as the kernel's NLA_STRING/NLA_NUL_STRING
/// policies take names).
pub fn attr_str(buf: &mut Vec<u8>, kind: u16, value: &str) {
    let mut payload = Vec::with_capacity(value.len() + 1);
    payload.extend_from_slice(value.as_bytes());
    payload.push(0);
    attr(buf, kind, &payload);
}

/// Appends a nested attribute whose payload `fill` writes.
pub fn nested(buf: &mut Vec<u8>, kind: u16, fill: impl FnOnce(&mut Vec<u8>)) {
    let mut inner = Vec::new();
    fill(&mut inner);
    attr(buf, kind | NLA_F_NESTED, &inner);
}

/// (type, payload) of each attribute in `buf`.
pub fn attrs(mut buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if buf.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([buf[0], buf[1]]) as usize;
        let kind = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            return None;
        }
        let payload = &buf[4..len];
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
        Some((kind, payload))
    })
}

/// A netlink message: header (`kind`, `flags`, `seq`), the 4-byte family header, `attrs`.
pub fn message(kind: u16, flags: u16, seq: u32, family_header: [u8; 4], attrs: &[u8]) -> Vec<u8> {
    let len = 16 + 4 + attrs.len();
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(&flags.to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    m.extend_from_slice(&family_header);
    m.extend_from_slice(attrs);
    m
}

/// A socket of `protocol`, bound and connected to the kernel.
pub fn open(protocol: isize, what: &str) -> Result<Socket> {
    let mut socket = Socket::new(protocol).with_context(|| format!("opening a {what} socket"))?;
    socket
        .bind_auto()
        .with_context(|| format!("binding the {what} socket"))?;
    socket
        .connect(&NetlinkAddr::new(0, 0))
        .with_context(|| format!("connecting the {what} socket"))?;
    Ok(socket)
}

/// Reads replies to `seq` until the dump ends (or the ack arrives), handing each message's
/// attributes (after the family header) to `each`. A kernel error comes back as the
/// `std::io::Error` of its errno.
pub fn receive(socket: &Socket, seq: u32, what: &str, mut each: impl FnMut(&[u8])) -> Result<()> {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = socket
            .recv(&mut &mut buf[..], 0)
            .with_context(|| format!("reading from {what}"))?;
        let mut replies = messages(&buf[..n]);
        for (kind, msg_seq, body) in &mut replies {
            if msg_seq != seq {
                continue;
            }
            match kind {
                NLMSG_DONE => return Ok(()),
                NLMSG_ERROR => {
                    let code = i32::from_ne_bytes(
                        body.get(..4)
                            .map_or([0; 4], |b| b.try_into().expect("four bytes")),
                    );
                    if code == 0 {
                        return Ok(());
                    }
                    return Err(std::io::Error::from_raw_os_error(-code).into());
                }
                _ if body.len() >= 4 => each(&body[4..]),
                _ => {}
            }
        }
        if replies.malformed {
            bail!("malformed {what} message");
        }
    }
}

/// The netlink messages in a buffer the kernel filled: (type, sequence number, body after
/// the 16-byte header) each. Stops at the first message whose length does not fit, and
/// says so in `malformed`.
pub fn messages(buf: &[u8]) -> Messages<'_> {
    Messages {
        rest: buf,
        malformed: false,
    }
}

pub struct Messages<'a> {
    rest: &'a [u8],
    /// A message's length was below the header's or past the buffer's end.
    pub malformed: bool,
}

impl<'a> Iterator for Messages<'a> {
    type Item = (u16, u32, &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.rest;
        if rest.len() < 16 {
            return None;
        }
        let word =
            |at: usize| u32::from_ne_bytes([rest[at], rest[at + 1], rest[at + 2], rest[at + 3]]);
        let len = word(0) as usize;
        let kind = u16::from_ne_bytes([rest[4], rest[5]]);
        let seq = word(8);
        if len < 16 || len > rest.len() {
            self.malformed = true;
            self.rest = &[];
            return None;
        }
        self.rest = &rest[len.next_multiple_of(4).min(rest.len())..];
        Some((kind, seq, &rest[16..len]))
    }
}

/// (sequence number, error code) of each acknowledgement in `buf` (0: success, else a
/// negative errno).
pub fn acks(buf: &[u8]) -> Vec<(u32, i32)> {
    messages(buf)
        .filter(|(kind, _, body)| *kind == NLMSG_ERROR && body.len() >= 4)
        .map(|(_, seq, body)| {
            (
                seq,
                i32::from_ne_bytes([body[0], body[1], body[2], body[3]]),
            )
        })
        .collect()
}

/// The errno of a failed request, if that is what `e` is.
pub fn errno(e: &anyhow::Error) -> Option<i32> {
    e.downcast_ref::<std::io::Error>()
        .and_then(|e| e.raw_os_error())
}
