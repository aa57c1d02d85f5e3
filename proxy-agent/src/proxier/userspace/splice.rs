//! Moving a TCP connection's bytes between the client's socket and the endpoint's with
//! `splice(2)` through a pipe per direction: the payload stays in the kernel (socket →
//! pipe → socket) instead of being copied into this process and back.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
};

use tokio::{io::Interest, net::TcpStream};

/// At most this much is moved per splice call (the default pipe capacity).
const CHUNK: usize = 64 * 1024;

struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl Pipe {
    fn new() -> io::Result<Self> {
        let mut fds = [0 as RawFd; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both are fresh descriptors owned by nobody else.
        Ok(unsafe {
            Pipe {
                read: OwnedFd::from_raw_fd(fds[0]),
                write: OwnedFd::from_raw_fd(fds[1]),
            }
        })
    }
}

fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: plain descriptors and null offsets (neither end is a seekable file).
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Moves everything `from` sends to `to`, then half-closes `to` as `from` did. Returns the
/// bytes moved.
async fn one_way(from: &TcpStream, to: &TcpStream, pipe: &Pipe) -> io::Result<u64> {
    let mut total = 0u64;
    loop {
        let filled = loop {
            from.readable().await?;
            match from.try_io(Interest::READABLE, || {
                splice(from.as_raw_fd(), pipe.write.as_raw_fd(), CHUNK)
            }) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        };
        if filled == 0 {
            socket2::SockRef::from(to).shutdown(std::net::Shutdown::Write)?;
            return Ok(total);
        }
        let mut left = filled;
        while left > 0 {
            to.writable().await?;
            match to.try_io(Interest::WRITABLE, || {
                splice(pipe.read.as_raw_fd(), to.as_raw_fd(), left)
            }) {
                Ok(n) => left -= n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        total += filled as u64;
    }
}

/// Relays `a` ↔ `b` until both directions have ended; returns the bytes moved each way.
pub async fn relay(a: &TcpStream, b: &TcpStream) -> io::Result<(u64, u64)> {
    let (ab, ba) = (Pipe::new()?, Pipe::new()?);
    tokio::try_join!(one_way(a, b, &ab), one_way(b, a, &ba))
}

#[cfg(test)]
mod tests {
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::{TcpListener, TcpStream},
    };

    /// A relay between two loopback connections carries a large payload intact both ways
    /// and passes each side's half-close on.
    #[tokio::test]
    async fn relay_carries_bytes_both_ways_and_half_closes() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front = listener.local_addr().unwrap();
        let upstream_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let back = upstream_listener.local_addr().unwrap();
        let relay = tokio::spawn(async move {
            let (client_side, _) = listener.accept().await.unwrap();
            let upstream = TcpStream::connect(back).await.unwrap();
            super::relay(&client_side, &upstream).await.unwrap()
        });
        let echo = tokio::spawn(async move {
            let (mut s, _) = upstream_listener.accept().await.unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.unwrap();
            got.reverse();
            s.write_all(&got).await.unwrap();
            s.shutdown().await.unwrap();
            got.len()
        });
        let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut client = TcpStream::connect(front).await.unwrap();
        let (mut rd, mut wr) = client.split();
        let send = async {
            wr.write_all(&payload).await.unwrap();
            wr.shutdown().await.unwrap();
        };
        let mut back_bytes = Vec::new();
        let recv = rd.read_to_end(&mut back_bytes);
        let ((), n) = tokio::join!(send, recv);
        n.unwrap();
        let mut want = payload.clone();
        want.reverse();
        assert_eq!(back_bytes.len(), want.len());
        assert!(back_bytes == want, "the payload came back altered");
        assert_eq!(echo.await.unwrap(), payload.len());
        let (there, back) = relay.await.unwrap();
        assert_eq!((there, back), (payload.len() as u64, payload.len() as u64));
    }
}
