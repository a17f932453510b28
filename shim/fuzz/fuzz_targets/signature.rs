//! A checkpoint image's `signature.json` (untrusted) against a trusted key, and the CRIU files
//! found against the statement it vouches for.
//!
//! The input is `signature.json`, a NUL byte, then `checkpoint.json`. A signature file that
//! parses is also re-signed with the trusted key (over the actual `checkpoint.json`), which must
//! then verify to the same statement: signing and verifying agree on every statement.
#![no_main]

use std::collections::BTreeMap;

use crab_shim::checkpoint::provenance::{self, FileDigest, SignatureFile, TrustedKeys};
use ed25519_dalek::SigningKey;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (sig, ckpt) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let key = SigningKey::from_bytes(&[7; 32]);
    let mut keys = TrustedKeys::new();
    keys.add(key.verifying_key(), "fuzz");
    if let Ok(statement) = keys.verify(sig, ckpt) {
        let _ = provenance::check_files(&statement, &statement.criu);
    }
    if let Ok(file) = serde_json::from_slice::<SignatureFile>(sig) {
        let mut statement = file.statement;
        statement.checkpoint_json = provenance::sha256(ckpt);
        let signed = provenance::sign(&key, statement.clone());
        let verified = keys
            .verify(&signed, ckpt)
            .expect("a statement signed by a trusted key verifies");
        assert_eq!(verified, statement);
        provenance::check_files(&statement, &statement.criu).expect("its own files match");
        // The files found: the part after the statement, as a JSON map of name to digest.
        if let Ok(found) = serde_json::from_slice::<BTreeMap<String, FileDigest>>(ckpt) {
            let _ = provenance::check_files(&statement, &found);
        }
    }
});
