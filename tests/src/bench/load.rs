//! Load generators, in-tree and blocking: each runs in the
//! client pod's namespace against the lab's backend servers (a greeting then echo on TCP
//! 8080, a counting sink on TCP 8081), so the client and the servers cost the same for
//! every mode and for the no-proxy baseline, and what differs is the path between them.
//!
//! In-tree rather than `wrk`/`iperf3`/`netperf`: the workloads need the lab's own servers
//! (a new connection must reach a backend through the service, its greeting proves which),
//! per-connection latencies as raw samples, and no extra packages; one client thread keeps
//! pace here because every connection crosses two veths and the datapath, which costs far
//! more than the loop around it. The saturated workloads run several such loops at once,
//! enough to keep every core busy, and read the machine's CPU time around them.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{Shutdown, SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

/// Bytes of one request/response transaction (TCP_RR-like).
pub const RR_BYTES: usize = 64;
/// Bytes per write of the bulk transfer.
pub const BULK_CHUNK: usize = 64 * 1024;

const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Connect-request-close (TCP_CRR-like): connections per second and each connection's
/// connect time.
#[derive(Clone, Debug, Default)]
pub struct ConnectRate {
    pub connections: usize,
    pub seconds: f64,
    /// Connect (SYN to established) of every connection, microseconds.
    pub connect_us: Vec<f64>,
}

impl ConnectRate {
    pub fn per_second(&self) -> f64 {
        self.connections as f64 / self.seconds
    }
}

fn connect(to: SocketAddr) -> Result<TcpStream> {
    TcpStream::connect_timeout(&to, IO_TIMEOUT).with_context(|| format!("connecting to {to}"))
}

/// For `duration`: connect, read the greeting line, close.
pub fn connect_rate(to: SocketAddr, duration: Duration) -> Result<ConnectRate> {
    let mut out = ConnectRate::default();
    let started = Instant::now();
    while started.elapsed() < duration {
        let t = Instant::now();
        let stream = connect(to)?;
        out.connect_us.push(t.elapsed().as_secs_f64() * 1e6);
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        let mut line = String::new();
        BufReader::new(&stream)
            .read_line(&mut line)
            .with_context(|| format!("reading the greeting of {to}"))?;
        if line.is_empty() {
            bail!("{to} closed without a greeting");
        }
        out.connections += 1;
    }
    out.seconds = started.elapsed().as_secs_f64();
    Ok(out)
}

/// Transactions per second on one kept-open connection (TCP_RR-like): write
/// [`RR_BYTES`], read them back from the echo, repeat for `duration`.
pub fn transaction_rate(to: SocketAddr, duration: Duration) -> Result<f64> {
    let stream = connect(to)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut greeting = String::new();
    reader.read_line(&mut greeting)?;
    let mut writer = stream;
    let request = [b'x'; RR_BYTES];
    let mut answer = [0u8; RR_BYTES];
    let mut transactions = 0usize;
    let started = Instant::now();
    while started.elapsed() < duration {
        writer.write_all(&request)?;
        reader
            .read_exact(&mut answer)
            .with_context(|| format!("reading the echo from {to}"))?;
        transactions += 1;
    }
    Ok(transactions as f64 / started.elapsed().as_secs_f64())
}

/// Bulk TCP throughput, bytes per second: writes for `duration` to the counting sink,
/// half-closes, and divides the byte count the sink reports (what arrived) by the time
/// until that report.
pub fn bulk_throughput(to: SocketAddr, duration: Duration) -> Result<f64> {
    let mut stream = connect(to)?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    let chunk = vec![0x5au8; BULK_CHUNK];
    let started = Instant::now();
    while started.elapsed() < duration {
        stream.write_all(&chunk)?;
    }
    stream.shutdown(Shutdown::Write)?;
    let mut report = String::new();
    stream
        .read_to_string(&mut report)
        .with_context(|| format!("reading the byte count from {to}"))?;
    let seconds = started.elapsed().as_secs_f64();
    let received: u64 = report
        .trim()
        .parse()
        .with_context(|| format!("the sink at {to} answered {report:?}"))?;
    Ok(received as f64 / seconds)
}

/// `work` on `clients` threads at once; every thread's result, in order.
fn on_threads<T: Send>(clients: usize, work: impl Fn() -> Result<T> + Sync) -> Vec<Result<T>> {
    std::thread::scope(|scope| {
        let running: Vec<_> = (0..clients.max(1)).map(|_| scope.spawn(&work)).collect();
        running
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a client thread panicked"))
            })
            .collect()
    })
}

/// [`connect_rate`] from `clients` threads at once (each its own connect-request-close
/// loop), merged: enough of them keep every core busy, so what the path between client
/// and backend costs shows as fewer connections per second and more CPU per connection.
pub fn parallel_connect_rate(
    to: SocketAddr,
    duration: Duration,
    clients: usize,
) -> Result<ConnectRate> {
    let started = Instant::now();
    let mut out = ConnectRate::default();
    for r in on_threads(clients, || connect_rate(to, duration)) {
        let r = r?;
        out.connections += r.connections;
        out.connect_us.extend(r.connect_us);
    }
    out.seconds = started.elapsed().as_secs_f64();
    Ok(out)
}

/// [`transaction_rate`] on `clients` kept-open connections at once, summed.
pub fn parallel_transaction_rate(
    to: SocketAddr,
    duration: Duration,
    clients: usize,
) -> Result<f64> {
    on_threads(clients, || transaction_rate(to, duration))
        .into_iter()
        .sum()
}

/// The machine's CPU time so far, from `/proc/stat` (every namespace shares the cores, so
/// this is the client's, the backends' and the datapath's together), in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuTimes {
    /// Everything but idle and I/O wait.
    pub busy_us: f64,
    /// In the kernel: system, hard and soft interrupts (where a datapath runs).
    pub kernel_us: f64,
    pub total_us: f64,
}

impl CpuTimes {
    pub fn now() -> Result<Self> {
        let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
        Self::parse(&stat, unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64)
    }

    /// The aggregate `cpu` line of `/proc/stat`, in ticks of `1 / hz` seconds.
    pub fn parse(stat: &str, hz: f64) -> Result<Self> {
        let line = stat
            .lines()
            .find(|l| l.starts_with("cpu "))
            .context("/proc/stat has no cpu line")?;
        let t: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse::<f64>())
            .collect::<Result<_, _>>()
            .context("/proc/stat's cpu line")?;
        if t.len() < 8 || hz <= 0.0 {
            bail!("/proc/stat's cpu line is short: {line}");
        }
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let us = |ticks: f64| ticks * 1e6 / hz;
        let kernel = t[2] + t[5] + t[6];
        let busy = t[0] + t[1] + kernel + t[7];
        Ok(CpuTimes {
            busy_us: us(busy),
            kernel_us: us(kernel),
            total_us: us(busy + t[3] + t[4]),
        })
    }

    /// What was spent between `earlier` and `self`.
    pub fn since(&self, earlier: &CpuTimes) -> CpuTimes {
        CpuTimes {
            busy_us: self.busy_us - earlier.busy_us,
            kernel_us: self.kernel_us - earlier.kernel_us,
            total_us: self.total_us - earlier.total_us,
        }
    }
}

/// The `p`-quantile (0..=1) of `samples` (nearest rank on a sorted copy).
pub fn quantile(samples: &[f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Median (the mean of the middle two of an even count), min and max of `values`.
pub fn median_min_max(values: &[f64]) -> (f64, f64, f64) {
    if values.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let mid = sorted.len() / 2;
    let median = if sorted.len().is_multiple_of(2) {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    } else {
        sorted[mid]
    };
    (median, sorted[0], sorted[sorted.len() - 1])
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// The lab's two servers on loopback: greeting + echo, and the counting sink.
    fn servers() -> (SocketAddr, SocketAddr) {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let sink = TcpListener::bind("127.0.0.1:0").unwrap();
        let addrs = (echo.local_addr().unwrap(), sink.local_addr().unwrap());
        std::thread::spawn(move || {
            for s in echo.incoming().flatten() {
                std::thread::spawn(move || crate::lab::serve_greeting_then_echo(s, "pod"));
            }
        });
        std::thread::spawn(move || {
            for s in sink.incoming().flatten() {
                std::thread::spawn(move || crate::lab::count_and_report(s));
            }
        });
        addrs
    }

    #[test]
    fn the_generators_measure_what_the_servers_saw() {
        let (echo, sink) = servers();
        let rate = connect_rate(echo, Duration::from_millis(200)).unwrap();
        assert!(rate.connections > 10, "{rate:?}");
        assert_eq!(rate.connect_us.len(), rate.connections);
        assert!(rate.per_second() > 0.0);
        assert!(transaction_rate(echo, Duration::from_millis(200)).unwrap() > 100.0);
        // At least one chunk crossed, counted by the sink, not by the writer.
        let bytes_per_second = bulk_throughput(sink, Duration::from_millis(200)).unwrap();
        assert!(bytes_per_second > BULK_CHUNK as f64, "{bytes_per_second}");
        // A refused connection is an error, not a fast one.
        let closed = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert!(connect_rate(closed, Duration::from_millis(50)).is_err());
    }

    #[test]
    fn parallel_clients_add_up() {
        let (echo, _) = servers();
        let rate = parallel_connect_rate(echo, Duration::from_millis(200), 3).unwrap();
        assert!(rate.connections > 30, "{rate:?}");
        assert_eq!(rate.connect_us.len(), rate.connections);
        assert!(parallel_transaction_rate(echo, Duration::from_millis(200), 3).unwrap() > 300.0);
        let before = CpuTimes::now().unwrap();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let spent = CpuTimes::now().unwrap().since(&before);
        assert!(
            spent.busy_us > 0.0 && spent.total_us >= spent.busy_us,
            "{spent:?}"
        );
    }

    #[test]
    fn cpu_times_read_the_aggregate_line() {
        let stat = "cpu  100 5 40 1000 10 3 7 2 0 0\ncpu0 50 2 20 500 5 1 3 1 0 0\n";
        let t = CpuTimes::parse(stat, 100.0).unwrap();
        // Kernel: system 40 + irq 3 + softirq 7 = 50 ticks of 10 ms.
        assert_eq!(t.kernel_us, 500_000.0);
        // Busy: user 100 + nice 5 + kernel 50 + steal 2 = 157 ticks.
        assert_eq!(t.busy_us, 1_570_000.0);
        assert_eq!(t.total_us, 1_570_000.0 + 10_100_000.0);
        assert!(CpuTimes::parse("intr 1 2\n", 100.0).is_err());
        assert!(CpuTimes::parse("cpu  1 2 3\n", 100.0).is_err());
    }

    #[test]
    fn quantiles_use_the_samples() {
        let s = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(quantile(&s, 0.5), 3.0);
        assert_eq!(quantile(&s, 0.99), 5.0);
        assert_eq!(median_min_max(&s), (3.0, 1.0, 5.0));
        assert_eq!(median_min_max(&[4.0, 1.0]), (2.5, 1.0, 4.0));
        assert!(quantile(&[], 0.5).is_nan());
    }
}
