//! Maglev lookup tables (Eisenbud et al., NSDI 2016), IPVS's `mh` scheduler: each backend
//! walks the table in its own permutation and claims free entries in turn, so every backend
//! owns an equal share (within one entry) and removing one of N backends moves about 1/N of
//! the entries, almost all of them the removed backend's own.

use std::net::{IpAddr, SocketAddr};

/// FNV-1a over the backend's address and port, with a seed: two independent hashes give a
/// backend its permutation (offset and skip).
fn hash(addr: &SocketAddr, seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    let ip = match addr.ip() {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    for b in ip.into_iter().chain(addr.port().to_be_bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The table of `size` entries (a prime) over `backends`: entry -> index into `backends`.
/// Empty when there are no backends. Depends only on the set of backends, not their order.
pub fn table(backends: &[SocketAddr], size: u32) -> Vec<u32> {
    let m = size as u64;
    let n = backends.len();
    if n == 0 || m < 2 {
        return Vec::new();
    }
    let mut sorted: Vec<(usize, SocketAddr)> = backends.iter().copied().enumerate().collect();
    sorted.sort_by_key(|(_, a)| *a);
    let perm: Vec<(u64, u64)> = sorted
        .iter()
        .map(|(_, a)| (hash(a, 0x5bd1_e995) % m, hash(a, 0x1b87_3593) % (m - 1) + 1))
        .collect();
    let mut next = vec![0u64; n];
    let mut entries = vec![u32::MAX; size as usize];
    let mut filled = 0u64;
    'fill: loop {
        for (i, (offset, skip)) in perm.iter().enumerate() {
            let mut c = (offset + next[i] * skip) % m;
            while entries[c as usize] != u32::MAX {
                next[i] += 1;
                c = (offset + next[i] * skip) % m;
            }
            entries[c as usize] = sorted[i].0 as u32;
            next[i] += 1;
            filled += 1;
            if filled == m {
                break 'fill;
            }
        }
    }
    entries
}

/// The smallest prime >= `n` (table sizes must be prime for the permutations to cover it).
pub fn prime_at_least(n: u32) -> u32 {
    let is_prime = |k: u32| {
        k >= 2
            && (2..)
                .take_while(|d| d * d <= k)
                .all(|d| !k.is_multiple_of(d))
    };
    (n.max(2)..).find(|k| is_prime(*k)).unwrap_or(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods(n: u8) -> Vec<SocketAddr> {
        (1..=n)
            .map(|i| SocketAddr::new([10, 244, 0, i].into(), 8080))
            .collect()
    }

    fn last_octet(a: &SocketAddr) -> u8 {
        match a.ip() {
            IpAddr::V4(v4) => v4.octets()[3],
            IpAddr::V6(v6) => v6.octets()[15],
        }
    }

    #[test]
    fn every_backend_owns_an_equal_share() {
        let backends = pods(7);
        let t = table(&backends, 65537);
        let mut counts = [0usize; 7];
        for e in &t {
            counts[*e as usize] += 1;
        }
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(max - min <= 1, "{counts:?}");
    }

    #[test]
    fn removing_one_of_n_backends_moves_about_one_nth_of_the_entries() {
        let before = pods(10);
        let after: Vec<SocketAddr> = before
            .iter()
            .copied()
            .filter(|a| last_octet(a) != 4)
            .collect();
        let size = 65537;
        let t1: Vec<SocketAddr> = table(&before, size)
            .iter()
            .map(|i| before[*i as usize])
            .collect();
        let t2: Vec<SocketAddr> = table(&after, size)
            .iter()
            .map(|i| after[*i as usize])
            .collect();
        let moved = t1.iter().zip(&t2).filter(|(a, b)| a != b).count();
        let removed_share = t1.iter().filter(|a| last_octet(a) == 4).count();
        // The removed backend's own entries must move; the others barely.
        let collateral = moved - removed_share;
        assert!(
            (moved as f64) < 1.2 * size as f64 / 10.0,
            "{moved} of {size} moved (1/N = {})",
            size / 10
        );
        assert!(
            collateral * 20 < size as usize,
            "{collateral} entries of kept backends moved"
        );
    }

    #[test]
    fn the_table_depends_on_the_set_not_the_order() {
        let mut a = pods(5);
        let t1: Vec<SocketAddr> = table(&a, 251).iter().map(|i| a[*i as usize]).collect();
        a.reverse();
        let t2: Vec<SocketAddr> = table(&a, 251).iter().map(|i| a[*i as usize]).collect();
        assert_eq!(t1, t2);
    }

    #[test]
    fn primes() {
        assert_eq!(prime_at_least(16380), 16381);
        assert_eq!(prime_at_least(65537), 65537);
        assert_eq!(prime_at_least(1), 2);
    }
}
