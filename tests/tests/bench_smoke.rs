//! The mode comparison benchmark, run small: every output file is produced and well
//! formed, and every figure in the table is computed from the raw samples the run
//! recorded (each made of measured operations), not written by hand.

use std::process::Command;

use proxy_tests::{
    bench::report::{self, Run, Workload, BASELINE},
    require_kernel,
};

/// [W2-5]'s tests: their own part of `cargo xtask test`.
mod scale {
    use super::*;

    #[test]
    fn a_small_run_writes_the_table_the_samples_and_the_plots() {
        require_kernel!();
        let out = tempfile::tempdir().unwrap();
        let status = Command::new(env!("CARGO_BIN_EXE_modebench"))
            .args(["--services", "1,3", "--rounds", "2", "--seconds", "0.2"])
            .args(["--serve-timeout", "60", "--out"])
            .arg(out.path())
            .status()
            .expect("running modebench");
        assert!(status.success(), "modebench failed");

        let json = std::fs::read_to_string(out.path().join("results.json")).unwrap();
        let run: Run = serde_json::from_str(&json).expect("results.json is a run");
        assert_eq!(report::problems(&run), Vec::<String>::new());
        assert_eq!(run.service_counts(), [1, 3]);
        // Every mode this kernel has ran at both counts, beside the baseline; ipvs (not in
        // this kernel) is listed with its reason instead.
        let targets = run.targets();
        assert_eq!(targets[0], BASELINE);
        for mode in ["ebpf", "iptables", "nftables", "userspace"] {
            assert!(
                targets.iter().any(|t| t == mode),
                "{mode} missing: {targets:?}"
            );
            for n in [1, 3] {
                let c = run.control(n, mode).unwrap();
                assert!(c.note.is_none(), "{mode} at {n}: {:?}", c.note);
                assert!(c.cold_start_ms.unwrap() > 0.0 && c.one_change_ms.unwrap() > 0.0);
                // The agent's own sync of the change is part of the end-to-end time.
                let sync = c.one_change_sync_ms.unwrap();
                assert!(
                    sync > 0.0 && sync < c.one_change_ms.unwrap(),
                    "{mode}: {c:?}"
                );
                assert!(c.peak_rss_kib.unwrap() > 1024, "{mode}: an agent's RSS");
                assert!(c.restart_ms.unwrap() > 0.0, "{mode}: {c:?}");
                assert!(
                    c.datapath_objects.as_ref().unwrap().1 > 0.0,
                    "{mode}: {c:?}"
                );
                assert_eq!(run.values(n, mode, Workload::BulkBytesPerSecond).len(), 2);
                // The saturated workloads: parallel clients, and the CPU they cost.
                for w in [
                    Workload::SaturatedConnectionsPerSecond,
                    Workload::SaturatedTransactionsPerSecond,
                    Workload::CpuUsPerConnection,
                ] {
                    assert_eq!(run.values(n, mode, w).len(), 2, "{mode} at {n}: {w:?}");
                }
                for (busy, kernel) in run
                    .values(n, mode, Workload::CpuUsPerConnection)
                    .iter()
                    .zip(run.values(n, mode, Workload::KernelCpuUsPerConnection))
                {
                    assert!(
                        kernel <= *busy,
                        "{mode} at {n}: kernel {kernel} > busy {busy}"
                    );
                }
            }
        }
        // The control plane through the replayed API server too (paged lists, then a watch).
        for n in [1, 3] {
            let c = run
                .api
                .iter()
                .find(|c| c.services == n && c.mode == "ebpf")
                .unwrap_or_else(|| panic!("no API-source record at {n}: {:?}", run.api));
            assert!(c.note.is_none(), "API source at {n}: {:?}", c.note);
            let change = c.one_change_ms.unwrap();
            assert!(c.cold_start_ms.unwrap() > 0.0 && change > 0.0, "{c:?}");
            assert!(c.one_change_sync_ms.unwrap() < change, "{c:?}");
            assert!(c.datapath_objects.as_ref().unwrap().1 > 0.0, "{c:?}");
        }
        // The table is the samples': rebuilt from the JSON it is the same text.
        let md = std::fs::read_to_string(out.path().join("results.md")).unwrap();
        assert!(md.starts_with(&report::markdown(&run)), "{md}");
        assert!(md.contains("| none (straight to a pod) | 3 |"));
        assert!(md.contains("Through the API-server source"), "{md}");
        assert!(run.clients >= 2, "{}", run.clients);
        assert!(
            md.contains(&format!("Under saturation ({} client threads", run.clients)),
            "{md}"
        );
        for stem in ["connections", "connect-p99", "cpu-per-connection", "sync"] {
            let svg = std::fs::read_to_string(out.path().join(format!("{stem}.svg"))).unwrap();
            assert!(
                svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
                "{stem}.svg"
            );
            assert!(svg.contains("ebpf"), "{stem}.svg has a line per mode");
            let png = std::fs::read(out.path().join(format!("{stem}.png"))).unwrap();
            assert!(
                png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 1_000,
                "{stem}.png"
            );
            assert!(md.contains(&format!("]({stem}.svg)")));
        }
    }
}
