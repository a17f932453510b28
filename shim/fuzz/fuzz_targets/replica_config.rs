//! A replicated checkpoint's config blob, as a registry serves it (untrusted), verified against
//! a trusted key; and a store's `lineage.json`. A config that parses is re-signed with the
//! trusted key over its own checkpoint.json: verifying it then must not panic, and whatever
//! verifies names only plain CRIU file names.
#![no_main]

use crab_shim::checkpoint::provenance::TrustedKeys;
use crab_shim::replication::artifact::{self, ReplicaConfig};
use ed25519_dalek::SigningKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let key = SigningKey::from_bytes(&[7; 32]);
    let mut keys = TrustedKeys::new();
    keys.add(key.verifying_key(), "fuzz");
    for image in [None, Some("sha256:0")] {
        if let Ok(v) = artifact::verify(data, "ns/p/c", image, &keys) {
            for name in v.criu.keys() {
                artifact::check_file_name(name).expect("verified names are plain");
            }
        }
    }
    if let Ok(mut c) = serde_json::from_slice::<ReplicaConfig>(data) {
        let statement = crab_shim::checkpoint::provenance::Statement {
            checkpoint_json: crab_shim::checkpoint::provenance::sha256(c.checkpoint_json.as_bytes()),
            criu: Default::default(),
            layers: None,
            rootfs: None,
        };
        c.signature = String::from_utf8(crab_shim::checkpoint::provenance::sign(&key, statement))
            .expect("a signature file is text");
        let bytes = serde_json::to_vec(&c).expect("serializes");
        let _ = artifact::verify(&bytes, &c.lineage, Some(&c.image), &keys);
    }
    let dir = std::env::temp_dir().join(format!("crab-fuzz-lineage-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    if std::fs::write(dir.join(crab_shim::checkpoint::lineage::RECORD), data).is_ok() {
        let _ = crab_shim::checkpoint::lineage::read(&dir);
    }
});
