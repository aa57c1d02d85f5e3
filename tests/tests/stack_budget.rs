//! BPF's 512-byte stack, checked on the object the agent ships, without a kernel.
//!
//! The verifier adds up the frames of a program and of every subprogram it calls (a
//! `bpf_loop` callback counts as called where its address is taken), each frame rounded
//! up: to 32 bytes before 6.6 (Debian's 6.1, and 5.10), to 16 bytes since. A change that
//! grows the IPv4 packet program by a few bytes can pass on this host's kernel and be
//! refused on 6.1, which only the VM run would show (it did: 544 of 512 bytes). This reads
//! each function's deepest stack access and the calls between functions from the ELF, and
//! checks every program's deepest chain under both rules (Debian's 6.1 and 5.10 load every
//! program, the IPv6 ones included).

use std::collections::HashMap;

use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionIndex, SymbolKind};

const STACK_LIMIT: u32 = 512;
/// Added to every total before 6.6. Debian 6.1 twice refused `proxy_ingress` with
/// "combined stack size of 2 calls is 544" where this reading said 512 (its deepest access
/// 456 bytes down, a callee with no stack); what it counts beyond the accesses was not
/// found (not bpf_loop inlining, which comes after that check). With the margin the host
/// run refuses what the VM did; the shipped object reads 480 without it, and 6.1 loads it.
const BEFORE_6_6_MARGIN: u32 = 32;
const R10: u8 = 10;

/// One function of the object: its own frame and whom it calls.
struct Function {
    name: String,
    program: bool,
    frame: u32,
    calls: Vec<(SectionIndex, u64)>,
}

/// The functions of the object by (section, offset).
fn functions(elf: &[u8]) -> HashMap<(SectionIndex, u64), Function> {
    let file = object::File::parse(elf).expect("the eBPF object is an ELF file");
    let mut found = HashMap::new();
    for symbol in file.symbols() {
        if symbol.kind() != SymbolKind::Text || symbol.size() == 0 {
            continue;
        }
        let Some(index) = symbol.section_index() else {
            continue;
        };
        let section = file.section_by_index(index).unwrap();
        let data = section.data().unwrap();
        // Relocations by instruction offset: calls across sections, and often within one.
        let relocations: HashMap<u64, (SectionIndex, u64, bool)> = section
            .relocations()
            .filter_map(|(offset, r)| match r.target() {
                RelocationTarget::Symbol(s) => {
                    let s = file.symbol_by_index(s).ok()?;
                    Some((
                        offset,
                        (
                            s.section_index()?,
                            s.address(),
                            s.kind() == SymbolKind::Section,
                        ),
                    ))
                }
                _ => None,
            })
            .collect();
        let start = symbol.address();
        let code = &data[start as usize..(start + symbol.size()) as usize];
        let (frame, calls) = scan(code, start, index, &relocations);
        found.insert(
            (index, start),
            Function {
                name: symbol.name().unwrap_or("?").to_string(),
                program: section.name().is_ok_and(|n| n != ".text"),
                frame,
                calls,
            },
        );
    }
    found
}

/// The deepest stack byte a function touches (directly, or through a pointer made from the
/// frame pointer) and the functions it calls or passes as callbacks.
fn scan(
    code: &[u8],
    start: u64,
    section: SectionIndex,
    relocations: &HashMap<u64, (SectionIndex, u64, bool)>,
) -> (u32, Vec<(SectionIndex, u64)>) {
    let mut deepest = 0i64;
    let mut calls = Vec::new();
    // Registers holding r10 + offset.
    let mut frame_pointers: HashMap<u8, i64> = HashMap::new();
    let mut i = 0;
    while i + 8 <= code.len() {
        let insn = &code[i..i + 8];
        let (opcode, dst, src) = (insn[0], insn[1] & 0xf, insn[1] >> 4);
        let off = i16::from_le_bytes([insn[2], insn[3]]) as i64;
        let imm = i32::from_le_bytes([insn[4], insn[5], insn[6], insn[7]]) as i64;
        let at = start + i as u64;
        // Where a call or function address relocated against a section symbol points.
        let target = |pc_relative: i64| match relocations.get(&at) {
            Some(&(s, address, true)) => (s, (address as i64 + pc_relative) as u64),
            Some(&(s, address, false)) => (s, address),
            None => (section, (at as i64 + 8 + imm * 8) as u64),
        };
        match opcode & 0x7 {
            // LDX: a load from the stack.
            0x1 if src == R10 || frame_pointers.contains_key(&src) => {
                let base = frame_pointers.get(&src).copied().unwrap_or(0);
                deepest = deepest.max(-(base + off));
            }
            // ST, STX: a store to the stack.
            0x2 | 0x3 if dst == R10 || frame_pointers.contains_key(&dst) => {
                let base = frame_pointers.get(&dst).copied().unwrap_or(0);
                deepest = deepest.max(-(base + off));
            }
            _ => {}
        }
        match opcode {
            // rX = r10, or a copy of a frame pointer
            0xbf if src == R10 || frame_pointers.contains_key(&src) => {
                let base = frame_pointers.get(&src).copied().unwrap_or(0);
                frame_pointers.insert(dst, base);
            }
            // rX += imm on a frame pointer
            0x07 if frame_pointers.contains_key(&dst) => {
                let p = frame_pointers.get_mut(&dst).unwrap();
                *p += imm;
                deepest = deepest.max(-*p);
            }
            // A call: to a subprogram (src 1: BPF_PSEUDO_CALL) or a helper. Either clobbers
            // r0-r5; r6-r9 keep what they held.
            0x85 => {
                if src == 1 {
                    calls.push(target((imm + 1) * 8));
                }
                frame_pointers.retain(|r, _| *r > 5);
            }
            // A 16-byte load of a function's address (src 4: BPF_PSEUDO_FUNC), a callback.
            0x18 => {
                if src == 4 {
                    calls.push(target(imm));
                }
                frame_pointers.remove(&dst);
                i += 8;
            }
            _ => {
                // Any other write to a register ends what we knew of it.
                if opcode & 0x7 == 0x7 || opcode & 0x7 == 0x4 || opcode & 0x7 == 0x1 {
                    frame_pointers.remove(&dst);
                }
            }
        }
        i += 8;
    }
    (deepest.max(0) as u32, calls)
}

/// The deepest chain of frames from `at`, each rounded by `round`, and its names.
fn chain(
    functions: &HashMap<(SectionIndex, u64), Function>,
    at: (SectionIndex, u64),
    round: fn(u32) -> u32,
    depth: usize,
) -> (u32, Vec<String>) {
    let f = &functions[&at];
    assert!(depth < 16, "call chain through {} too deep", f.name);
    let deepest = f
        .calls
        .iter()
        .filter(|c| functions.contains_key(c))
        .map(|c| chain(functions, *c, round, depth + 1))
        .max_by_key(|(bytes, _)| *bytes)
        .unwrap_or_default();
    let mut names = vec![format!("{} ({})", short(&f.name), round(f.frame))];
    names.extend(deepest.1);
    (round(f.frame) + deepest.0, names)
}

fn short(name: &str) -> &str {
    // Mangled names end in the function's own name and a hash; enough to recognise it.
    name.rsplit("ebpf").next().unwrap_or(name)
}

fn before_6_6(frame: u32) -> u32 {
    frame.max(1).div_ceil(32) * 32
}

fn since_6_6(frame: u32) -> u32 {
    frame.div_ceil(16) * 16
}

#[test]
fn every_program_fits_bpfs_stack_on_old_and_new_kernels() {
    let mut over = Vec::new();
    for (build, object) in proxy_agent::datapath::Datapath::embedded_builds() {
        if object.is_empty() {
            panic!(
                "the agent was built without its eBPF object {build}: run `cargo xtask build-ebpf`"
            );
        }
        eprintln!("the datapath's {build} build:");
        over.extend(
            over_the_limit(object)
                .into_iter()
                .map(|o| format!("{build}: {o}")),
        );
    }
    assert!(
        over.is_empty(),
        "over BPF's {STACK_LIMIT} bytes:\n{}",
        over.join("\n")
    );
}

/// What in `object` needs more stack than BPF has, on either side of 6.6.
fn over_the_limit(object: &[u8]) -> Vec<String> {
    let functions = functions(object);
    let mut programs: Vec<_> = functions
        .iter()
        .filter(|(_, f)| f.program)
        .map(|(at, f)| (f.name.clone(), *at))
        .collect();
    programs.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(
        programs.iter().any(|(n, _)| n == "proxy_ingress"),
        "no proxy_ingress in the object"
    );
    let mut over = Vec::new();
    let mut deepest_chain = 0;
    for (name, at) in &programs {
        let (new, new_chain) = chain(&functions, *at, since_6_6, 0);
        let (old, old_chain) = chain(&functions, *at, before_6_6, 0);
        let old = old + BEFORE_6_6_MARGIN;
        deepest_chain = deepest_chain.max(new_chain.len());
        eprintln!(
            "{name}: {new} bytes (6.6+), {old} bytes (before 6.6, margin included): {}",
            old_chain.join(" → ")
        );
        if new > STACK_LIMIT {
            over.push(format!(
                "{name} needs {new} bytes on 6.6+: {}",
                new_chain.join(" → ")
            ));
        }
        if old > STACK_LIMIT {
            over.push(format!(
                "{name} needs {old} bytes before 6.6: {}",
                old_chain.join(" → ")
            ));
        }
    }
    // The check reads calls, or a chain would never be longer than its program.
    assert!(
        deepest_chain >= 3,
        "no call chain found: the object's calls were not read"
    );
    over
}
