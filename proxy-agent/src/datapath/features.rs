//! What this kernel's BPF offers the datapath beyond what every supported kernel has,
//! probed once per process (each probe loads a two-instruction program). A missing
//! feature turns its part off at load time (a read-only global the verifier sees as a
//! constant, so the code that needs it is never checked) and is logged once, naming what
//! the node loses.

use std::sync::OnceLock;

use aya::{
    programs::ProgramType,
    sys::{is_helper_supported, BpfHelper},
};
use tracing::{info, warn};

/// The features found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelFeatures {
    /// `bpf_set_retval` in socket hooks (5.18): a connect to a service without endpoints
    /// fails with ECONNREFUSED instead of EPERM.
    pub sock_set_retval: bool,
    /// `bpf_get_socket_cookie` in cgroup/sock programs (5.3): the release hook can find the
    /// socket it counted for a least-connection scheduler. Without it, pods' sockets to
    /// such frontends are left to the tc path.
    pub sock_release_cookie: bool,
    /// `bpf_loop` in tc programs (5.17): least-connection scans verified once, over up to
    /// 1 024 backends. Without it the agent loads the datapath's `no-bpf-loop` build, whose
    /// scans compare 16 backends.
    pub bpf_loop: bool,
}

impl KernelFeatures {
    /// This kernel's, probed on first use and logged then.
    pub fn get() -> KernelFeatures {
        static FOUND: OnceLock<KernelFeatures> = OnceLock::new();
        *FOUND.get_or_init(|| {
            let found = KernelFeatures::probe();
            found.report();
            found
        })
    }

    fn probe() -> KernelFeatures {
        KernelFeatures {
            sock_set_retval: helper(ProgramType::CgroupSockAddr, BpfHelper::BPF_FUNC_set_retval),
            sock_release_cookie: helper(
                ProgramType::CgroupSock,
                BpfHelper::BPF_FUNC_get_socket_cookie,
            ),
            bpf_loop: helper(ProgramType::SchedClassifier, BpfHelper::BPF_FUNC_loop),
        }
    }

    /// Each probed feature by its metric label (`proxy_agent_ebpf_feature{feature}`).
    pub fn flags(&self) -> [(&'static str, bool); 3] {
        [
            ("bpf_loop", self.bpf_loop),
            ("sock_set_retval", self.sock_set_retval),
            ("sock_release_cookie", self.sock_release_cookie),
        ]
    }

    /// The datapath build this kernel loads (see [`crate::datapath::Datapath::embedded_builds`]).
    pub fn datapath_build(&self) -> &'static str {
        if self.bpf_loop {
            "bpf_loop"
        } else {
            "no-bpf-loop"
        }
    }

    /// What each missing feature costs the node, one line each (logged as warnings).
    pub fn consequences(&self) -> Vec<&'static str> {
        let mut lines = Vec::new();
        if !self.bpf_loop {
            lines.push("this kernel has no bpf_loop (5.17+): the datapath's build without it is loaded; least-connection schedulers (lc, wlc, sed, nq, lblc, lblcr) compare 16 backends per new flow, from a random start, instead of up to 1 024, and the socket hooks leave them to the tc path (the node's own sockets get a random backend)");
        }
        if !self.sock_release_cookie {
            lines.push("this kernel's cgroup/sock programs cannot read a socket's cookie: pods' connections to Services with a least-connection scheduler (lc, wlc, sed, nq, lblc, lblcr) are translated by the tc path, not at connect time");
        }
        if !self.sock_set_retval {
            lines.push("this kernel's socket hooks cannot set their error (no bpf_set_retval, 5.18+): pods' connects to a Service without endpoints are refused by the tc path (a TCP reset), the node's own fail with EPERM (\"Operation not permitted\") instead of ECONNREFUSED");
        }
        lines
    }

    fn report(&self) {
        let lines = self.consequences();
        for line in &lines {
            warn!("{line}");
        }
        if lines.is_empty() {
            info!("kernel BPF features: everything the datapath can use (bpf_loop, bpf_set_retval, socket cookies in cgroup/sock)");
        }
    }
}

/// Whether `program_type` may call `helper`; a probe that cannot decide counts as no.
fn helper(program_type: ProgramType, helper: BpfHelper) -> bool {
    match is_helper_supported(program_type, helper) {
        Ok(supported) => supported,
        Err(e) => {
            warn!(
                ?helper,
                "probing a BPF helper failed: {e}; assuming it is missing"
            );
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: KernelFeatures = KernelFeatures {
        sock_set_retval: true,
        sock_release_cookie: true,
        bpf_loop: true,
    };

    /// A kernel with everything (6.18) loses nothing; Debian 11's 5.10 (no bpf_loop, no
    /// bpf_set_retval) loads the build without bpf_loop and is told what each costs.
    #[test]
    fn each_missing_feature_picks_the_build_and_says_what_it_costs() {
        assert_eq!(ALL.datapath_build(), "bpf_loop");
        assert!(ALL.consequences().is_empty());
        assert!(ALL.flags().iter().all(|(_, on)| *on));

        let debian_11 = KernelFeatures {
            bpf_loop: false,
            sock_set_retval: false,
            ..ALL
        };
        assert_eq!(debian_11.datapath_build(), "no-bpf-loop");
        let said = debian_11.consequences();
        assert_eq!(said.len(), 2, "{said:?}");
        assert!(said[0].contains("no bpf_loop (5.17+)") && said[0].contains("16 backends"));
        assert!(said[1].contains("bpf_set_retval") && said[1].contains("EPERM"));
        assert_eq!(
            debian_11.flags(),
            [
                ("bpf_loop", false),
                ("sock_set_retval", false),
                ("sock_release_cookie", true)
            ]
        );
    }
}
