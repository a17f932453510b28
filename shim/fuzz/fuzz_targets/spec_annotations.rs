//! An OCI spec (`config.json`, as containerd or the CRI passes it) and crab's annotations in it:
//! the spec checks at Create, the checkpoint policy, the privilege a spec grants, and an
//! Update's annotations.
#![no_main]

use std::collections::HashMap;

use crab_shim::checkpoint::policy;
use crab_shim::restore::privilege::Granted;
use libfuzzer_sys::fuzz_target;
use oci_spec::runtime::Spec;

fuzz_target!(|data: &[u8]| {
    if let Ok(spec) = serde_json::from_slice::<Spec>(data) {
        let _ = crab_shim::turns::check_spec_annotations(&spec);
        if let Ok(probes) = crab_shim::turns::probe_commands(&spec) {
            let args = spec.process().as_ref().and_then(|p| p.args().clone());
            let _ = crab_shim::turns::is_probe(&probes, &args.unwrap_or_default());
        }
        let _ = policy::for_container(&spec, policy::CheckpointPolicy::default());
        let _ = Granted::from_spec(&spec);
        let annotations: HashMap<String, String> = spec
            .annotations()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let _ = crab_shim::turns::requested_turn_end(&annotations);
    }
    // An Update's annotations alone (a JSON object of strings).
    if let Ok(annotations) = serde_json::from_slice::<HashMap<String, String>>(data) {
        let _ = crab_shim::turns::requested_turn_end(&annotations);
    }
});
