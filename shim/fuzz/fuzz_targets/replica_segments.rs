//! The CRIU blobs a registry's manifest lists for a replicated checkpoint (untrusted: names,
//! offsets and sizes as the registry says), checked against signed files by
//! `artifact::plan_files` before anything is pulled; and `artifact::segments` over any bytes.
//! Whatever plan is accepted uses each blob once, in order, tiles each signed file exactly,
//! and has no segment under the minimum but a file's last.
#![no_main]

use std::collections::BTreeMap;

use crab_shim::checkpoint::provenance::FileDigest;
use crab_shim::replication::artifact::{self, SegmentRef};
use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 5] = ["core-1.img", "pages-1.img", "mm-1.img", "../x", ".hidden"];

fuzz_target!(|data: &[u8]| {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let files = 1 + (n as usize % 3);
    if rest.len() < files * 4 {
        return;
    }
    let (sizes, records) = rest.split_at(files * 4);
    let mut criu = BTreeMap::new();
    for (i, s) in sizes.chunks_exact(4).enumerate() {
        let size = u32::from_le_bytes(s.try_into().unwrap()) as u64 % (8 << 20);
        criu.insert(
            NAMES[i].to_string(),
            FileDigest { sha256: format!("sha256:{i:064}"), size },
        );
    }
    let blobs: Vec<SegmentRef> = records
        .chunks_exact(10)
        .map(|r| SegmentRef {
            media_type: match r[1] & 1 {
                0 => artifact::MEDIA_TYPE_CRIU_FILE.to_string(),
                _ => "application/octet-stream".to_string(),
            },
            digest: format!("sha256:{:064x}", r[0]),
            size: i32::from_le_bytes(r[2..6].try_into().unwrap()) as i64,
            file: match r[0] as usize % 6 {
                5 => None,
                k => Some(NAMES[k].to_string()),
            },
            offset: match u32::from_le_bytes(r[6..10].try_into().unwrap()) {
                u32::MAX => None,
                0xffff_fffe => Some("x".into()),
                o => Some(o.to_string()),
            },
        })
        .collect();
    if let Ok(plans) = artifact::plan_files(&blobs, &criu) {
        assert_eq!(plans.len(), criu.len());
        let mut used: Vec<usize> = plans.iter().flat_map(|p| p.segments.clone()).collect();
        assert_eq!(used.len(), blobs.len(), "every blob is used");
        let sorted = used.clone();
        used.sort_unstable();
        assert_eq!(used, sorted, "in order");
        for p in &plans {
            let sizes: Vec<u64> = p.segments.iter().map(|&i| blobs[i].size as u64).collect();
            assert_eq!(sizes.iter().sum::<u64>(), p.want.size, "{}", p.name);
            let min = (artifact::SEGMENT_MIN_PAGES * artifact::SEGMENT_PAGE) as u64;
            for s in &sizes[..sizes.len().saturating_sub(1)] {
                assert!(*s >= min, "{}: a short segment before the end", p.name);
            }
        }
    }
    let segs = artifact::segments(data);
    assert_eq!(segs.first().map(|r| r.start), Some(0));
    assert_eq!(segs.last().map(|r| r.end), Some(data.len()));
    for w in segs.windows(2) {
        assert_eq!(w[0].end, w[1].start);
    }
});
