//! Embeds the eBPF objects built by `cargo xtask build-ebpf` (the datapath, and its build for
//! kernels without bpf_loop), or empty placeholders when they have not been built yet, so
//! `cargo build`/`check`/`clippy` work on a machine without the BPF toolchain; the agent then
//! explains at start how to build the object.
use std::{env, fs, path::PathBuf};

fn embed(env_var: &str, default: PathBuf, name: &str) {
    let object = env::var_os(env_var).map(PathBuf::from).unwrap_or(default);
    println!("cargo:rerun-if-env-changed={env_var}");
    println!("cargo:rerun-if-changed={}", object.display());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join(name);
    match fs::read(&object) {
        Ok(bytes) => fs::write(&out, bytes).expect("write embedded eBPF object"),
        Err(_) => fs::write(&out, []).expect("write empty eBPF placeholder"),
    }
}

fn main() {
    let ebpf = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("../proxy-ebpf/target");
    embed(
        "PROXY_EBPF_OBJECT",
        ebpf.join("bpfel-unknown-none/release/proxy-ebpf"),
        "proxy-ebpf.o",
    );
    embed(
        "PROXY_EBPF_OBJECT_NO_BPF_LOOP",
        ebpf.join("no-bpf-loop/bpfel-unknown-none/release/proxy-ebpf"),
        "proxy-ebpf-no-bpf-loop.o",
    );
}
