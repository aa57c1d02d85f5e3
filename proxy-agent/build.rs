//! Embeds the eBPF object built by `cargo xtask build-ebpf`, or an empty placeholder when it
//! has not been built yet, so `cargo build`/`check`/`clippy` work on a machine without the BPF
//! toolchain; the agent then explains at start how to build the object.
use std::{env, fs, path::PathBuf};

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let object = env::var_os("PROXY_EBPF_OBJECT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            manifest_dir.join("../proxy-ebpf/target/bpfel-unknown-none/release/proxy-ebpf")
        });
    println!("cargo:rerun-if-env-changed=PROXY_EBPF_OBJECT");
    println!("cargo:rerun-if-changed={}", object.display());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("proxy-ebpf.o");
    match fs::read(&object) {
        Ok(bytes) => fs::write(&out, bytes).expect("write embedded eBPF object"),
        Err(_) => fs::write(&out, []).expect("write empty eBPF placeholder"),
    }
}
