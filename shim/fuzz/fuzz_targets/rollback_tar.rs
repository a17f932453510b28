//! crab's own fs layers as an in-place rollback reads them back (a checkpoint image's layers
//! travel through registries): names stay relative and beneath the root, sparse maps stay
//! within the file, data stays within the archive.
#![no_main]

use std::path::{Component, Path};

use crab_shim::rollback::tar::{self, Item};
use libfuzzer_sys::fuzz_target;

fn beneath(p: &Path) {
    assert!(
        p.components().all(|c| matches!(c, Component::Normal(_))),
        "{p:?} is not a relative path of normal components"
    );
}

fuzz_target!(|data: &[u8]| {
    let mut data_at = Vec::new();
    let read = tar::read(data, 10_000, |item, at| {
        match &item {
            Item::Entry(h) => {
                beneath(&h.path);
                if let Some(extents) = &h.sparse {
                    for (off, len) in extents {
                        assert!(off.checked_add(*len).is_some_and(|end| end <= h.size));
                    }
                }
            }
            Item::Whiteout(p) | Item::Opaque(p) => beneath(p),
        }
        data_at.extend(at);
        Ok(())
    });
    // An archive read to its end holds the data its entries point at.
    if read.is_ok() {
        for at in data_at {
            assert!(at
                .offset
                .checked_add(at.len)
                .is_some_and(|end| end <= data.len() as u64));
        }
    }
});
