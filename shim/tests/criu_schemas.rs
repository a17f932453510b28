//! The field lists crab's strict reader of CRIU's messages holds
//! (`shim/src/checkpoint/criu_proto/schemas.rs`) are generated from CRIU's own `.proto`
//! files: `hack/criu-schemas.py` prints them from the descriptors the installed CRIU ships
//! compiled (python3-pycriu, installed by `make deps`), and the checked-in file must be what
//! it prints. A CRIU that adds a field to a message crab reads fails here first (its images
//! would be refused as holding an unknown field); regenerate the file then.

use std::{path::Path, process::Command};

/// The text without its layout (whitespace, a trailing comma in a list): rustfmt's business,
/// not the generator's.
fn tokens(text: &str) -> String {
    let joined: String = text.split_whitespace().collect();
    joined.replace(",]", "]")
}

#[test]
fn the_checked_in_schemas_are_what_criu_s_descriptors_give() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let script = repo.join("hack/criu-schemas.py");
    let out = Command::new("/usr/bin/python3")
        .arg(&script)
        .current_dir(std::env::temp_dir())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed (python3-pycriu installed? `make deps` installs it): {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8(out.stdout).unwrap();
    let file = repo.join("shim/src/checkpoint/criu_proto/schemas.rs");
    let checked_in = std::fs::read_to_string(&file).unwrap();
    assert!(
        tokens(&generated) == tokens(&checked_in),
        "{} is not what {} prints from the installed CRIU's descriptors: regenerate it \
         (/usr/bin/python3 hack/criu-schemas.py > {}; cargo fmt)\n--- generated ---\n{generated}",
        file.display(),
        script.display(),
        file.display(),
    );
    // The generator reads real descriptors: pstree_entry's threads are repeated.
    assert!(generated.contains("name: \"pstree_entry\""), "{generated}");
}
