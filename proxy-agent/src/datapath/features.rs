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

    fn report(&self) {
        if !self.bpf_loop {
            warn!(
                "this kernel has no bpf_loop (5.17+): the datapath's build without it is loaded; least-connection schedulers (lc, wlc, sed, nq, lblcr) compare 16 backends per new flow, from a random start, instead of up to 1 024"
            );
        }
        if !self.sock_release_cookie {
            warn!(
                "this kernel's cgroup/sock programs cannot read a socket's cookie: pods' connections to Services with a least-connection scheduler (lc, wlc, sed, nq, lblc, lblcr) are translated by the tc path, not at connect time"
            );
        }
        if self.sock_set_retval {
            info!("kernel BPF features: socket hooks can set their error (bpf_set_retval)");
        } else {
            warn!(
                "this kernel's socket hooks cannot set their error (no bpf_set_retval, 5.18+): pods' connects to a Service without endpoints are refused by the tc path (a TCP reset), the node's own fail with EPERM (\"Operation not permitted\") instead of ECONNREFUSED"
            );
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
