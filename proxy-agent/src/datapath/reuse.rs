//! Verified programs kept for the next agent of the same build: the kernel's verifier is
//! most of a start (1.6–4.4 s of CPU on two cores), and an agent restarted by its
//! DaemonSet, a crash or an OOM kill loads exactly what is already running.
//!
//! After verifying, the agent pins its programs under `<root>/programs/<build>`, where
//! `<build>` is a digest of everything that makes them: the eBPF object's bytes, the
//! read-only globals the loader sets (features, switches, the node's namespace cookie,
//! whether IPv6 is wanted) and the ids of the maps pinned under `<root>/maps` (a program is
//! bound to the maps it was loaded with: maps rebuilt for a new layout or size, or removed
//! by hand, change the ids and so the digest). The next agent computes the same digest and
//! takes the programs it finds there. Map ids are read through the pins (`BPF_OBJ_GET`, then
//! the map's info by its descriptor), not opened by id, which would need `CAP_SYS_ADMIN`
//! (the DaemonSet grants `CAP_BPF` and `CAP_NET_ADMIN`). One build's directory is kept;
//! pinning a new one removes the others (the programs they held stay loaded while an
//! attachment runs them, until this agent replaces it).
//!
//! A directory is written under a temporary name and renamed when complete, so a crash
//! while pinning leaves nothing that looks reusable. IPv6 programs the verifier refused
//! (older kernels) are absent and the directory holds an `ipv6-refused` mark, so the next
//! agent neither retries them nor mistakes a missing pin for a refusal.

use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use aya::{
    maps::MapInfo,
    programs::{
        CgroupSock, CgroupSockAddr, CgroupSockAddrAttachType, CgroupSockAttachType, Program,
        SchedClassifier,
    },
    Ebpf,
};
use proxy_common::program_names;

use super::pins::BpffsRoot;

/// Bumped when what a directory holds changes meaning.
const FORMAT: &[u8] = b"proxy-agent programs v1";

/// The digest naming a build's directory: 32 hex digits of SHA-256 over the object and the
/// loader's globals (`globals`: each name with its value's bytes).
pub fn build_id(object: &[u8], globals: &[(&str, &[u8])]) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(FORMAT);
    ctx.update(&(object.len() as u64).to_le_bytes());
    ctx.update(object);
    for (name, value) in globals {
        ctx.update(name.as_bytes());
        ctx.update(&[0]);
        ctx.update(&(value.len() as u64).to_le_bytes());
        ctx.update(value);
    }
    ctx.finish().as_ref()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

pub fn programs_dir(root: &BpffsRoot) -> PathBuf {
    root.path.join("programs")
}

/// A program of ours from its pin, typed by its name (a pin does not say how a cgroup
/// program attaches).
fn from_pin(name: &str, path: &Path) -> Result<Program> {
    use CgroupSockAddrAttachType as A;
    let addr = |t: A| -> Result<Program> {
        Ok(Program::CgroupSockAddr(CgroupSockAddr::from_pin(path, t)?))
    };
    match name {
        program_names::SOCK_CONNECT4 => addr(A::Connect4),
        program_names::SOCK_SENDMSG4 => addr(A::UDPSendMsg4),
        program_names::SOCK_RECVMSG4 => addr(A::UDPRecvMsg4),
        program_names::SOCK_GETPEERNAME4 => addr(A::GetPeerName4),
        program_names::SOCK_CONNECT6 => addr(A::Connect6),
        program_names::SOCK_SENDMSG6 => addr(A::UDPSendMsg6),
        program_names::SOCK_RECVMSG6 => addr(A::UDPRecvMsg6),
        program_names::SOCK_GETPEERNAME6 => addr(A::GetPeerName6),
        program_names::SOCK_RELEASE => Ok(Program::CgroupSock(CgroupSock::from_pin(
            path,
            CgroupSockAttachType::SockRelease,
        )?)),
        _ => Ok(Program::SchedClassifier(SchedClassifier::from_pin(path)?)),
    }
}

/// The (name, id) of every map pinned under the root's `maps`, sorted: what the programs
/// of this start are bound to, as part of the build digest.
pub fn pinned_map_ids(root: &BpffsRoot) -> Result<Vec<(String, u32)>> {
    let mut ids = Vec::new();
    for entry in fs::read_dir(root.maps_dir())? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let info = MapInfo::from_pin(entry.path())
            .with_context(|| format!("reading pinned map {name}"))?;
        ids.push((name, info.id()));
    }
    ids.sort();
    Ok(ids)
}

/// A directory entry marking that this build's IPv6 programs were refused by the verifier.
const IPV6_REFUSED: &str = "ipv6-refused";

/// The programs a previous agent of build `build` pinned, if each of `required` is there,
/// and of `ipv6` (wanted by this start) either all or the mark that the verifier refused
/// them. Returns the programs and whether the IPv6 ones are among them. `Err` says why
/// nothing is reused (logged by the caller; the agent then verifies).
pub fn find(
    root: &BpffsRoot,
    build: &str,
    required: &[&str],
    ipv6: &[&str],
) -> Result<(HashMap<String, Program>, bool)> {
    let dir = programs_dir(root).join(build);
    if !dir.is_dir() {
        bail!("no programs pinned for this build");
    }
    let ipv6_refused = dir.join(IPV6_REFUSED).is_dir();
    let mut programs = HashMap::new();
    let wanted = required.iter().chain(ipv6.iter().filter(|_| !ipv6_refused));
    for name in wanted {
        let path = dir.join(name);
        if !path.exists() {
            bail!("program {name} is not pinned");
        }
        let program = from_pin(name, &path).with_context(|| format!("opening {name}'s pin"))?;
        programs.insert(name.to_string(), program);
    }
    Ok((programs, !ipv6.is_empty() && !ipv6_refused))
}

/// Pins `names` (loaded in `ebpf`) as build `build`'s programs, replacing what other builds
/// left; `ipv6_refused`: the IPv6 programs were wanted and the verifier refused them.
pub fn keep(
    root: &BpffsRoot,
    build: &str,
    ebpf: &mut Ebpf,
    names: &[&str],
    ipv6_refused: bool,
) -> Result<()> {
    let dir = programs_dir(root);
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let target = dir.join(build);
    // bpffs refuses dots in names.
    let partial = dir.join(format!("{build}-partial"));
    remove_all_but(&dir, None)?;
    fs::create_dir(&partial).with_context(|| format!("creating {}", partial.display()))?;
    for name in names {
        let program = ebpf
            .program_mut(name)
            .with_context(|| format!("eBPF object has no program {name}"))?;
        program
            .pin(partial.join(name))
            .with_context(|| format!("pinning program {name}"))?;
    }
    if ipv6_refused {
        fs::create_dir(partial.join(IPV6_REFUSED))?;
    }
    fs::rename(&partial, &target).with_context(|| format!("renaming {}", partial.display()))?;
    Ok(())
}

/// Removes every build's directory under `dir` but `keep`; returns how many programs went.
pub fn remove_all_but(dir: &Path, keep: Option<&str>) -> Result<usize> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry?;
        if keep.is_some_and(|k| entry.file_name() == k) {
            continue;
        }
        let path = entry.path();
        if !entry.file_type()?.is_dir() {
            // Not ours, but in our directory: gone with it.
            fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
            continue;
        }
        removed += fs::read_dir(&path)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                    .count()
            })
            .unwrap_or(0);
        fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))?;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_build_id_changes_with_the_object_and_with_every_global() {
        let base = build_id(b"object", &[("A", &[0]), ("B", &[1, 2])]);
        assert_eq!(base.len(), 32);
        assert_eq!(base, build_id(b"object", &[("A", &[0]), ("B", &[1, 2])]));
        assert_ne!(base, build_id(b"objecT", &[("A", &[0]), ("B", &[1, 2])]));
        assert_ne!(base, build_id(b"object", &[("A", &[1]), ("B", &[1, 2])]));
        assert_ne!(base, build_id(b"object", &[("A", &[0]), ("B", &[1, 3])]));
        // A value's bytes do not run into the next name.
        assert_ne!(
            base,
            build_id(b"object", &[("A", &[0, b'B']), ("", &[1, 2])])
        );
    }
}
