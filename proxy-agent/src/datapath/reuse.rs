//! Verified programs kept for the next agent of the same build: the kernel's verifier is
//! most of a start (1.6–4.4 s of CPU on two cores), and an agent restarted by its
//! DaemonSet, a crash or an OOM kill loads exactly what is already running.
//!
//! After verifying, the agent pins its programs under `<root>/programs/<build>`, where
//! `<build>` is a digest of everything that makes a program: the eBPF object's bytes and
//! the read-only globals the loader sets (features, switches, the node's namespace cookie).
//! The next agent computes the same digest and takes the pinned programs when, besides, each
//! of them still uses the very maps pinned under `<root>/maps` (map ids from the kernel):
//! maps rebuilt for a new layout or size, or removed by hand, make the programs stale. One
//! build's directory is kept; pinning a new one removes the others (the programs they held
//! stay loaded while an attachment runs them, until this agent replaces it).
//!
//! A directory is written under a temporary name and renamed when complete, so a crash
//! while pinning leaves nothing that looks reusable. Programs the verifier refused (the
//! IPv6 ones on older kernels) are absent from it: they would be refused again.

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

/// The kernel's name for a map (16 bytes with the terminating zero).
fn kernel_name(name: &str) -> &str {
    &name[..name.len().min(15)]
}

/// Checks that `program` uses, of the maps named like a pinned one, only the pinned one
/// (`pinned`: kernel name -> id). Its other maps (read-only data) are its own.
fn uses_pinned_maps(program: &Program, pinned: &HashMap<String, u32>) -> Result<()> {
    let ids = program
        .info()?
        .map_ids()?
        .context("this kernel does not list a program's maps")?;
    for id in ids {
        let info = MapInfo::from_id(id)?;
        let Some(name) = info.name_as_str() else {
            continue;
        };
        if let Some(&want) = pinned.get(name) {
            if want != id {
                bail!("it uses an earlier {name} map (id {id}, pinned: {want})");
            }
        }
    }
    Ok(())
}

/// The programs a previous agent of build `build` pinned, if each of `required` is there
/// and every one found uses the maps pinned now; `optional` ones are taken when present.
/// `Err` says why they are not reused (logged by the caller; the agent then verifies).
pub fn find(
    root: &BpffsRoot,
    build: &str,
    required: &[&str],
    optional: &[&str],
) -> Result<HashMap<String, Program>> {
    let dir = programs_dir(root).join(build);
    if !dir.is_dir() {
        bail!("no programs pinned for this build");
    }
    let mut pinned = HashMap::new();
    for entry in fs::read_dir(root.maps_dir())? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let info = MapInfo::from_pin(entry.path())
            .with_context(|| format!("reading pinned map {name}"))?;
        pinned.insert(kernel_name(&name).to_string(), info.id());
    }
    let mut programs = HashMap::new();
    for (name, needed) in required
        .iter()
        .map(|n| (n, true))
        .chain(optional.iter().map(|n| (n, false)))
    {
        let path = dir.join(name);
        if !path.exists() {
            if needed {
                bail!("program {name} is not pinned");
            }
            continue;
        }
        let program = from_pin(name, &path).with_context(|| format!("opening {name}'s pin"))?;
        uses_pinned_maps(&program, &pinned).with_context(|| format!("program {name}"))?;
        programs.insert(name.to_string(), program);
    }
    Ok(programs)
}

/// Pins `names` (loaded in `ebpf`) as build `build`'s programs, replacing what other builds
/// left.
pub fn keep(root: &BpffsRoot, build: &str, ebpf: &mut Ebpf, names: &[&str]) -> Result<()> {
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
        removed += fs::read_dir(&path).map(|d| d.count()).unwrap_or(0);
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

    #[test]
    fn kernel_names_are_cut_at_fifteen_bytes() {
        assert_eq!(kernel_name("BACKEND_RELEASED"), "BACKEND_RELEASE");
        assert_eq!(kernel_name("SERVICES"), "SERVICES");
    }
}
