//! The kernel's batch map operations (`BPF_MAP_UPDATE_BATCH`, `BPF_MAP_LOOKUP_BATCH`, 5.6+),
//! which aya does not offer: one system call for thousands of entries where a call each was
//! most of the work — the first sync's ~2 million writes at 100 000 services, and the
//! conntrack sweep's read of a full map (262 144 entries by default) every minute on the
//! sync loop. Callers fall back to single operations where the kernel refuses a batch.

use std::os::fd::{AsFd, AsRawFd};

use aya::{maps::MapData, Pod};

/// `union bpf_attr` as the `BPF_MAP_*_BATCH` commands read it.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// Entries per lookup batch: more than a hash bucket ever holds (the kernel refuses a
/// batch smaller than the bucket it stops at).
const LOOKUP_CHUNK: usize = 4096;

fn bpf(cmd: libc::c_long, attr: &mut BatchAttr) -> Result<(), std::io::Error> {
    // SAFETY: `attr` is a valid `bpf_attr` prefix for the batch commands; the pointers in it
    // are set by the callers to buffers that outlive the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut BatchAttr,
            std::mem::size_of::<BatchAttr>() as u32,
        )
    };
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Writes `keys[i]` → `values[i]` into `map` with one `BPF_MAP_UPDATE_BATCH`. On error: how
/// many were written, and why not the rest.
pub fn update_batch<K: Pod, V: Pod>(
    map: &MapData,
    keys: &[K],
    values: &[V],
) -> Result<(), (usize, std::io::Error)> {
    debug_assert_eq!(keys.len(), values.len());
    if keys.is_empty() {
        return Ok(());
    }
    // The key and value types are the maps' own, declared once in proxy-common with the
    // kernel's layout, so the arrays have the strides the kernel reads.
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: keys.len() as u32,
        map_fd: map.fd().as_fd().as_raw_fd() as u32,
        ..Default::default()
    };
    bpf(BPF_MAP_UPDATE_BATCH, &mut attr).map_err(|e| ((attr.count as usize).min(keys.len()), e))
}

/// Every entry of hash map `map`, read with `BPF_MAP_LOOKUP_BATCH` a chunk at a time; `None`
/// when the kernel refuses (the caller iterates instead). Entries that change during the
/// read are seen or not, as with an iteration.
pub fn lookup_all<K: Pod, V: Pod>(map: &MapData) -> Option<Vec<(K, V)>> {
    // SAFETY: `Pod` types are plain data: all-zero bytes are a value.
    let mut keys: Vec<K> = vec![unsafe { std::mem::zeroed() }; LOOKUP_CHUNK];
    let mut values: Vec<V> = vec![unsafe { std::mem::zeroed() }; LOOKUP_CHUNK];
    let mut out = Vec::new();
    let (mut token, mut next) = (0u32, 0u32);
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                &token as *const u32 as u64
            },
            out_batch: &mut next as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: LOOKUP_CHUNK as u32,
            map_fd: map.fd().as_fd().as_raw_fd() as u32,
            ..Default::default()
        };
        let end = match bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
            Ok(()) => false,
            // The end of the map: the last entries came with it.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Err(e) => {
                tracing::debug!("batch map lookups refused ({e}): iterating instead");
                return None;
            }
        };
        let n = (attr.count as usize).min(LOOKUP_CHUNK);
        out.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
        if end {
            return Some(out);
        }
        token = next;
        first = false;
    }
}
